"""Gathering output-gradient rows of sorted lookup slots, and locating the weight rows they update.

After the sort, slot k holds one lookup: its row key, its bag (sorted_bags[k] = (t << bag_shift) | b)
and, when weighted, its per-sample weight. A program gathers a tile of S slots at once (S runs side by
side in the short kernel, S consecutive slots of one run in the long path), so S independent gradient
rows are in flight behind each dependent bag-id load.

Byte accounting per lookup: bag id 4 B (+ psw 4 B, + two offsets for MEAN, mostly cached) and one
D-wide gradient row (D * 4 B for fp32 gradients: the dominant term).
"""

import triton
import triton.language as tl

from torchrec_triton_tbe.kernels.common import out_row_start


@triton.jit
def sum_rows(
    grad_out_ptr,
    sorted_bags_ptr,
    sorted_psw_ptr,
    offsets_ptr,
    feature_out_offset_ptr,
    feature_dim_ptr,
    s,
    e,
    B,
    bag_shift,
    total_D,
    cols,
    lanes,
    POOLING_MEAN: tl.constexpr,
    WEIGHTED: tl.constexpr,
    EVEN_D: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_D: tl.constexpr,
    OUT_MAP: tl.constexpr,
    OUT_ALIGN: tl.constexpr,
):
    """fp32 sum of the gradient rows of sorted slots [s, e), len(lanes) rows per step.

    Latency, not bandwidth, bounds a loop over one run: each step's bag ids are loaded one step
    ahead, so a step waits on one memory round trip (the rows), not two (ids, then rows). Rows are
    accumulated element-wise and reduced across the tile once at the end: a fixed order, so the sum
    is deterministic and the same wherever it is called."""
    S: tl.constexpr = lanes.shape[0]
    acc = tl.zeros([S, BLOCK_D], dtype=tl.float32)
    k = s + lanes
    bag = tl.load(sorted_bags_ptr + k, mask=k < e, other=0)
    psw = bag  # unused unless WEIGHTED
    if WEIGHTED:
        psw = tl.load(sorted_psw_ptr + k, mask=k < e, other=0.0)
    for j0 in range(s, e, S):
        k = j0 + lanes
        m = k < e
        kn = k + S
        n_bag = tl.load(sorted_bags_ptr + kn, mask=kn < e, other=0)
        n_psw = n_bag
        if WEIGHTED:
            n_psw = tl.load(sorted_psw_ptr + kn, mask=kn < e, other=0.0)
        g, t, cmask = gather_bag_rows(
            grad_out_ptr, bag, psw, offsets_ptr, feature_out_offset_ptr, feature_dim_ptr, m, B, bag_shift, total_D,
            cols, POOLING_MEAN, WEIGHTED, EVEN_D, ALIGN, BLOCK_D, OUT_MAP, OUT_ALIGN,
        )
        acc += g
        bag, psw = n_bag, n_psw
    return tl.sum(acc, axis=0)


@triton.jit
def split_bag(bag, bag_shift):
    """(t, b) of bag ids (t << bag_shift) | b (ops/transpose.py bag_code): a shift and a mask, no integer
    division on the hot path. The mask is built in the ids' own type: int64 ids are used exactly when
    the shift may reach 32, where a 32-bit ``1 << bag_shift`` is undefined (its mask would keep t)."""
    return bag >> bag_shift, bag & ((tl.full([], 1, bag.dtype) << bag_shift) - 1)


@triton.jit
def gather_bag_rows(
    grad_out_ptr,
    bag,
    psw,
    offsets_ptr,
    feature_out_offset_ptr,
    feature_dim_ptr,
    m,
    B,
    bag_shift,
    total_D,
    cols,
    POOLING_MEAN: tl.constexpr,
    WEIGHTED: tl.constexpr,
    EVEN_D: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_D: tl.constexpr,
    OUT_MAP: tl.constexpr,
    OUT_ALIGN: tl.constexpr,
):
    """(rows, t, cmask): rows [S, BLOCK_D] fp32 = scale * grad_out[bag's output row + cols] for bag ids
    (t << bag_shift) | b with mask m, scale = psw (WEIGHTED) / bag length (MEAN); t [S] the feature of
    each row; cmask [S, BLOCK_D] the live elements. The bag's output row: common.out_row_start
    (OUT_MAP: a per-bag table, VBE); OUT_ALIGN divides every output row start."""
    t, b = split_bag(bag, bag_shift)
    if EVEN_D:
        # A row mask broadcast along the columns: no per-element compare.
        cmask = tl.broadcast_to(m[:, None], (m.shape[0], BLOCK_D))
    else:
        # ALIGN divides D: a mask constant over ALIGN-wide groups keeps the loads vectorised.
        D = (tl.load(feature_dim_ptr + t, mask=m, other=0) // ALIGN) * ALIGN
        cmask = m[:, None] & (cols[None, :] < D[:, None])
    # (x // OUT_ALIGN) * OUT_ALIGN == x here (OUT_ALIGN divides every row start), and tells the compiler
    # so: it can then emit vector loads. (tl.multiple_of on this vector trips a layout bug in Triton 3.6.)
    o_col = 0
    if not OUT_MAP:
        o_col = tl.load(feature_out_offset_ptr + t, mask=m, other=0)
    row = (out_row_start(feature_out_offset_ptr, o_col, t, b, B, total_D, m, OUT_MAP) // OUT_ALIGN) * OUT_ALIGN
    go = tl.load(grad_out_ptr + row[:, None] + cols[None, :], mask=cmask, other=0.0).to(tl.float32)
    if WEIGHTED or POOLING_MEAN:
        scale = tl.full(bag.shape, 1.0, tl.float32)
        if WEIGHTED:
            scale = tl.where(m, psw, 0.0)
        if POOLING_MEAN:
            bag64 = t.to(tl.int64) * B + b
            L = tl.load(offsets_ptr + bag64 + 1, mask=m, other=1) - tl.load(offsets_ptr + bag64, mask=m, other=0)
            scale = scale / tl.maximum(L, 1).to(tl.float32)
        go = go * scale[:, None]
    return go, t, cmask


@triton.jit
def locate_rows(
    sorted_keys_ptr,
    feature_key_offset_ptr,
    feature_weight_offset_ptr,
    feature_row_offset_ptr,
    feature_dim_ptr,
    k,
    t,
    m,
    ALIGN: tl.constexpr,
):
    """For slots k of features t: (row start in the flat weights, per-row optimizer state index, D)."""
    key = tl.load(sorted_keys_ptr + k, mask=m, other=0)
    return locate_key_rows(
        key, feature_key_offset_ptr, feature_weight_offset_ptr, feature_row_offset_ptr, feature_dim_ptr, t, m, ALIGN
    )


@triton.jit
def locate_key_rows(
    key,
    feature_key_offset_ptr,
    feature_weight_offset_ptr,
    feature_row_offset_ptr,
    feature_dim_ptr,
    t,
    m,
    ALIGN: tl.constexpr,
):
    """locate_rows for keys already loaded."""
    row = key.to(tl.int64) - tl.load(feature_key_offset_ptr + t, mask=m, other=0)
    D = (tl.load(feature_dim_ptr + t, mask=m, other=ALIGN) // ALIGN) * ALIGN
    w_row = ((tl.load(feature_weight_offset_ptr + t, mask=m, other=0) + row * D) // ALIGN) * ALIGN
    state_row = tl.load(feature_row_offset_ptr + t, mask=m, other=0) + row
    return w_row, state_row, D
