"""Launch the fused backward: per-sample-weight gradient, then per D bucket the short-run kernel and
the long-run split-K kernels (config ``backward.long_path``: the partials + apply pair, or the one
fused kernel). Every launch has a fixed (persistent) grid; run and chunk counts are read by the
kernels from device memory, so nothing here waits for the GPU.

Order matters and is enforced by stream order: the per-sample-weight gradient reads the weights the
forward pooled, so it runs before any update; on the split schedule a long run's apply reads
partials, so it runs after the partials kernel of its bucket (the fused schedule orders them inside
the kernel, with a counter per run).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from torchrec_triton_tbe.config import BackwardConfig, resident_programs, tile_warps
from torchrec_triton_tbe.kernels.backward_long import (
    _backward_long_apply_kernel,
    _backward_long_fused_kernel,
    _backward_long_partials_kernel,
)
from torchrec_triton_tbe.kernels.backward_short import _backward_short_kernel
from torchrec_triton_tbe.kernels.psw_grad import _psw_grad_kernel
from torchrec_triton_tbe.ops import small_table
from torchrec_triton_tbe.ops.launch import arg_key, bucket_streams, cdiv, grid_y_slices, joined, launch
from torchrec_triton_tbe.ops.spec import TBESpec
from torchrec_triton_tbe.ops.transpose import RunPlan, build_runs
from torchrec_triton_tbe.ops.vbe import VBELayout


@dataclasses.dataclass
class OptimizerTensors:
    """The mutable state a backward updates in place (owned by the module)."""

    weights: torch.Tensor  # flat
    # The optimizer's state (OptimizerSpec.states: momentum1, momentum2, row_counter), each [total_rows]
    # (row-wise) or laid out like the weights (element-wise); empty where the optimizer has none.
    momentum1: torch.Tensor
    momentum2: torch.Tensor
    row_counter: torch.Tensor
    learning_rate: torch.Tensor  # fp32 [1]
    hyper: torch.Tensor  # fp32 [len(HYPER_FIELDS)]
    step: torch.Tensor  # int64 [1]

    def kernel_args(self) -> tuple:
        """(weights, m1, m2, m3, lr, hyper, step) as the update kernels take them; an empty state
        tensor is passed as a stand-in the kernel never reads (its optimizer has no such state)."""
        m1, m2, m3 = (t if t.numel() else self.hyper for t in (self.momentum1, self.momentum2, self.row_counter))
        return (self.weights, m1, m2, m3, self.learning_rate, self.hyper, self.step)


# Persistent grid per compiled specialization, learned at its first launch (BackwardConfig.waves).
_WAVE_GRID: dict = {}


def _launch_persistent(
    kernel, bcfg: BackwardConfig, device: torch.device, args: tuple, constexprs: dict, num_warps: int,
    stream: Optional[torch.cuda.Stream] = None, maxnreg: Optional[int] = None,
) -> None:
    """Launch a persistent kernel whose last positional argument is its program count NPROG.

    A persistent grid larger than what the SMs hold at once runs in waves, and the last, partial wave
    leaves SMs idle while it drains (2.67 waves of 12 one-warp programs per SM on the H200's short-run
    kernel: a third of the last wave's slots empty). So once a specialization is compiled, its grid is
    `waves` full waves from its actual occupancy; the first launch uses the configured grid. Which
    program takes which tile or chunk never changes a result, only the speed."""
    key = arg_key(args)
    site = (id(kernel), device, bcfg.waves, num_warps, maxnreg, tuple(constexprs.items()), key)
    nprog = (_WAVE_GRID.get(site) if bcfg.waves > 0 else None) or bcfg.grid_programs(device)
    compiled = launch(kernel, (nprog,), (*args, nprog), constexprs, num_warps, key=key + arg_key((nprog,)),
                      stream=stream, maxnreg=maxnreg)
    if bcfg.waves > 0 and site not in _WAVE_GRID and device.type == "cuda" and getattr(compiled, "n_regs", 0):
        props = torch.cuda.get_device_properties(device)
        per_sm = resident_programs(compiled.n_regs, compiled.metadata.num_warps, compiled.metadata.shared, props)
        _WAVE_GRID[site] = bcfg.waves * props.multi_processor_count * per_sm


def psw_grad(
    spec: TBESpec,
    weights: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    grad_out: torch.Tensor,
    B: int,
    feature_requires_grad: Optional[torch.Tensor],
    vbe: Optional[VBELayout] = None,
) -> torch.Tensor:
    plan, tensors, cfg = spec.plan, spec.tensors, spec.config.forward
    grad = torch.zeros(indices.numel(), dtype=torch.float32, device=weights.device)
    if B == 0 or indices.numel() == 0:
        return grad
    for k, bucket in enumerate(plan.buckets):
        if not bucket.features:
            continue
        gather = cfg.gather.get(bucket.block_d)
        # The forward's per-width table was measured for the forward only (configs/sm90.yaml); this
        # kernel keeps the table's default at every width, as before the table.
        bags = cfg.bags_per_program.default
        # One launch per slice of the bucket's features that one grid's second dimension holds.
        for features in grid_y_slices(tensors.bucket_features[k]):
            launch(
                _psw_grad_kernel,
                (cdiv(B, bags), features.numel()),
                (
                    weights,
                    indices,
                    offsets,
                    grad_out,
                    grad,
                    features,
                    tensors.feature_dim,
                    tensors.feature_weight_offset,
                    tensors.feature_out_offset if vbe is None else vbe.out_map,
                    feature_requires_grad if feature_requires_grad is not None else tensors.feature_dim,
                    B,
                    plan.total_D,
                ),
                dict(
                    POOLING_MEAN=spec.pooling_mean,
                    HAS_FEATURE_MASK=feature_requires_grad is not None,
                    EVEN_D=spec.bucket_even_d[k],
                    ALIGN=spec.bucket_align[k],
                    BLOCK_D=bucket.block_d,
                    GATHER=gather,
                    BAGS=bags,
                    OUT_MAP=vbe is not None,
                ),
                tile_warps(cfg.num_warps.get(bucket.block_d), gather * bucket.block_d),
            )
    return grad


def grad_rows(spec: TBESpec, offsets: torch.Tensor, B: int, vbe: Optional[VBELayout]) -> tuple:
    """Where the gradient row of bag (t, b) starts in the output gradient (kernels/common.py
    out_row_start): (table, stride, OUT_MAP, out_align or None). Pooled: [B, total_D], row b * total_D +
    the feature's column offset. Sequence (nobag): [N, D], and a lookup's bag id holds its position
    within its feature (kernels/transpose.py), so the "column" is the feature's first position * D, read
    from the offsets on the device (no sync; inside a captured graph it reads the static offsets).
    Variable batch (VBE): the per-bag table of ops/vbe.py."""
    if vbe is not None:
        return vbe.out_map, spec.plan.total_D, True, vbe.out_align
    if not spec.nobag:
        return spec.tensors.feature_out_offset, spec.plan.total_D, False, None
    D = spec.plan.max_D
    return offsets[: spec.plan.num_features * B : B].to(torch.int64) * D, D, False, None


def update_lanes(bcfg: BackwardConfig, weights: Sequence[int], num_lookups: int, small: bool) -> tuple:
    """(lanes to ask of ops/launch.bucket_streams, per live bucket (the lane of its short kernel, the lane
    of its long path)); lane i runs on streams[i % len(streams)]. ``weights``: each live bucket's host-side
    size estimate (features x BLOCK_D: its gradient bytes if the features' bags were alike). One lane per
    bucket, or two with backward.split_paths: a bucket's short kernel and its long path update disjoint
    rows and the workspace is the long path's alone, so they may overlap where the buckets alone would
    leave streams idle (2 x buckets <= bucket_streams) and the backward's lookups are within the knob's
    window. Where the buckets fill the streams, backward.split_heaviest gives only the heaviest bucket two
    lanes, the first two (the update cannot end before its heaviest bucket, and round-robin puts another
    bucket beside it), from split_paths_min_lookups to split_heaviest_max_lookups lookups. ``small``: the
    small-table kernels go first on the caller's stream (lane 0), so the first bucket takes a side stream.
    From host ints only."""
    n = len(weights)
    split = int(bcfg.split_paths and num_lookups >= bcfg.split_paths_min_lookups
                and not 0 < bcfg.split_paths_max_lookups < num_lookups and 2 * n <= bcfg.bucket_streams)
    if (not split and bcfg.split_heaviest and n >= 2 and 2 * n > bcfg.bucket_streams >= 2
            and bcfg.split_paths_min_lookups <= num_lookups
            and not 0 < bcfg.split_heaviest_max_lookups < num_lookups):
        heavy = max(range(n), key=lambda j: weights[j])  # the first of equals: plan order
        lanes, nxt = [], small + 2
        for j in range(n):
            if j == heavy:
                lanes.append((small, small + 1))
            else:
                lanes.append((nxt, nxt))
                nxt += 1
        return n + 1, lanes
    per = 1 + split
    return n * per, [(j * per + small, j * per + small + split) for j in range(n)]


def fused_update(
    spec: TBESpec,
    state: OptimizerTensors,
    runs: RunPlan,
    grad_out: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    B: int,
    vbe: Optional[VBELayout] = None,
    indices: Optional[torch.Tensor] = None,
) -> None:
    """One optimizer step per unique row touched by the batch. ``indices``: the batch's ids, which the
    small-table path's kernels read (ops/small_table.py); needed when this backward takes that path."""
    if runs.num_lookups == 0 or B == 0:
        return
    small = small_table.backward_applies(spec, vbe, B, runs.num_lookups)
    if small and indices is None:
        raise ValueError("fused_update: this backward takes the small-table path, which reads the ids: pass indices")
    plan, tensors, bcfg = spec.plan, spec.tensors, spec.config.backward
    device = grad_out.device
    weighted = per_sample_weights is not None
    out_offset, grad_stride, out_map, out_align = grad_rows(spec, offsets, B, vbe)
    # Per-sample weights in sorted order (fp32), so the kernels read them coalesced.
    sorted_psw = per_sample_weights.float()[runs.perm] if weighted else grad_out
    partial_stride = max(b.block_d for b in plan.buckets)
    # Workspace rows are bounded by N / chunk + N / threshold + 1; allocated per batch (the caching
    # allocator makes this free in steady state) and never read past the live chunks.
    partials = torch.empty(runs.max_chunks * partial_stride, dtype=torch.float32, device=grad_out.device)
    fused_long = bcfg.long_path == "fused"
    # One countdown per long run (indexed by its first chunk, unique across buckets).
    counters = torch.zeros(runs.max_chunks, dtype=torch.int32, device=grad_out.device) if fused_long else None
    optim_state = state.kernel_args()
    live = [k for k, bucket in enumerate(plan.buckets) if bucket.features]
    # The buckets update disjoint rows and read their own chunks of the workspace, so they may run side
    # by side (backward.bucket_streams): a bucket's kernels stay on one stream, in order (its apply
    # reads its partials), and the join below orders everything after them.
    weights = [len(plan.buckets[k].features) * plan.buckets[k].block_d for k in live]
    num_lanes, lanes = update_lanes(bcfg, weights, runs.num_lookups, small)
    streams = bucket_streams(bcfg, num_lanes, runs.num_lookups, device)
    # Joined whatever happens (launch.joined), from the fork on: inside a CUDA-graph capture the forked
    # streams are branches of the capture, which must rejoin even when a launch raises.
    with joined(streams, device):
        if small:
            # The path takes the small tables' features with enough lookups this call, decided on the
            # device; the generic kernels below apply the others' runs (the taken ones have none). The
            # two touch disjoint rows, so their order does not matter.
            for g, group in enumerate(plan.small_groups):
                if group.features:
                    small_table.backward(spec, g, optim_state, grad_out, indices, offsets, per_sample_weights, B)
        for j, k in enumerate(live):
            bucket = plan.buckets[k]
            stream, long_stream = (streams[lane % len(streams)] for lane in lanes[j]) if streams else (None, None)
            bd = bucket.block_d
            row_bytes = state.weights.element_size() + spec.optimizer.elementwise_state_bytes
            tile = bcfg.tiles(bd, row_bytes)
            common = dict(
                EVEN_D=spec.bucket_even_d[k],
                ALIGN=spec.bucket_align[k],
                BLOCK_D=bd,
            )
            gathers = dict(
                OUT_MAP=out_map,
                OUT_ALIGN=spec.bucket_align[k] if out_align is None else min(out_align, spec.bucket_align[k]),
            )
            warps = tile_warps(bcfg.num_warps.get(bd), tile * bd)
            long_tile, long_warps = bcfg.long_knobs(bd, row_bytes)
            long_warps = tile_warps(long_warps, long_tile * bd)
            apply_tile, apply_warps = bcfg.apply_knobs(bd, row_bytes)
            apply_warps = tile_warps(apply_warps, apply_tile * bd)
            update = dict(**spec.optimizer.constexprs(), SR_DROP_BITS=spec.sr_drop_bits)
            layout = (
                out_offset,
                tensors.feature_key_offset,
                tensors.feature_weight_offset,
                tensors.feature_row_offset,
                tensors.feature_dim,
            )
            # Where each long run's chunks are: a chunk's run, each run's first chunk, each bucket's chunks.
            chunk_tables = (runs.run_start, runs.chunk_run, runs.run_chunk_begin, runs.bucket_chunk_bounds)
            modes = dict(POOLING_MEAN=spec.pooling_mean, WEIGHTED=weighted, TILE=tile)
            long_modes = dict(modes, TILE=long_tile)
            _launch_persistent(
                _backward_short_kernel,
                bcfg,
                device,
                (
                    *optim_state,
                    grad_out,
                    runs.sorted_keys,
                    runs.sorted_bags,
                    sorted_psw,
                    offsets,
                    runs.run_start,
                    runs.bucket_run_bounds,
                    *layout,
                    k,
                    B,
                    runs.bag_shift,
                    grad_stride,
                    runs.threshold,
                ),
                dict(**modes, **update, **common, **gathers),
                warps,
                stream,
                maxnreg=bcfg.short_maxnreg(bd),
            )
            if fused_long:
                _launch_persistent(
                    _backward_long_fused_kernel,
                    bcfg,
                    device,
                    (
                        *optim_state,
                        partials,
                        counters,
                        grad_out,
                        runs.sorted_keys,
                        runs.sorted_bags,
                        sorted_psw,
                        offsets,
                        *chunk_tables,
                        *layout,
                        k,
                        B,
                        runs.bag_shift,
                        grad_stride,
                        runs.chunk,
                        partial_stride,
                    ),
                    dict(**long_modes, **update, **common, **gathers, APPLY_TILE=apply_tile),
                    long_warps,
                    long_stream,
                )
                continue
            _launch_persistent(
                _backward_long_partials_kernel,
                bcfg,
                device,
                (
                    partials,
                    grad_out,
                    runs.sorted_bags,
                    sorted_psw,
                    offsets,
                    *chunk_tables,
                    out_offset,
                    tensors.feature_dim,
                    k,
                    B,
                    runs.bag_shift,
                    grad_stride,
                    runs.chunk,
                    partial_stride,
                ),
                dict(**long_modes, **common, **gathers),
                long_warps,
                long_stream,
            )
            _launch_persistent(
                _backward_long_apply_kernel,
                bcfg,
                device,
                (
                    *optim_state,
                    partials,
                    runs.sorted_keys,
                    runs.sorted_bags,
                    *chunk_tables,
                    tensors.feature_key_offset,
                    tensors.feature_weight_offset,
                    tensors.feature_row_offset,
                    tensors.feature_dim,
                    k,
                    B,
                    runs.bag_shift,
                    partial_stride,
                ),
                dict(TILE=apply_tile, SCAN=bcfg.apply_scan, **update, **common),
                apply_warps,
                long_stream,
            )


def backward_step(
    spec: TBESpec,
    state: OptimizerTensors,
    runs: Optional[RunPlan],
    indices: torch.Tensor,
    offsets: torch.Tensor,
    grad_out: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    B: int,
    vbe: Optional[VBELayout] = None,
) -> RunPlan:
    """Everything a backward does after the per-sample-weight gradient: the runs (unless the forward
    built them) and one optimizer step per touched row (``state.step``: the forward's count, which
    the forward advanced). Device work only (no host sync, no data-dependent host branch), so
    ops/graphs.py can capture it as it is."""
    if runs is None:
        runs = build_runs(spec, indices, offsets, B, vbe)
    fused_update(spec, state, runs, grad_out, offsets, per_sample_weights, B, vbe, indices)
    return runs
