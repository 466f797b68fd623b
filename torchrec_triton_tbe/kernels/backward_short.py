"""Backward, short runs: every run shorter than the threshold is owned by the one program whose tile
holds its first slot; that program reduces it in registers and applies the optimizer with plain
stores: no atomics, no workspace.

A program owns the runs that *start* in its TILE consecutive sorted slots [k0, k0 + TILE). Which
slots those are comes from the sorted keys themselves (a run starts where the key differs from its
left neighbour and ends where it differs from its right one), so the keys, bag ids and per-sample
weights of a tile are independent, coalesced loads, prefetched one tile ahead: the gradient-row
gathers wait on one memory round trip per iteration (bag -> row, with the feature tables in between
served from cache). Only the run holding the tile's last slot needs its end from the run table (one
scalar, prefetched too); if it is ours it is finished from the following slots (fewer than the
threshold) or, if it turns out long, left to the long path. A segmented sum along the tile (a fixed
scan order: deterministic) gives each run's gradient at its last slot, where the update is applied.
(A window of 2 * TILE slots, finishing most crossing runs without the tail loop, measured 1.6-2x
slower on the H200 (tools/sweep.py, 2026-11-30), presumably from twice the registers per owned slot.)

Byte accounting per run of length L: L gradient rows + L * (3 * key + 4 + [4 psw]) B of slot metadata
(the three overlapping key loads mostly hit in cache) + one row read and written +
row-wise state 8 B. Persistent grid: NPROG programs stride over the bucket's tiles, whose bounds they
read from device memory (no host sync, no data-dependent grid).
"""

import triton
import triton.language as tl

from torchrec_triton_tbe.kernels.grad_gather import gather_bag_rows, gather_rows, locate_key_rows, segmented_add
from torchrec_triton_tbe.kernels.optim import apply_rows_update


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


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
    run_start_ptr: [N + 1] first slot of each run (N past the last run).
    bucket_slot_bounds_ptr: [K + 1] slots of bucket k.
    threshold: runs at least this long belong to the long path and are skipped here.
    """
    STRIDE = NPROG * TILE
    pid = tl.program_id(0)
    lr = tl.load(lr_ptr)
    seed = tl.load(seed_ptr)
    cols = tl.arange(0, BLOCK_D)
    lanes = tl.arange(0, TILE)
    lo = tl.load(bucket_slot_bounds_ptr + bucket).to(tl.int64)
    hi = tl.load(bucket_slot_bounds_ptr + bucket + 1).to(tl.int64)
    # Software pipelining: the slot metadata of the next tile is loaded while this one is reduced, so
    # an iteration waits on one memory round trip (the gradient and weight rows), not three.
    key, prev, nxt, bag, psw, rc = _load_window(
        sorted_keys_ptr, sorted_bags_ptr, sorted_psw_ptr, run_count_ptr, lo + pid * TILE, lo, hi, lanes, WEIGHTED,
        TILE,
    )
    re_last = tl.load(run_start_ptr + rc, mask=lo + pid * TILE < hi, other=0).to(tl.int64)
    for k0 in range(lo + pid * TILE, hi, STRIDE):
        n_key, n_prev, n_nxt, n_bag, n_psw, n_rc = _load_window(
            sorted_keys_ptr, sorted_bags_ptr, sorted_psw_ptr, run_count_ptr, k0 + STRIDE, lo, hi, lanes, WEIGHTED,
            TILE,
        )
        k = k0 + lanes
        valid = k < hi
        tile_end = tl.minimum(k0 + TILE, hi)
        head = valid & ((k == lo) | (key != prev))
        last_of_run = valid & (((k + 1) >= hi) | (nxt != key))
        first = tl.min(tl.where(head, k, hi), axis=0)  # first run this program owns
        last_head = tl.max(tl.where(head, k, lo - 1), axis=0)
        # The run holding the tile's last slot (its end re_last is the one the tile cannot see) is
        # ours iff it starts here; it is long (left to the long path) if it reaches `threshold` slots.
        tail_ours = first < hi
        tail_long = tail_ours & (re_last - last_head >= threshold)
        owned = valid & (k >= first) & ~(tail_long & (k >= last_head))
        g, t, cmask = gather_bag_rows(
            grad_out_ptr, bag, psw, offsets_ptr, feature_out_offset_ptr, feature_dim_ptr, owned, B, total_D, cols,
            POOLING_MEAN, WEIGHTED, EVEN_D, ALIGN, BLOCK_D,
        )
        # Second stage of the next tile's prefetch, now that its run count has had time to arrive.
        n_re = tl.load(run_start_ptr + n_rc, mask=k0 + STRIDE < hi, other=0).to(tl.int64)
        # Each slot's run head (a running max of head positions) gives the length of every run the
        # tile finishes. With the usual knobs (TILE <= threshold) only the tail run can be long, but
        # any threshold stays exact.
        head_pos = tl.associative_scan(tl.where(head, k, lo - 1), 0, _max_combine)
        at_end = k == tile_end - 1
        run_len = tl.where(at_end, re_last, k + 1) - head_pos
        ends = owned & (last_of_run | at_end) & (run_len < threshold)
        # Weight rows of the runs this tile finishes: issued before the reduction so they overlap it.
        w_row, state_row, D = locate_key_rows(
            key, feature_key_offset_ptr, feature_weight_offset_ptr, feature_row_offset_ptr, feature_dim_ptr,
            t, ends, ALIGN,
        )
        umask = ends[:, None] & cmask
        w_ptrs = weights_ptr + w_row[:, None] + cols[None, :]
        w = tl.load(w_ptrs, mask=umask, other=0.0).to(tl.float32)
        heads = tl.broadcast_to(head.to(tl.float32)[:, None], (TILE, BLOCK_D))
        sums, seg_heads = tl.associative_scan((g, heads), 0, segmented_add)
        # The owned run crossing the tile's end continues for fewer than `threshold` slots.
        crossing = ends & ~last_of_run
        rest_end = tl.where(tail_ours & ~tail_long, tl.maximum(re_last, tile_end), tile_end)
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
        key, prev, nxt, bag, psw, re_last = n_key, n_prev, n_nxt, n_bag, n_psw, n_re


@triton.jit
def _load_window(
    sorted_keys_ptr, sorted_bags_ptr, sorted_psw_ptr, run_count_ptr, k0, lo, hi, lanes, WEIGHTED: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """Slot metadata of the WINDOW slots at k0 (masked off past hi): keys with both neighbours, bag
    ids, per-sample weights, and the run count of the last slot (its run's end is run_start[rc])."""
    k = k0 + lanes
    valid = k < hi
    key = tl.load(sorted_keys_ptr + k, mask=valid, other=0)
    prev = tl.load(sorted_keys_ptr + k - 1, mask=valid & (k > lo), other=0)
    nxt = tl.load(sorted_keys_ptr + k + 1, mask=(k + 1) < hi, other=0)
    bag = tl.load(sorted_bags_ptr + k, mask=valid, other=0)
    psw = tl.zeros([WINDOW], dtype=tl.float32)
    if WEIGHTED:
        psw = tl.load(sorted_psw_ptr + k, mask=valid, other=0.0).to(tl.float32)
    rc = tl.load(run_count_ptr + tl.minimum(k0 + WINDOW, hi) - 1, mask=k0 < hi, other=0)
    return key, prev, nxt, bag, psw, rc
