"""Gradient w.r.t. per-sample weights: d out[b, t] / d psw[p] = <W[idx[p]], grad_out[b, t]> (/ L for
MEAN). Runs before the fused optimizer touches the weights, so it sees the rows the forward pooled.

Byte accounting per lookup: id (4/8 B) + one weight row (D * E B) + 4 B out; per bag one gradient row.
"""

import triton
import triton.language as tl

from torchrec_triton_tbe.kernels.common import bag_bounds, column_mask, out_row_start


@triton.jit
def _psw_grad_kernel(
    weights_ptr,
    indices_ptr,
    offsets_ptr,
    grad_out_ptr,
    grad_psw_ptr,
    bucket_features_ptr,
    feature_dim_ptr,
    feature_weight_offset_ptr,
    feature_out_offset_ptr,
    feature_requires_grad_ptr,
    B,
    total_D,
    POOLING_MEAN: tl.constexpr,
    HAS_FEATURE_MASK: tl.constexpr,
    EVEN_D: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GATHER: tl.constexpr,
    BAGS: tl.constexpr,
    OUT_MAP: tl.constexpr,
):
    """Grid: [cdiv(B, BAGS), T_k]. grad_psw_ptr: [N] fp32 out. feature_requires_grad_ptr: [T] ints;
    features with 0 get a zero gradient (FBGEMM's feature_requires_grad). The bag's gradient row:
    common.out_row_start (OUT_MAP: VBE's per-bag table, whose padding bags have no lookups)."""
    pid_b = tl.program_id(0)
    t = tl.load(bucket_features_ptr + tl.program_id(1))
    D = (tl.load(feature_dim_ptr + t) // ALIGN) * ALIGN  # ALIGN divides D: vector loads (forward.py)
    w_base = tl.load(feature_weight_offset_ptr + t)
    o_col = 0
    if not OUT_MAP:
        o_col = tl.load(feature_out_offset_ptr + t)
    enabled = 1
    if HAS_FEATURE_MASK:
        enabled = tl.load(feature_requires_grad_ptr + t)
    cols = tl.arange(0, BLOCK_D)
    cmask = column_mask(cols, D, EVEN_D, BLOCK_D)
    g = tl.arange(0, GATHER)
    for bb in tl.static_range(BAGS):
        b = pid_b * BAGS + bb
        if b < B:
            bag, start, end = bag_bounds(offsets_ptr, t, b, B)
            row = out_row_start(feature_out_offset_ptr, o_col, t, b, B, total_D, True, OUT_MAP)
            go = tl.load(grad_out_ptr + row + cols, mask=cmask & (row >= 0), other=0.0)
            go = go.to(tl.float32)
            if POOLING_MEAN:
                go = go / tl.maximum(end - start, 1).to(tl.float32)
            for j in range(start, end, GATHER):
                lmask = (j + g) < end
                idx = tl.load(indices_ptr + j + g, mask=lmask, other=0).to(tl.int64)
                tile = tl.load(
                    weights_ptr + w_base + idx[:, None] * D + cols[None, :],
                    mask=lmask[:, None] & cmask[None, :],
                    other=0.0,
                ).to(tl.float32)
                dot = tl.sum(tile * go[None, :], axis=1)
                if HAS_FEATURE_MASK:
                    dot = tl.where(enabled != 0, dot, 0.0)
                tl.store(grad_psw_ptr + j + g, dot, mask=lmask)
