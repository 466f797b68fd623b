"""Backward, short runs: one program owns a whole run (one unique row), so it reduces the run's
gradient in registers and applies the optimizer with plain stores: no atomics, no workspace.

Byte accounting per run of length L: L gathered gradient rows (see grad_gather.py) + one row read and
written + row-wise state 8 B. Persistent grid: NPROG programs stride over the bucket's runs, whose
bounds they read from device memory (no host sync, no data-dependent grid).
"""

import triton
import triton.language as tl

from torchrec_triton_tbe.kernels.grad_gather import gather_grad_sum, run_row
from torchrec_triton_tbe.kernels.optim import apply_row_update


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
    GATHER: tl.constexpr,
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
    r_begin = tl.load(bucket_run_bounds_ptr + bucket)
    r_end = tl.load(bucket_run_bounds_ptr + bucket + 1)
    for r in range(r_begin + pid, r_end, NPROG):
        s = tl.load(run_start_ptr + r).to(tl.int64)
        e = tl.load(run_start_ptr + r + 1).to(tl.int64)
        if e - s < threshold:
            w_row, state_row, D = run_row(
                sorted_keys_ptr,
                perm_ptr,
                bags_ptr,
                feature_key_offset_ptr,
                feature_weight_offset_ptr,
                feature_row_offset_ptr,
                feature_dim_ptr,
                s,
                B,
            )
            if EVEN_D:
                cmask = cols < BLOCK_D
            else:
                cmask = cols < D
            grad = gather_grad_sum(
                grad_out_ptr,
                perm_ptr,
                bags_ptr,
                offsets_ptr,
                psw_ptr,
                feature_out_offset_ptr,
                s,
                e,
                B,
                total_D,
                cols,
                cmask,
                POOLING_MEAN,
                WEIGHTED,
                BLOCK_D,
                GATHER,
            )
            apply_row_update(
                weights_ptr + w_row,
                momentum_ptr + state_row,
                grad,
                cols,
                cmask,
                D,
                lr,
                eps,
                seed,
                (state_row * BLOCK_D).to(tl.int32),
                OPTIM,
                SR_DROP_BITS,
            )
