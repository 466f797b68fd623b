"""Launch the forward. Pooled: one launch per D bucket, grid [cdiv(B, bags_per_program * bag_lanes), T_k]
(features in slices of at most 65,535, CUDA's grid-y limit; spread over forward.bucket_streams streams when the
forward is large enough), or at batches of at most forward.grouped_max_batch one launch for every bucket,
grid [cdiv(B, ...), E] over the features' column slices; small-table buckets (ops/small_table.py) first,
on the caller's stream, where the call allows that path.
Sequence (PoolingMode.NONE): one launch over the lookups, grid [cdiv(N, sequence_block)]."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from torchrec_triton_tbe.config import tile_warps
from torchrec_triton_tbe.kernels.bounds import REPAIR_COUNT, REPAIR_OFF, REPAIR_SILENT
from torchrec_triton_tbe.kernels.forward import _pooled_forward_kernel
from torchrec_triton_tbe.kernels.sequence import _sequence_forward_kernel
from torchrec_triton_tbe.ops import small_table
from torchrec_triton_tbe.ops import launch as launch_ops
from torchrec_triton_tbe.ops.launch import arg_key, bucket_streams, cdiv, grid_y_slices, joined, launch, mean_bag_pow2
from torchrec_triton_tbe.ops.spec import Bounds, TBESpec
from torchrec_triton_tbe.ops.vbe import VBELayout


class StepAdvance(NamedTuple):
    """A forward's step count: ``count`` (the module's ``iter``) goes up by 1 and the new value is written
    to ``saved`` too (the copy its backward applies; ``count`` itself where no update reads one). The
    forward's first pooled / sequence launch does both (kernels/common.advance_step_count; a non-fused
    bounds check and the small-table forward launch before it) instead of two torch ops (``add_``,
    ``clone``) of their own: on launch-bound batches each launch the host issues counts, and on FBGEMM's
    default shape those were two of the training forward's three."""

    count: torch.Tensor
    saved: torch.Tensor


def advance_by_torch_ops(advance: Optional[StepAdvance]) -> None:
    """The same advance where the call launches no kernel of its own (an empty batch; every bag on the
    small-table path). Not in a recorded call (precompile's dry run, ops/launch.recording): its launches do
    not run, so a first launch's advance would not happen either, and the dry run writes no buffer."""
    if advance is not None and launch_ops.recording_into() is None:
        advance.count.add_(1)
        if advance.saved is not advance.count:
            advance.saved.copy_(advance.count)


def fused_repair_mode(spec: TBESpec) -> int:
    if not spec.fused_bounds_check:
        return REPAIR_OFF
    return {Bounds.WARNING: REPAIR_COUNT, Bounds.IGNORE: REPAIR_SILENT}.get(spec.bounds, REPAIR_OFF)


def lanes_gather(gather: int, num_lookups: int, num_bags: int) -> int:
    """GATHER for the bag-lanes path: the configured width, shrunk to the smallest power of two at least
    the mean bag length when bags are shorter. Every lane of a step occupies GATHER id slots whether its
    bag has ids there or not, so with L=1 bags and GATHER=8 seven eighths of each [LANES, GATHER, D]
    tile would be masked work and registers; the mean comes from host ints (len(indices), B*T), never
    from the offsets, so choosing it costs no device sync. Knob, not result: only the step grouping of
    the sums changes (fp rounding)."""
    return min(gather, mean_bag_pow2(num_lookups, num_bags))


def short_bag_lanes(lanes: int, gather: int, shrunk: int, max_lanes: int) -> int:
    """LANES of a lanes launch whose GATHER shrank from ``gather`` to ``shrunk`` (short bags): widened by
    that factor up to ``max_lanes`` (config forward.short_bag_max_lanes; 0: never), never below the
    table's ``lanes``. Each lane's rows depend on its own offsets -> id chain, so widening keeps the
    step's independent row loads at the tuned count. Knob, not result: which bags share a program."""
    return max(lanes, min(lanes * (gather // shrunk), max_lanes))


def pooled_forward(
    spec: TBESpec,
    weights: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    B: int,
    warning: torch.Tensor,
    vbe: Optional[VBELayout] = None,
    advance: Optional[StepAdvance] = None,
) -> torch.Tensor:
    """[B, total_D]; with ``vbe`` (variable batch, ops/vbe.py: ``offsets`` padded, B the padded batch) the
    1-D VBE output, or the caller's ``vbe.output`` written in place. ``advance``: the step count this
    forward advances (None: none)."""
    plan, tensors = spec.plan, spec.tensors
    if vbe is None:
        out = torch.empty(B, plan.total_D, dtype=spec.output_dtype, device=weights.device)
    else:
        out = vbe.output if vbe.output is not None else torch.empty(
            vbe.out_size, dtype=spec.output_dtype, device=weights.device)
    if B == 0:
        advance_by_torch_ops(advance)
        return out
    weighted = per_sample_weights is not None
    out_offset = tensors.feature_out_offset if vbe is None else vbe.out_map
    out_align = None if vbe is None else vbe.out_align
    small = small_table.applies(spec, vbe, "forward")
    launches = _launches(spec, B, indices.numel(), weighted, weights.element_size(), out_align, small)
    if not launches:
        advance_by_torch_ops(advance)
    if small:
        for g, group in enumerate(spec.plan.small_groups):
            if group.features:
                small_table.forward(spec, g, weights, indices, offsets, per_sample_weights, out, B)
    streams = bucket_streams(spec.config.forward, len(launches), indices.numel(), weights.device)
    psw = per_sample_weights if weighted else weights
    # launch()'s argument key, built from this call's part (the batch, the output) and each launch's
    # memoised part (the plan's tensors) instead of from all 14 arguments per launch: equal to
    # arg_key(args) element for element, which is what precompile's entries are stored under.
    head = arg_key((weights, indices, offsets, psw, out))
    mid = arg_key((out_offset,))
    # Without an advance the count's two pointers are the warning counter's (int64[1], never read).
    count, saved = (warning, warning) if advance is None else advance
    tail = arg_key((warning, B, plan.total_D, count, saved))
    with joined(streams, weights.device):  # also when a launch raises: see launch.joined
        for i, (features, cols, grid, constexprs, warps, (plan_a, plan_b)) in enumerate(launches):
            if i == 0 and advance is not None:  # on the caller's stream (bucket_streams' first)
                constexprs = {**constexprs, "ADVANCE": True}
            args = (
                weights,
                indices,
                offsets,
                psw,
                out,
                features,
                cols,
                tensors.feature_dim,
                tensors.feature_weight_offset,
                out_offset,
                tensors.feature_rows,
                warning,
                B,
                plan.total_D,
                count,
                saved,
            )
            launch(_pooled_forward_kernel, grid, args, constexprs, warps, key=head + plan_a + mid + plan_b + tail,
                   stream=streams[i % len(streams)] if streams else None)
    return out


def sequence_forward(spec: TBESpec, weights: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
                     B: int, advance: Optional[StepAdvance] = None) -> torch.Tensor:
    """[N, D]: every lookup's row (ids already checked / repaired by the bounds-check mode). ``advance``:
    as pooled_forward's."""
    plan, cfg = spec.plan, spec.config.forward
    N, D = indices.numel(), plan.max_D
    out = torch.empty(N, D, dtype=spec.output_dtype, device=weights.device)
    if N == 0:
        advance_by_torch_ops(advance)
        return out
    bd = plan.buckets[0].block_d
    count, saved = (out, out) if advance is None else advance  # unused without ADVANCE
    launch(
        _sequence_forward_kernel,
        (cdiv(N, cfg.sequence_block),),
        (weights, indices, offsets, out, spec.tensors.feature_weight_offset, N, B, plan.num_features, D, count, saved),
        dict(SEARCH_STEPS=(plan.num_features + 1).bit_length(), EVEN_D=spec.bucket_even_d[0],
             ALIGN=spec.bucket_align[0], BLOCK_D=bd, BLOCK_P=cfg.sequence_block, ADVANCE=advance is not None),
        tile_warps(cfg.sequence_warps, cfg.sequence_block * bd),
    )
    return out


def grouped_buckets(spec: TBESpec, B: int, skip_small: bool) -> tuple[list, int]:
    """(the buckets a pooled forward of batch ``B`` launches as one (forward.grouped_max_batch), their
    column slices: the first entries of PlanTensors.grouped_features), or ([], 0) for one launch per
    bucket: also where the slices would not fit one grid's second dimension (the bucket launches take
    their features in slices that fit). From host ints only."""
    if not 0 < B <= spec.config.forward.grouped_max_batch:
        return [], 0
    ks = [k for k, b in enumerate(spec.plan.buckets) if b.features and not (skip_small and b.small)]
    tensors = spec.tensors
    slices = tensors.grouped_generic if skip_small else tensors.grouped_features.numel()
    return (ks, slices) if len(ks) > 1 and slices <= launch_ops.MAX_GRID_Y else ([], 0)


def _launches(spec: TBESpec, B: int, num_lookups: int, weighted: bool, weight_bytes: int,
              out_align: Optional[int] = None, skip_small: bool = False) -> list:
    """(features, entry columns, grid, constexprs, num_warps, the plan tensors' argument keys) of each
    launch; memoised per spec on the host ints they depend on (the mean bag length only through
    lanes_gather's power of two).
    ``out_align``: VBE's (ops/vbe.py: output rows through the per-bag table); None: the fixed-batch
    [B, total_D] output. ``skip_small``: the small-table buckets take their own path in this call."""
    num_bags = B * spec.plan.num_features
    key = ("forward", B, mean_bag_pow2(num_lookups, num_bags), weighted, weight_bytes, out_align, skip_small)
    found = spec.launch_plans.get(key)
    if found is not None:
        return found
    plan, cfg, tensors = spec.plan, spec.config.forward, spec.tensors
    mode = fused_repair_mode(spec)

    def one(ks: list, bd: int, n: int, features: torch.Tensor, cols: Optional[torch.Tensor]) -> tuple:
        """The launch of buckets ``ks`` at BLOCK_D ``bd`` over ``n`` grid-y entries (column slices
        ``cols`` of ``features``, whose narrow features take narrower tiles (forward.grouped_narrow);
        None: whole features)."""
        align = min(spec.bucket_align[k] for k in ks)
        bags, lanes, gather = cfg.knobs(bd, weight_bytes, B)
        if lanes > 1:
            shrunk = lanes_gather(gather, num_lookups, num_bags)
            lanes = short_bag_lanes(lanes, gather, shrunk, cfg.short_bag_max_lanes)
            gather = shrunk
        constexprs = dict(
            POOLING_MEAN=spec.pooling_mean,
            WEIGHTED=weighted,
            BOUNDS_MODE=mode,
            EVEN_D=len(ks) == 1 and spec.bucket_even_d[ks[0]],
            ALIGN=align,
            BLOCK_D=bd,
            GATHER=gather,
            BAGS=bags,
            LANES=lanes,
            OUT_MAP=out_align is not None,
            OUT_ALIGN=align if out_align is None else min(out_align, align),
            COL_CHUNKS=cols is not None,
        )
        if cols is not None:
            dims = [plan.feature_dims[t] for k in ks for t in plan.buckets[k].features]
            for i, (width, narrow_lanes) in enumerate(cfg.narrow_levels(bd, dims)):
                suffix = "" if i == 0 else str(i + 1)
                constexprs.update({f"NARROW{suffix}": width, f"NARROW{suffix}_LANES": narrow_lanes})
        grid = (cdiv(B, bags * lanes), n)
        warps = tile_warps(cfg.num_warps.get(bd), lanes * gather * bd)
        cols = features if cols is None else cols
        plan_keys = (arg_key((features, cols, tensors.feature_dim, tensors.feature_weight_offset)),
                     arg_key((tensors.feature_rows,)))
        return features, cols, grid, constexprs, warps, plan_keys

    grouped, n = grouped_buckets(spec, B, skip_small)
    if grouped:
        # Slices no wider than the widest bucket: where every table is narrower than chunk_width, each
        # feature is one entry at column 0 (PlanTensors) and the tile the widest bucket's.
        bd = min(tensors.chunk_width, max(plan.buckets[k].block_d for k in grouped))
        launches = [one(grouped, bd, n, tensors.grouped_features, tensors.grouped_cols)]
    else:
        # A bucket of more features than one grid's second dimension holds launches once per slice of
        # them (a view of its feature list: the kernel reads feature ids through it).
        launches = [one([k], b.block_d, features.numel(), features, None)
                    for k, b in enumerate(plan.buckets) if b.features and not (skip_small and b.small)
                    for features in grid_y_slices(tensors.bucket_features[k])]
    spec.launch_plans[key] = launches
    return launches
