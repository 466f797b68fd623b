"""Gathering output-gradient rows for a tile of sorted lookup slots.

After the sort, slot k holds one lookup: its row key, its bag (sorted_bags[k] = t*B + b) and, when
weighted, its per-sample weight. A tile of TILE consecutive slots loads TILE bag ids with one
coalesced load and then TILE independent gradient rows, so every program keeps TILE row loads in
flight behind a single dependent step.

Byte accounting per lookup: bag id 4 B (+ psw 4 B, + two offsets for MEAN, mostly cached) and one
D-wide gradient row (D * 4 B for fp32 gradients: the dominant term).
"""

import triton
import triton.language as tl


@triton.jit
def gather_rows(
    grad_out_ptr,
    sorted_bags_ptr,
    sorted_psw_ptr,
    offsets_ptr,
    feature_out_offset_ptr,
    feature_dim_ptr,
    k,
    m,
    B,
    total_D,
    cols,
    POOLING_MEAN: tl.constexpr,
    WEIGHTED: tl.constexpr,
    EVEN_D: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """k, m: [S] sorted slots and their mask. Returns (rows, t, cmask): rows [S, BLOCK_D] fp32 =
    scale * grad_out[b, out_offset[t] + cols] with scale = psw (weighted) / bag length (MEAN); t [S]
    the feature of each slot; cmask [S, BLOCK_D] the live elements."""
    bag = tl.load(sorted_bags_ptr + k, mask=m, other=0)
    psw = bag  # unused unless WEIGHTED
    if WEIGHTED:
        psw = tl.load(sorted_psw_ptr + k, mask=m, other=0.0)
    return gather_bag_rows(
        grad_out_ptr, bag, psw, offsets_ptr, feature_out_offset_ptr, feature_dim_ptr, m, B, total_D, cols,
        POOLING_MEAN, WEIGHTED, EVEN_D, ALIGN, BLOCK_D,
    )


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
    total_D,
    cols,
    POOLING_MEAN: tl.constexpr,
    WEIGHTED: tl.constexpr,
    EVEN_D: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """gather_rows for bag ids (and per-sample weights) already loaded, e.g. prefetched."""
    t = bag // B
    b = bag - t * B
    o_col = tl.load(feature_out_offset_ptr + t, mask=m, other=0)
    if EVEN_D:
        cmask = m[:, None] & (cols[None, :] < BLOCK_D)
    else:
        # ALIGN divides D: a mask constant over ALIGN-wide groups keeps the loads vectorised.
        D = (tl.load(feature_dim_ptr + t, mask=m, other=0) // ALIGN) * ALIGN
        cmask = m[:, None] & (cols[None, :] < D[:, None])
    # (x // ALIGN) * ALIGN == x here (ALIGN divides every row start), and tells the compiler so: it can
    # then emit vector loads. (tl.multiple_of on this vector trips a layout bug in Triton 3.6.)
    row = ((b.to(tl.int64) * total_D + o_col) // ALIGN) * ALIGN
    go = tl.load(grad_out_ptr + row[:, None] + cols[None, :], mask=cmask, other=0.0).to(tl.float32)
    if WEIGHTED or POOLING_MEAN:
        scale = tl.full(bag.shape, 1.0, tl.float32)
        if WEIGHTED:
            scale = tl.where(m, psw, 0.0)
        if POOLING_MEAN:
            bag64 = bag.to(tl.int64)
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


@triton.jit
def segmented_add(a_val, a_head, b_val, b_head):
    """Combine of a segmented inclusive sum: a new segment (b_head) restarts the sum."""
    return tl.where(b_head != 0, b_val, a_val + b_val), tl.maximum(a_head, b_head)
