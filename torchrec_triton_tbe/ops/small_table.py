"""Launch the small-table path (kernels/small_table.py) for the plan's small groups.

Which tables: tables of at most ``small_table.max_rows`` rows and ``max_dim`` columns, each read by one
feature, are the plan's small groups (plan.py; buckets of their own only where the forward takes the
path). Which calls: fixed-batch pooled ones without the fused bounds check, in the passes
``small_table.forward`` / ``.backward`` name (``applies``, and for the backward ``backward_applies``);
any other call or pass runs those tables through the generic kernels, which handle every bucket. These
choices use the spec and the call's host ints only; the backward's per-feature choice
(``backward_min_bag``) is made on the device from the offsets. No device sync either way, so captured
backwards (ops/graphs.py) replay it as they replay the rest.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton

from torchrec_triton_tbe.config import tile_warps
from torchrec_triton_tbe.kernels.small_table import (
    _small_backward_apply_kernel,
    _small_backward_partials_kernel,
    _small_forward_kernel,
)
from torchrec_triton_tbe.ops.launch import cdiv, launch
from torchrec_triton_tbe.ops.spec import TBESpec


def applies(spec: TBESpec, vbe, pass_: str) -> bool:
    """Whether this call's ``pass_`` ("forward" or "backward") takes the small-table path for the plan's
    small groups (config small_table.forward / .backward say which passes may; the forward's needs the
    small tables' own buckets, TablePlan.small_split)."""
    st = spec.config.small_table
    return (bool(spec.plan.small_tables) and bool(getattr(st, pass_)) and vbe is None and not spec.nobag
            and not spec.fused_bounds_check and (pass_ == "backward" or spec.plan.small_split))


def backward_applies(spec: TBESpec, vbe, B: int, num_lookups: int) -> bool:
    """Whether this backward launches the path at all: ``applies`` it, B is at least
    small_table.backward_min_batch (below it the path's few bag chunks per feature lost to the generic
    kernels on the H200: prod_t100_b2k), and the call has enough lookups for one feature to reach
    ``min_lookups`` (a feature has at most all of them; DLRM's one-id bags never do). Host ints only;
    the sort keys' pass and the update ask it with the same values."""
    return (applies(spec, vbe, "backward") and B >= spec.config.small_table.backward_min_batch
            and num_lookups >= min_lookups(spec, B))


def min_lookups(spec: TBESpec, B: int) -> int:
    """The lookups a small-table feature needs in a backward of B bags to take the path (config
    small_table.backward_min_bag per bag); the kernels compare it with the feature's count on the
    device (kernels/small_table.py _feature_lookups)."""
    return spec.config.small_table.backward_min_bag * B


def _shape(spec: TBESpec, g: int) -> tuple[int, int]:
    """(E_PAD, BLOCK_D) of small group g: the tl.dot operands' sides are at least 16."""
    group = spec.plan.small_groups[g]
    rows = max(spec.plan.rows[t] for t in group.tables)
    return max(16, triton.next_power_of_2(rows)), max(16, group.block_d)


def forward(spec: TBESpec, g: int, weights: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
            per_sample_weights: Optional[torch.Tensor], out: torch.Tensor, B: int) -> None:
    """Small group g's pooled outputs into ``out`` ([B, total_D])."""
    st, tensors = spec.config.small_table, spec.tensors
    e_pad, bd = _shape(spec, g)
    weighted = per_sample_weights is not None
    launch(
        _small_forward_kernel,
        (cdiv(B, st.bags * st.groups), len(spec.plan.small_groups[g].features)),
        (weights, indices, offsets, per_sample_weights if weighted else weights, out, tensors.small_group_features[g],
         tensors.feature_dim, tensors.feature_weight_offset, tensors.feature_out_offset, tensors.feature_rows, B,
         spec.plan.total_D),
        dict(POOLING_MEAN=spec.pooling_mean, WEIGHTED=weighted, BLOCK_D=bd, E_PAD=e_pad, BAGS=st.bags,
             GROUPS=st.groups, POSITIONS=st.positions),
        tile_warps(st.num_warps, max(e_pad, st.bags) * bd),
    )


def backward(spec: TBESpec, g: int, optim_state: tuple, grad_out: torch.Tensor, indices: torch.Tensor,
             offsets: torch.Tensor, per_sample_weights: Optional[torch.Tensor], B: int) -> None:
    """Small group g's gradients summed per row (partials per bag chunk, reduced in chunk order) and one
    optimizer step per touched row. ``optim_state``: OptimizerTensors.kernel_args(). Features whose
    lookups are under ``min_lookups`` this call are left to the generic kernels (their programs here
    return at once; the sort keys' pass gave their lookups real keys)."""
    st, tensors, group = spec.config.small_table, spec.tensors, spec.plan.small_groups[g]
    e_pad, bd = _shape(spec, g)
    n_chunks = cdiv(B, st.bags * st.backward_groups)
    features = len(group.features)
    weighted = per_sample_weights is not None
    device = grad_out.device
    # Every slot is written by its chunk's program (zeros included), so no fill is needed; sized from
    # host ints, as a captured backward requires.
    partials = torch.empty(features * n_chunks * e_pad * bd, dtype=torch.float32, device=device)
    counts = torch.empty(features * n_chunks * e_pad, dtype=torch.int32, device=device)
    warps = tile_warps(st.num_warps, max(e_pad, st.bags) * bd)
    least = min_lookups(spec, B)
    launch(
        _small_backward_partials_kernel,
        (n_chunks, features),
        (partials, counts, grad_out, indices, offsets, per_sample_weights if weighted else grad_out,
         tensors.small_group_features[g], tensors.feature_dim, tensors.feature_out_offset, B, spec.plan.total_D,
         n_chunks, least),
        dict(POOLING_MEAN=spec.pooling_mean, WEIGHTED=weighted, BLOCK_D=bd, E_PAD=e_pad, BAGS=st.bags,
             GROUPS=st.backward_groups, POSITIONS=st.positions),
        warps,
    )
    launch(
        _small_backward_apply_kernel,
        (e_pad, features),
        (*optim_state, partials, counts, tensors.small_group_features[g], tensors.feature_dim, tensors.feature_rows,
         tensors.feature_weight_offset, tensors.feature_row_offset, offsets, B, n_chunks, least),
        dict(**spec.optimizer.constexprs(), SR_DROP_BITS=spec.sr_drop_bits, BLOCK_D=bd, RNG_D=group.block_d,
             E_PAD=e_pad, CHUNKS=st.apply_chunks),
        tile_warps(st.num_warps, st.apply_chunks * bd),
    )
