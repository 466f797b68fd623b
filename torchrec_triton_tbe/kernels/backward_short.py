"""Backward, short runs: each run (one unique row) is owned by one program, which reduces the run's
gradient in registers and applies the optimizer with plain stores: no atomics, no workspace.

A program takes RUNS consecutive runs at a time as one [RUNS, BLOCK_D] tile, so RUNS independent
gathers are in flight (a run is 1-3 lookups on typical data: one run per program would leave the
memory system idle waiting on dependent loads). Byte accounting per run of length L: L gathered
gradient rows (grad_gather.py) + one row read and written + row-wise state 8 B. Persistent grid:
NPROG programs stride over the bucket's run blocks, whose bounds they read from device memory (no
host sync, no data-dependent grid).
"""

import triton
import triton.language as tl

from torchrec_triton_tbe.kernels.grad_gather import gather_segments, locate_rows
from torchrec_triton_tbe.kernels.optim import apply_rows_update


@triton.jit
def _backward_short_kernel(
    weights_ptr,
    momentum_ptr,
    lr_ptr,
    seed_ptr,
    grad_out_ptr,
    sorted_keys_ptr,
    perm_ptr,
    bags_ptr,
    offsets_ptr,
    psw_ptr,
    run_start_ptr,
    bucket_run_bounds_ptr,
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
    OPTIM: tl.constexpr,
    SR_DROP_BITS: tl.constexpr,
    POOLING_MEAN: tl.constexpr,
    WEIGHTED: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    RUNS: tl.constexpr,
    NPROG: tl.constexpr,
):
    """
    weights_ptr: flat weights (fp32/fp16/bf16), updated in place. momentum_ptr: [total_rows] fp32.
    lr_ptr: fp32[1] learning rate (device-resident so CUDA graphs see scheduler updates).
    seed_ptr: int64[1] optimizer step, seeds stochastic rounding.
    grad_out_ptr: [B, total_D] output gradient. sorted_keys_ptr / perm_ptr: the sorted keys and,
    per sorted slot, the lookup's original position. bags_ptr: [N] int32 t*B+b per position.
    run_start_ptr: [N + 1] first sorted slot of each run (run r is [run_start[r], run_start[r+1])).
    bucket_run_bounds_ptr: [K + 1] runs of bucket k are [bounds[k], bounds[k+1]).
    threshold: runs at least this long belong to the long path and are skipped here.
    """
    pid = tl.program_id(0)
    lr = tl.load(lr_ptr)
    seed = tl.load(seed_ptr)
    cols = tl.arange(0, BLOCK_D)
    lanes = tl.arange(0, RUNS)
    r_begin = tl.load(bucket_run_bounds_ptr + bucket).to(tl.int64)
    r_end = tl.load(bucket_run_bounds_ptr + bucket + 1).to(tl.int64)
    for r0 in range(r_begin + pid * RUNS, r_end, NPROG * RUNS):
        r = r0 + lanes
        s = tl.load(run_start_ptr + r, mask=r < r_end, other=0).to(tl.int64)
        e = tl.load(run_start_ptr + r + 1, mask=r < r_end, other=0).to(tl.int64)
        mine = (r < r_end) & (e - s < threshold)
        n = tl.where(mine, e - s, 0)
        w_row, state_row, D = locate_rows(
            sorted_keys_ptr,
            perm_ptr,
            bags_ptr,
            feature_key_offset_ptr,
            feature_weight_offset_ptr,
            feature_row_offset_ptr,
            feature_dim_ptr,
            s,
            mine,
            B,
        )
        if EVEN_D:
            cmask = mine[:, None] & (cols[None, :] < BLOCK_D)
        else:
            cmask = mine[:, None] & (cols[None, :] < D[:, None])
        # Issue the weight-row loads before the gather so they overlap it.
        w_ptrs = weights_ptr + w_row[:, None] + cols[None, :]
        w = tl.load(w_ptrs, mask=cmask, other=0.0).to(tl.float32)
        grad = gather_segments(
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
            POOLING_MEAN,
            WEIGHTED,
            RUNS,
            BLOCK_D,
        )
        apply_rows_update(
            w_ptrs,
            w,
            momentum_ptr + state_row,
            grad,
            cmask,
            mine,
            D,
            lr,
            eps,
            seed,
            (state_row[:, None] * BLOCK_D + cols[None, :]).to(tl.int32),
            OPTIM,
            SR_DROP_BITS,
        )
