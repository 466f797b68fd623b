"""Backward, short runs: a program takes TILE consecutive runs at a time, one run per tile row, and
walks them side by side: step j gathers the j-th gradient row of every run still that long into its
row's fp32 accumulator. A run is reduced in registers by the one program that owns it and updated
with plain stores: no atomics, no workspace, no scan, no run crossing a program boundary.

Why runs as rows and not sorted slots as rows: with slots as rows, every row needs its run's head,
end and owner, a segmented scan joins the slots of a run, and a run crossing the tile's end needs a
tail loop; on the H200 that kernel was instruction-bound (Nsight Compute, 2026-11-30, on two variants
of it: 166-224 registers per thread, 12-17 % occupancy, DRAM 24-35 % busy, ~178 warp instructions per
lookup). This kernel executes half as many on the same batch (89 per lookup, 3.63 -> 2.26 ms; the
numbers are in docs/results/tuning-2026-11-30c.json). Here a lookup costs its bag id, its gradient row
and one add per element; the price is masked steps in tiles whose runs differ in
length (a tile runs as many steps as its longest short run), which the short/long threshold bounds.

Latency: the bag ids of the next step are loaded one step ahead, so a step waits on one memory round
trip (its gradient rows), and the weight rows of the tile's runs are loaded with its first step's
rows. Each tile loads its own run bounds and first bag ids: carrying them over from the previous
iteration (a prefetch) bought nothing measurable on the H200 and, compiled by Triton 3.6, updated ~3 %
of the rows with wrong sums under EXACT_SGD (tests/gpu: test_many_tiles_per_program_match_fbgemm_cuda).
Rows are summed in slot order (batch order within a run: the sort is stable), so the result is
deterministic.

Byte accounting per short run of length L: L * (4-8 B bag id [+ 4 B psw] + one gradient row) + its
bounds and key (12-16 B) + one weight row read and written + the row's optimizer state read and
written (kernels/optim.py: 8 B for row-wise Adagrad). Persistent grid: NPROG programs stride over the bucket's runs, whose range they read from device memory.
"""

import triton
import triton.language as tl

from torchrec_triton_tbe.kernels.grad_gather import gather_bag_rows, locate_key_rows
from torchrec_triton_tbe.kernels.optim import apply_rows_update


# NPROG, the persistent grid, is not specialized: the first launch uses the configured grid and later
# ones the grid learned from the compiled kernel's occupancy (ops/backward._launch_persistent), whose
# divisibility by 16 may differ: Triton would then compile the kernel again at the second step (inside
# its CUDA-graph capture, where the backward is captured), a specialization precompile never saw. The
# grid only strides the loop over runs or chunks.
@triton.jit(do_not_specialize=["NPROG"])
def _backward_short_kernel(
    weights_ptr,
    m1_ptr,
    m2_ptr,
    m3_ptr,
    lr_ptr,
    hyper_ptr,
    step_ptr,
    grad_out_ptr,
    sorted_keys_ptr,
    sorted_bags_ptr,
    sorted_psw_ptr,
    offsets_ptr,
    run_start_ptr,
    bucket_run_bounds_ptr,
    feature_out_offset_ptr,
    feature_key_offset_ptr,
    feature_weight_offset_ptr,
    feature_row_offset_ptr,
    feature_dim_ptr,
    bucket,
    B,
    bag_shift,
    total_D,
    threshold,
    NPROG,
    OPTIM: tl.constexpr,
    WD_MODE: tl.constexpr,
    MAX_NORM: tl.constexpr,
    ROW_BIAS: tl.constexpr,
    SR_DROP_BITS: tl.constexpr,
    POOLING_MEAN: tl.constexpr,
    WEIGHTED: tl.constexpr,
    EVEN_D: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE: tl.constexpr,
    OUT_MAP: tl.constexpr,
    OUT_ALIGN: tl.constexpr,
):
    """
    weights_ptr: flat weights (fp32/fp16/bf16), updated in place. m1/m2/m3_ptr: the optimizer's state
    (kernels/optim.py). lr_ptr: fp32[1] learning rate, hyper_ptr: fp32 other hyper-parameters (both
    device-resident so CUDA graphs see scheduler and hyper-parameter updates).
    step_ptr: int64[1] optimizer step (bias correction; seeds stochastic rounding).
    grad_out_ptr: [B, total_D] output gradient (the layouts of grad_gather.gather_bag_rows: OUT_MAP, VBE).
    sorted_keys_ptr / sorted_bags_ptr / sorted_psw_ptr: [N] per sorted slot: row key, bag id
        (t << bag_shift) | b, per-sample weight (fp32, read only if WEIGHTED).
    run_start_ptr: [N + 1] first slot of each run (N past the last run).
    bucket_run_bounds_ptr: [K + 1] runs of bucket k.
    threshold: runs at least this long belong to the long path and are skipped here.
    """
    STRIDE = NPROG * TILE
    pid = tl.program_id(0)
    lr = tl.load(lr_ptr)
    step = tl.load(step_ptr)
    cols = tl.arange(0, BLOCK_D)
    lanes = tl.arange(0, TILE)
    r_lo = tl.load(bucket_run_bounds_ptr + bucket).to(tl.int64)
    r_hi = tl.load(bucket_run_bounds_ptr + bucket + 1).to(tl.int64)
    for r0 in range(r_lo + pid * TILE, r_hi, STRIDE):
        s, L, act = _load_runs(run_start_ptr, r0, r_hi, lanes, threshold)
        bag, psw, key = _load_heads(sorted_keys_ptr, sorted_bags_ptr, sorted_psw_ptr, s, act, WEIGHTED)
        # Any slot's bag names a feature of the run's table, which is all locate_key_rows needs.
        w_row, state_row, D = locate_key_rows(
            key, feature_key_offset_ptr, feature_weight_offset_ptr, feature_row_offset_ptr, feature_dim_ptr,
            bag >> bag_shift, act, ALIGN,
        )
        if EVEN_D:
            umask = tl.broadcast_to(act[:, None], (TILE, BLOCK_D))
        else:
            umask = act[:, None] & (cols[None, :] < D[:, None])
        w_off = w_row[:, None] + cols[None, :]
        w = tl.load(weights_ptr + w_off, mask=umask, other=0.0).to(tl.float32)
        acc = tl.zeros([TILE, BLOCK_D], dtype=tl.float32)
        steps = tl.max(tl.where(act, L, 0), axis=0)
        for j in range(0, steps):
            nxt = act & (j + 1 < L)
            n_bag = tl.load(sorted_bags_ptr + s + j + 1, mask=nxt, other=0)
            n_psw = psw
            if WEIGHTED:
                n_psw = tl.load(sorted_psw_ptr + s + j + 1, mask=nxt, other=0.0).to(tl.float32)
            g, t, gmask = gather_bag_rows(
                grad_out_ptr, bag, psw, offsets_ptr, feature_out_offset_ptr, feature_dim_ptr, act & (j < L), B,
                bag_shift, total_D, cols, POOLING_MEAN, WEIGHTED, EVEN_D, ALIGN, BLOCK_D, OUT_MAP, OUT_ALIGN,
            )
            acc += g
            bag, psw = n_bag, n_psw
        apply_rows_update(
            weights_ptr, w_off, w, acc, umask, act, D, state_row, m1_ptr, m2_ptr, m3_ptr, lr, hyper_ptr, step,
            (state_row[:, None] * BLOCK_D + cols[None, :]).to(tl.int32), OPTIM, WD_MODE, MAX_NORM, ROW_BIAS,
            SR_DROP_BITS,
        )


@triton.jit
def _load_runs(run_start_ptr, r0, r_hi, lanes, threshold):
    """First slot, length and "short" flag of runs r0 + lanes (runs past r_hi are not short)."""
    r = r0 + lanes
    valid = r < r_hi
    s = tl.load(run_start_ptr + r, mask=valid, other=0).to(tl.int64)
    e = tl.load(run_start_ptr + r + 1, mask=valid, other=0).to(tl.int64)
    L = e - s
    return s, L, valid & (L < threshold)


@triton.jit
def _load_heads(sorted_keys_ptr, sorted_bags_ptr, sorted_psw_ptr, s, act, WEIGHTED: tl.constexpr):
    """Bag id, per-sample weight and key of each run's first slot."""
    bag = tl.load(sorted_bags_ptr + s, mask=act, other=0)
    psw = tl.zeros(s.shape, dtype=tl.float32)
    if WEIGHTED:
        psw = tl.load(sorted_psw_ptr + s, mask=act, other=0.0).to(tl.float32)
    key = tl.load(sorted_keys_ptr + s, mask=act, other=0)
    return bag, psw, key
