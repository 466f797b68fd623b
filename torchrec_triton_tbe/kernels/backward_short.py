"""Backward, short runs: every run shorter than the threshold is owned by the one program whose tile
holds its first slot; that program reduces it in registers and applies the optimizer with plain
stores: no atomics, no workspace.

A program takes TILE consecutive sorted slots: one coalesced load of their bag ids, TILE independent
gradient-row gathers, then a segmented sum along the tile (deterministic: a fixed scan order) gives
each run's gradient at its last slot. The one run that crosses the tile's end is finished by the same
program from the following slots (fewer than the threshold). Slots of runs that started in an earlier
tile, or of long runs, are masked out and cost no memory traffic.

Byte accounting per run of length L: L gradient rows + L * 12 B of slot metadata + one row read and
written + row-wise state 8 B. Persistent grid: NPROG programs stride over the bucket's tiles, whose
bounds they read from device memory (no host sync, no data-dependent grid).
"""

import triton
import triton.language as tl

from torchrec_triton_tbe.kernels.grad_gather import gather_rows, locate_rows, segmented_add
from torchrec_triton_tbe.kernels.optim import apply_rows_update


@triton.jit
def _backward_short_kernel(
    weights_ptr,
    momentum_ptr,
    lr_ptr,
    seed_ptr,
    grad_out_ptr,
    sorted_keys_ptr,
    sorted_bags_ptr,
    sorted_psw_ptr,
    offsets_ptr,
    run_count_ptr,
    run_start_ptr,
    bucket_slot_bounds_ptr,
    feature_out_offset_ptr,
    feature_key_offset_ptr,
    feature_weight_offset_ptr,
    feature_row_offset_ptr,
    feature_dim_ptr,
    bucket,
    B,
    total_D,
    threshold,
    eps,
    NPROG,
    OPTIM: tl.constexpr,
    SR_DROP_BITS: tl.constexpr,
    POOLING_MEAN: tl.constexpr,
    WEIGHTED: tl.constexpr,
    EVEN_D: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE: tl.constexpr,
):
    """
    weights_ptr: flat weights (fp32/fp16/bf16), updated in place. momentum_ptr: [total_rows] fp32.
    lr_ptr: fp32[1] learning rate (device-resident so CUDA graphs see scheduler updates).
    seed_ptr: int64[1] optimizer step, seeds stochastic rounding.
    grad_out_ptr: [B, total_D] output gradient.
    sorted_keys_ptr / sorted_bags_ptr / sorted_psw_ptr: [N] per sorted slot: row key, bag id t*B+b,
        per-sample weight (fp32, read only if WEIGHTED).
    run_count_ptr: [N] inclusive count of run starts (slot k is in run run_count[k] - 1).
    run_start_ptr: [N + 1] first slot of each run. bucket_slot_bounds_ptr: [K + 1] slots of bucket k.
    threshold: runs at least this long belong to the long path and are skipped here.
    """
    pid = tl.program_id(0)
    lr = tl.load(lr_ptr)
    seed = tl.load(seed_ptr)
    cols = tl.arange(0, BLOCK_D)
    lanes = tl.arange(0, TILE)
    lo = tl.load(bucket_slot_bounds_ptr + bucket).to(tl.int64)
    hi = tl.load(bucket_slot_bounds_ptr + bucket + 1).to(tl.int64)
    for k0 in range(lo + pid * TILE, hi, NPROG * TILE):
        k = k0 + lanes
        valid = k < hi
        r = tl.load(run_count_ptr + k, mask=valid, other=1) - 1
        rs = tl.load(run_start_ptr + r, mask=valid, other=0).to(tl.int64)
        re = tl.load(run_start_ptr + r + 1, mask=valid, other=0).to(tl.int64)
        owned = valid & (re - rs < threshold) & (rs >= k0)
        g, t, cmask = gather_rows(
            grad_out_ptr, sorted_bags_ptr, sorted_psw_ptr, offsets_ptr, feature_out_offset_ptr, feature_dim_ptr,
            k, owned, B, total_D, cols, POOLING_MEAN, WEIGHTED, EVEN_D, ALIGN, BLOCK_D,
        )
        tile_end = k0 + TILE
        ends = owned & ((k == re - 1) | (k == tile_end - 1))
        # Weight rows of the runs this tile finishes: issued before the reduction so they overlap it.
        w_row, state_row, D = locate_rows(
            sorted_keys_ptr, feature_key_offset_ptr, feature_weight_offset_ptr, feature_row_offset_ptr,
            feature_dim_ptr, k, t, ends, ALIGN,
        )
        umask = ends[:, None] & cmask
        w_ptrs = weights_ptr + w_row[:, None] + cols[None, :]
        w = tl.load(w_ptrs, mask=umask, other=0.0).to(tl.float32)
        heads = tl.broadcast_to((k == rs).to(tl.float32)[:, None], (TILE, BLOCK_D))
        sums, seg_heads = tl.associative_scan((g, heads), 0, segmented_add)
        # The run crossing the tile end (if this tile owns it) continues for fewer than `threshold` slots.
        crossing = ends & (re > tile_end)
        rest_end = tl.max(tl.where(crossing, re, tile_end), axis=0)
        rest = tl.zeros([BLOCK_D], dtype=tl.float32)
        for j0 in range(tile_end, rest_end, TILE):
            kk = j0 + lanes
            gg, t_rest, m_rest = gather_rows(
                grad_out_ptr, sorted_bags_ptr, sorted_psw_ptr, offsets_ptr, feature_out_offset_ptr, feature_dim_ptr,
                kk, kk < rest_end, B, total_D, cols, POOLING_MEAN, WEIGHTED, EVEN_D, ALIGN, BLOCK_D,
            )
            rest += tl.sum(gg, axis=0)
        sums = tl.where(crossing[:, None], sums + rest[None, :], sums)
        apply_rows_update(
            w_ptrs, w, momentum_ptr + state_row, sums, umask, ends, D, lr, eps, seed,
            (state_row[:, None] * BLOCK_D + cols[None, :]).to(tl.int32), OPTIM, SR_DROP_BITS,
        )
