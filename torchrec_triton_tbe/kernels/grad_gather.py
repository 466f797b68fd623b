"""Gathering the output-gradient rows that flow into embedding rows, R segments at a time.

A segment is a run (short path) or a chunk of a run (long path): sorted lookups [s_r, e_r). R
segments advance together, one lookup each per step, so a program has R independent dependent-load
chains (sorted slot -> lookup position -> bag -> gradient row) in flight instead of one.

Byte accounting per lookup: sorted position (8 B), bag id (4 B), the feature's output column (4 B,
cached), [psw 4 B], [two offsets for MEAN], and one D-wide gradient row (D * 4 B for fp32 gradients,
the dominant term).
"""

import triton
import triton.language as tl


@triton.jit
def gather_segments(
    grad_out_ptr,
    perm_ptr,
    bags_ptr,
    offsets_ptr,
    psw_ptr,
    feature_out_offset_ptr,
    s,
    n,
    B,
    total_D,
    cols,
    cmask,
    POOLING_MEAN: tl.constexpr,
    WEIGHTED: tl.constexpr,
    R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """s, n: [R] first sorted slot and length of each segment (n == 0: inactive).
    cmask: [R, BLOCK_D]. Returns [R, BLOCK_D] fp32: sum_j scale * grad_out[b_j, out_offset[t_j] + cols],
    accumulated in slot order (bitwise reproducible). scale = psw (weighted) / bag length (MEAN)."""
    acc = tl.zeros([R, BLOCK_D], dtype=tl.float32)
    for j in range(0, tl.max(n, axis=0)):
        m = j < n
        pos = tl.load(perm_ptr + s + j, mask=m, other=0)
        bag = tl.load(bags_ptr + pos, mask=m, other=0)
        t = bag // B
        b = bag - t * B
        o_col = tl.load(feature_out_offset_ptr + t, mask=m, other=0)
        row = b.to(tl.int64) * total_D + o_col
        go = tl.load(grad_out_ptr + row[:, None] + cols[None, :], mask=m[:, None] & cmask, other=0.0)
        go = go.to(tl.float32)
        if WEIGHTED or POOLING_MEAN:
            scale = tl.full([R], 1.0, tl.float32)
            if WEIGHTED:
                scale = tl.load(psw_ptr + pos, mask=m, other=0.0).to(tl.float32)
            if POOLING_MEAN:
                bag64 = bag.to(tl.int64)
                L = tl.load(offsets_ptr + bag64 + 1, mask=m, other=1) - tl.load(offsets_ptr + bag64, mask=m, other=0)
                scale = scale / tl.maximum(L, 1).to(tl.float32)
            go = go * scale[:, None]
        acc += go
    return acc


@triton.jit
def locate_rows(
    sorted_keys_ptr,
    perm_ptr,
    bags_ptr,
    feature_key_offset_ptr,
    feature_weight_offset_ptr,
    feature_row_offset_ptr,
    feature_dim_ptr,
    s,
    rmask,
    B,
):
    """For R runs starting at sorted slots ``s``: (row start in the flat weights, per-row optimizer
    state index, D). Any lookup of a run names its table; the first one is used."""
    key = tl.load(sorted_keys_ptr + s, mask=rmask, other=0).to(tl.int64)
    pos = tl.load(perm_ptr + s, mask=rmask, other=0)
    t = tl.load(bags_ptr + pos, mask=rmask, other=0) // B
    row = key - tl.load(feature_key_offset_ptr + t, mask=rmask, other=0)
    D = tl.load(feature_dim_ptr + t, mask=rmask, other=1)
    w_row = tl.load(feature_weight_offset_ptr + t, mask=rmask, other=0) + row * D
    state_row = tl.load(feature_row_offset_ptr + t, mask=rmask, other=0) + row
    return w_row, state_row, D
