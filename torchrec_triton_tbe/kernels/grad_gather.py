"""Sum of the output-gradient rows that flow into one embedding row (a run, or a chunk of one).

Byte accounting per lookup: read the sorted position (8 B), its bag id (4 B), the feature's output
column (4 B, cached), [psw 4 B], [two offsets for MEAN], and one D-wide gradient row (D * 4 B for
fp32 gradients). The gradient row is the dominant term and is read once per lookup.
"""

import triton
import triton.language as tl


@triton.jit
def gather_grad_sum(
    grad_out_ptr,
    perm_ptr,
    bags_ptr,
    offsets_ptr,
    psw_ptr,
    feature_out_offset_ptr,
    k_begin,
    k_end,
    B,
    total_D,
    cols,
    cmask,
    POOLING_MEAN: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GATHER: tl.constexpr,
):
    """Sorted lookups [k_begin, k_end): sum_k scale_k * grad_out[b_k, out_offset[t_k] + cols] in fp32,
    in a fixed order (GATHER rows per step), so a run's gradient is bitwise reproducible.
    scale_k = psw (weighted) / bag length (MEAN)."""
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    g = tl.arange(0, GATHER)
    for k in range(k_begin, k_end, GATHER):
        kmask = (k + g) < k_end
        pos = tl.load(perm_ptr + k + g, mask=kmask, other=0)
        bag = tl.load(bags_ptr + pos, mask=kmask, other=0)
        t = bag // B
        b = bag - t * B
        o_col = tl.load(feature_out_offset_ptr + t, mask=kmask, other=0)
        row = b.to(tl.int64) * total_D + o_col
        go = tl.load(
            grad_out_ptr + row[:, None] + cols[None, :], mask=kmask[:, None] & cmask[None, :], other=0.0
        ).to(tl.float32)
        if WEIGHTED or POOLING_MEAN:
            scale = tl.full([GATHER], 1.0, tl.float32)
            if WEIGHTED:
                scale = tl.load(psw_ptr + pos, mask=kmask, other=0.0).to(tl.float32)
            if POOLING_MEAN:
                bag64 = bag.to(tl.int64)
                n = tl.load(offsets_ptr + bag64 + 1, mask=kmask, other=1) - tl.load(
                    offsets_ptr + bag64, mask=kmask, other=0
                )
                scale = scale / tl.maximum(n, 1).to(tl.float32)
            go = go * scale[:, None]
        acc += tl.sum(go, axis=0)
    return acc


@triton.jit
def run_row(
    sorted_keys_ptr,
    perm_ptr,
    bags_ptr,
    feature_key_offset_ptr,
    feature_weight_offset_ptr,
    feature_row_offset_ptr,
    feature_dim_ptr,
    first_sorted,
    B,
):
    """Where the run whose first sorted lookup is ``first_sorted`` lives: (row start in the flat
    weights, index of its per-row optimizer state, D). Any lookup of the run names its table; the
    first one is used."""
    key = tl.load(sorted_keys_ptr + first_sorted).to(tl.int64)
    pos = tl.load(perm_ptr + first_sorted)
    t = tl.load(bags_ptr + pos) // B
    row = key - tl.load(feature_key_offset_ptr + t)
    D = tl.load(feature_dim_ptr + t)
    w_row = tl.load(feature_weight_offset_ptr + t) + row * D
    state_row = tl.load(feature_row_offset_ptr + t) + row
    return w_row, state_row, D
