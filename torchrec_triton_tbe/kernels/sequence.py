"""Sequence forward (PoolingMode.NONE): out[p] = the row lookup p names, for every lookup p.

No pooling, so no bag structure is needed on the hot path: each program takes BLOCK_P consecutive
lookups, finds each one's feature by a binary search over the features' first positions
(offsets[t*B], T+1 values read from cache), and copies its row. Lookups outside every bag (before
offsets[0] or from offsets[T*B] on, which FBGEMM allows) get zero rows.

Byte accounting per lookup: read the id (4 or 8 B) and the row (D*E), write the output row (D*O);
log2(T+1) cached offset reads for the search. A memory-bound gather: the floor is those bytes at copy
bandwidth.
"""

import triton
import triton.language as tl

from torchrec_triton_tbe.kernels.common import advance_step_count, column_mask


@triton.jit
def _sequence_forward_kernel(
    weights_ptr,
    indices_ptr,
    offsets_ptr,
    out_ptr,
    feature_weight_offset_ptr,
    N,
    B,
    T,
    D,
    count_ptr,
    count_saved_ptr,
    SEARCH_STEPS: tl.constexpr,
    EVEN_D: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    ADVANCE: tl.constexpr = False,
):
    """
    Grid: [cdiv(N, BLOCK_P)].
    weights_ptr: flat weights; feature t's table starts at feature_weight_offset[t], row stride D (every
        table of a sequence module has the same D, as in FBGEMM).
    indices_ptr: [N] ids; offsets_ptr: [T*B + 1], feature t owns lookups [offsets[t*B], offsets[(t+1)*B]).
    out_ptr: [N, D] output.
    SEARCH_STEPS: bit length of T + 1 (binary search steps over the T + 1 feature starts).
    count_ptr, count_saved_ptr, ADVANCE: the step count (forward.py's kernel).
    """
    if ADVANCE:
        advance_step_count(count_ptr, count_saved_ptr, tl.program_id(0) == 0)
    p = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    pmask = p < N
    # Largest t in [0, T] with offsets[t*B] <= p (lo), by bisection on [lo, hi).
    lo = tl.zeros([BLOCK_P], dtype=tl.int64)
    hi = tl.full([BLOCK_P], 0, tl.int64) + T + 1
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        go = (hi - lo > 1) & (tl.load(offsets_ptr + mid * B).to(tl.int64) <= p)
        lo = tl.where(go, mid, lo)
        hi = tl.where((hi - lo > 1) & ~go, mid, hi)
    first = tl.load(offsets_ptr).to(tl.int64)
    # live and t without the search's lo in an i1 or a select: Triton 3.6 (the GPU image's) mislays their
    # layout at SEARCH_STEPS 2 (one to three features) and fails to compile (TritonGPURemoveLayoutConversions).
    # lo < T is p < offsets[T*B]; a lane past the last bag has lo = T, and its loads are masked.
    end = tl.load(offsets_ptr + (tl.full([], 0, tl.int64) + T) * B).to(tl.int64)
    live = pmask & (p >= first) & (p < end)
    t = tl.minimum(lo, T - 1)
    idx = tl.load(indices_ptr + p, mask=live, other=0).to(tl.int64)
    D = (D // ALIGN) * ALIGN
    cols = tl.arange(0, BLOCK_D)
    cmask = column_mask(cols, D, EVEN_D, BLOCK_D)
    row = ((tl.load(feature_weight_offset_ptr + t, mask=live, other=0) + idx * D) // ALIGN) * ALIGN
    tile = tl.load(weights_ptr + row[:, None] + cols[None, :], mask=live[:, None] & cmask[None, :], other=0.0)
    out_row = ((p * D) // ALIGN) * ALIGN
    tl.store(out_ptr + out_row[:, None] + cols[None, :], tile.to(tl.float32).to(out_ptr.dtype.element_ty),
             mask=pmask[:, None] & cmask[None, :])
