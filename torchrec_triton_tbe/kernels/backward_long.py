"""Backward, long runs: split-K. A run of L >= threshold lookups is cut into cdiv(L, CHUNK) chunks;
one program reduces one chunk (TILE slots per step, grad_gather.sum_rows) into its own row of a fp32 partials workspace
(plain store, no atomics); then an apply pass reduces each run's partials in chunk order and applies
the optimizer once. Deterministic: the reduction order depends only on the data, never on scheduling.

Two schedules of the same arithmetic (config `backward.long_path`): "split" (the partials kernel,
then the apply kernel, ordered by the stream) and "fused" (one launch; the last chunk of a run to
finish applies it, found with an acquire-release counter). Both reduce a run's partials in chunk
order, the same number per step (the apply tile, `backward.apply_tile`, which the fused kernel takes as
APPLY_TILE), so they give identical bits, provided the apply runs on the long path's warps (the default): the
final sum across a tile follows the compiled layout, and the fused kernel keeps the long path's warps where
the split apply takes `backward.apply_warps`. Which schedule is faster is measured per target (configs/).

Byte accounting: per lookup as grad_gather.py; per chunk 4 * BLOCK_D bytes written then read back;
per long run one row read + written and its optimizer state (kernels/optim.py).
"""

import triton
import triton.language as tl

from torchrec_triton_tbe.kernels.grad_gather import locate_rows, sum_rows
from torchrec_triton_tbe.kernels.optim import apply_rows_update


# NPROG not specialized: see backward_short.py (the learned persistent grid would be a new specialization).
@triton.jit(do_not_specialize=["NPROG"])
def _backward_long_partials_kernel(
    partials_ptr,
    grad_out_ptr,
    sorted_bags_ptr,
    sorted_psw_ptr,
    offsets_ptr,
    run_start_ptr,
    chunk_run_ptr,
    run_chunk_begin_ptr,
    bucket_chunk_bounds_ptr,
    feature_out_offset_ptr,
    feature_dim_ptr,
    bucket,
    B,
    bag_shift,
    total_D,
    chunk,
    partial_stride,
    NPROG,
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
    partials_ptr: [max_chunks, partial_stride] fp32 workspace; chunk c writes row c.
    chunk_run_ptr: [max_chunks] run of each chunk. run_chunk_begin_ptr: [N + 1] first chunk of each
    run (exclusive prefix sum of chunks per run; short runs have none).
    bucket_chunk_bounds_ptr: [K + 1] chunks of bucket k are [bounds[k], bounds[k+1]).
    """
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    lanes = tl.arange(0, TILE)
    # 64-bit counters: chunk * partial_stride may pass 2^31.
    c_begin = tl.load(bucket_chunk_bounds_ptr + bucket).to(tl.int64)
    c_end = tl.load(bucket_chunk_bounds_ptr + bucket + 1).to(tl.int64)
    for c in range(c_begin + pid, c_end, NPROG):
        r, first_chunk, run_s, s, e = _chunk_slots(c, chunk_run_ptr, run_chunk_begin_ptr, run_start_ptr, chunk)
        partial = sum_rows(
            grad_out_ptr, sorted_bags_ptr, sorted_psw_ptr, offsets_ptr, feature_out_offset_ptr, feature_dim_ptr,
            s, e, B, bag_shift, total_D, cols, lanes, POOLING_MEAN, WEIGHTED, EVEN_D, ALIGN, BLOCK_D, OUT_MAP,
            OUT_ALIGN,
        )
        # Columns past D are zeros (masked loads); the apply pass never reads them.
        tl.store(partials_ptr + c * partial_stride + cols, partial)


@triton.jit(do_not_specialize=["NPROG"])
def _backward_long_apply_kernel(
    weights_ptr,
    m1_ptr,
    m2_ptr,
    m3_ptr,
    lr_ptr,
    hyper_ptr,
    step_ptr,
    partials_ptr,
    sorted_keys_ptr,
    sorted_bags_ptr,
    run_start_ptr,
    chunk_run_ptr,
    run_chunk_begin_ptr,
    bucket_chunk_bounds_ptr,
    feature_key_offset_ptr,
    feature_weight_offset_ptr,
    feature_row_offset_ptr,
    feature_dim_ptr,
    bucket,
    B,
    bag_shift,
    partial_stride,
    NPROG,
    OPTIM: tl.constexpr,
    WD_MODE: tl.constexpr,
    MAX_NORM: tl.constexpr,
    ROW_BIAS: tl.constexpr,
    SR_DROP_BITS: tl.constexpr,
    EVEN_D: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE: tl.constexpr,
    SCAN: tl.constexpr,
):
    """The program that meets a run's first chunk sums all of that run's partials in chunk order (TILE
    per step) and applies the optimizer; programs meeting other chunks move on. Runs only after the
    partials kernel has finished (stream order), so every partial has landed.

    SCAN > 1: a program looks at SCAN consecutive chunks at once, their runs and those runs' first chunks in
    two vector loads, where one chunk at a time (SCAN == 1, the loop of every release before it) takes two
    dependent scalar round trips per chunk (a hot row's thousands of chunks hold one first chunk; on 42 M
    Zipf lookups this pass scans ~300 k chunks, estimated). The runs of a block are applied by its one program, one
    after another, where the one-chunk loop spreads them over programs."""
    pid = tl.program_id(0)
    lr = tl.load(lr_ptr)
    step = tl.load(step_ptr)
    cols = tl.arange(0, BLOCK_D)
    c_begin = tl.load(bucket_chunk_bounds_ptr + bucket).to(tl.int64)
    c_end = tl.load(bucket_chunk_bounds_ptr + bucket + 1).to(tl.int64)
    if SCAN == 1:
        for c in range(c_begin + pid, c_end, NPROG):
            r = tl.load(chunk_run_ptr + c)
            first_chunk = tl.load(run_chunk_begin_ptr + r).to(tl.int64)
            if c == first_chunk:
                _apply_run(
                    weights_ptr, m1_ptr, m2_ptr, m3_ptr, partials_ptr, sorted_keys_ptr, sorted_bags_ptr,
                    feature_key_offset_ptr, feature_weight_offset_ptr, feature_row_offset_ptr, feature_dim_ptr,
                    tl.load(run_start_ptr + r).to(tl.int64), first_chunk,
                    tl.load(run_chunk_begin_ptr + r + 1).to(tl.int64), B, bag_shift, partial_stride, lr, hyper_ptr,
                    step, cols, OPTIM, WD_MODE, MAX_NORM, ROW_BIAS, SR_DROP_BITS, EVEN_D, ALIGN, BLOCK_D, TILE,
                )
    else:
        lanes = tl.arange(0, SCAN)
        for c0 in range(c_begin + pid * SCAN, c_end, NPROG * SCAN):
            c = c0 + lanes
            m = c < c_end
            r = tl.load(chunk_run_ptr + c, mask=m, other=0)
            first = m & (tl.load(run_chunk_begin_ptr + r, mask=m, other=-1).to(tl.int64) == c)
            # The block's first chunks, lowest first: each found with a vector min, no memory access.
            pos = tl.where(first, lanes, SCAN)
            for _ in range(tl.sum(first.to(tl.int32), axis=0)):
                i = tl.min(pos, axis=0)
                pos = tl.where(pos == i, SCAN, pos)
                run = tl.sum(tl.where(lanes == i, r, 0), axis=0)
                _apply_run(
                    weights_ptr, m1_ptr, m2_ptr, m3_ptr, partials_ptr, sorted_keys_ptr, sorted_bags_ptr,
                    feature_key_offset_ptr, feature_weight_offset_ptr, feature_row_offset_ptr, feature_dim_ptr,
                    tl.load(run_start_ptr + run).to(tl.int64), c0 + i,
                    tl.load(run_chunk_begin_ptr + run + 1).to(tl.int64), B, bag_shift, partial_stride, lr, hyper_ptr,
                    step, cols, OPTIM, WD_MODE, MAX_NORM, ROW_BIAS, SR_DROP_BITS, EVEN_D, ALIGN, BLOCK_D, TILE,
                )


@triton.jit(do_not_specialize=["NPROG"])
def _backward_long_fused_kernel(
    weights_ptr,
    m1_ptr,
    m2_ptr,
    m3_ptr,
    lr_ptr,
    hyper_ptr,
    step_ptr,
    partials_ptr,
    counters_ptr,
    grad_out_ptr,
    sorted_keys_ptr,
    sorted_bags_ptr,
    sorted_psw_ptr,
    offsets_ptr,
    run_start_ptr,
    chunk_run_ptr,
    run_chunk_begin_ptr,
    bucket_chunk_bounds_ptr,
    feature_out_offset_ptr,
    feature_key_offset_ptr,
    feature_weight_offset_ptr,
    feature_row_offset_ptr,
    feature_dim_ptr,
    bucket,
    B,
    bag_shift,
    total_D,
    chunk,
    partial_stride,
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
    APPLY_TILE: tl.constexpr,
):
    """The two passes above in one launch: each chunk stores its partial, then counts itself done on
    its run's counter (counters_ptr[first chunk of the run], zeroed by the host) with acquire-release
    semantics; the chunk that completes the count sees every other partial (their stores happen
    before their releases) and reduces them in chunk order, so the result is the same, bit for bit,
    as the two-pass path's whoever finishes last. The only atomics are the counters: values are never
    accumulated atomically.
    """
    pid = tl.program_id(0)
    lr = tl.load(lr_ptr)
    step = tl.load(step_ptr)
    cols = tl.arange(0, BLOCK_D)
    lanes = tl.arange(0, TILE)
    c_begin = tl.load(bucket_chunk_bounds_ptr + bucket).to(tl.int64)
    c_end = tl.load(bucket_chunk_bounds_ptr + bucket + 1).to(tl.int64)
    for c in range(c_begin + pid, c_end, NPROG):
        r, first_chunk, run_s, s, e = _chunk_slots(c, chunk_run_ptr, run_chunk_begin_ptr, run_start_ptr, chunk)
        last_chunk = tl.load(run_chunk_begin_ptr + r + 1).to(tl.int64)
        partial = sum_rows(
            grad_out_ptr, sorted_bags_ptr, sorted_psw_ptr, offsets_ptr, feature_out_offset_ptr, feature_dim_ptr,
            s, e, B, bag_shift, total_D, cols, lanes, POOLING_MEAN, WEIGHTED, EVEN_D, ALIGN, BLOCK_D, OUT_MAP,
            OUT_ALIGN,
        )
        tl.store(partials_ptr + c * partial_stride + cols, partial)
        # Every thread's part of the partial is stored before the one thread holding the counter
        # releases it (the barrier orders them; the release is cumulative over what it has seen).
        tl.debug_barrier()
        done = tl.atomic_add(counters_ptr + first_chunk, 1, sem="acq_rel")
        if done == last_chunk - first_chunk - 1:
            _apply_run(
                weights_ptr, m1_ptr, m2_ptr, m3_ptr, partials_ptr, sorted_keys_ptr, sorted_bags_ptr,
                feature_key_offset_ptr, feature_weight_offset_ptr, feature_row_offset_ptr, feature_dim_ptr,
                run_s, first_chunk, last_chunk, B, bag_shift, partial_stride, lr, hyper_ptr, step, cols, OPTIM,
                WD_MODE, MAX_NORM, ROW_BIAS, SR_DROP_BITS, EVEN_D, ALIGN, BLOCK_D, APPLY_TILE,
            )


@triton.jit
def _chunk_slots(c, chunk_run_ptr, run_chunk_begin_ptr, run_start_ptr, chunk):
    """Chunk c of a long run: (its run r, the run's first chunk, the run's first slot, and the chunk's
    sorted slots [s, e))."""
    r = tl.load(chunk_run_ptr + c)
    first_chunk = tl.load(run_chunk_begin_ptr + r).to(tl.int64)
    run_s = tl.load(run_start_ptr + r).to(tl.int64)
    s = run_s + (c - first_chunk) * chunk
    e = tl.minimum(s + chunk, tl.load(run_start_ptr + r + 1).to(tl.int64))
    return r, first_chunk, run_s, s, e


@triton.jit
def _apply_run(
    weights_ptr,
    m1_ptr,
    m2_ptr,
    m3_ptr,
    partials_ptr,
    sorted_keys_ptr,
    sorted_bags_ptr,
    feature_key_offset_ptr,
    feature_weight_offset_ptr,
    feature_row_offset_ptr,
    feature_dim_ptr,
    run_s,
    first_chunk,
    last_chunk,
    B,
    bag_shift,
    partial_stride,
    lr,
    hyper_ptr,
    step,
    cols,
    OPTIM: tl.constexpr,
    WD_MODE: tl.constexpr,
    MAX_NORM: tl.constexpr,
    ROW_BIAS: tl.constexpr,
    SR_DROP_BITS: tl.constexpr,
    EVEN_D: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE: tl.constexpr,
):
    """One optimizer step for the long run starting at sorted slot run_s: the sum of its partials
    [first_chunk, last_chunk) in chunk order (the same order on both schedules, hence the same bits)."""
    one = tl.arange(0, 1)
    s = run_s + one  # [1]: a one-row tile
    rmask = one == 0
    t = tl.load(sorted_bags_ptr + s) >> bag_shift
    w_row, state_row, D = locate_rows(
        sorted_keys_ptr, feature_key_offset_ptr, feature_weight_offset_ptr, feature_row_offset_ptr,
        feature_dim_ptr, s, t, rmask, ALIGN,
    )
    if EVEN_D:
        cmask = rmask[:, None] & (cols[None, :] < BLOCK_D)
    else:
        cmask = rmask[:, None] & (cols[None, :] < D[:, None])
    # TILE partials per step, accumulated element-wise and reduced once: a hot row has hundreds of
    # chunks, and one partial per step would make its program a chain of that many L2 round trips.
    lanes = tl.arange(0, TILE)
    acc = tl.zeros([TILE, BLOCK_D], dtype=tl.float32)
    for kc in range(first_chunk, last_chunk, TILE):
        kk = kc + lanes
        # .cg: on the fused schedule other programs wrote these partials during this launch; read
        # them from L2, never from a stale L1 line.
        acc += tl.load(
            partials_ptr + kk[:, None] * partial_stride + cols[None, :],
            mask=(kk < last_chunk)[:, None] & cmask, other=0.0, cache_modifier=".cg",
        )
    grad = tl.sum(acc, axis=0)[None, :]
    w_off = w_row[:, None] + cols[None, :]
    w = tl.load(weights_ptr + w_off, mask=cmask, other=0.0).to(tl.float32)
    apply_rows_update(
        weights_ptr, w_off, w, grad, cmask, rmask, D, state_row, m1_ptr, m2_ptr, m3_ptr, lr, hyper_ptr, step,
        (state_row[:, None] * BLOCK_D + cols[None, :]).to(tl.int32), OPTIM, WD_MODE, MAX_NORM, ROW_BIAS,
        SR_DROP_BITS,
    )
