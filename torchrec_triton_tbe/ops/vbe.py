"""Variable batch size per feature (FBGEMM's VBE) on the fixed-batch kernels.

FBGEMM's layout: ``batch_size_per_feature_per_rank[t][r]`` = B_tr bags of feature t from rank r;
offsets [sum B_tr + 1], feature-major (feature t's bags: rank 0's, then rank 1's, ...); the output is
1-D and rank-major: for each rank r, for each feature t, a [B_tr, D_t] block, blocks packed in that
order — or, with ``vbe_output`` / ``vbe_output_offsets`` (TorchRec merging several kernels' outputs),
written into the caller's buffer at ``vbe_output_offsets[r][t]``.

Here every feature is padded to B = max_t sum_r B_tr bags: padding bags are empty (start = end = the
feature's end), so the padded offsets [T * B + 1] are a gather of the given ones and every kernel runs
its fixed-batch bag grid unchanged. Only where a bag's output row is changes: a per-bag table
``out_map`` [T * B] holds each bag's row start in the 1-D output (-1 for padding bags, which write
nothing), and the kernels read it instead of ``b * total_D + column[t]`` (their OUT_MAP constexpr).
WARNING and IGNORE repair the given offsets in place, as FBGEMM does, before they are padded (repairing
the padded copy set its last offset, a padding bag's end, to N: the last real bag lost its ids); FATAL
and the id checks run on the padded offsets; FATAL's messages name a bad bag by the caller's position.

Cost against a fixed batch of the same lookups: T*B - sum B empty bags (two offsets read each), 8 B
of table per bag (read once by the forward, once per lookup by the backward's gather), and one launch
(kernels/vbe.py) building both from one small host-to-device copy. No host sync.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch

from torchrec_triton_tbe.errors import InputError
from torchrec_triton_tbe.kernels.vbe import _vbe_layout_kernel
from torchrec_triton_tbe.ops.launch import cdiv, grid_y_chunks, launch
from torchrec_triton_tbe.ops.spec import TBESpec

LAYOUT_BLOCK = 1024  # padded bags per program of the layout kernel


@dataclasses.dataclass(frozen=True)
class VBELayout:
    """One call's variable batch, as the kernels see it."""

    B: int  # bags per feature after padding (max over features of their total batch)
    offsets: torch.Tensor  # [T * B + 1] padded offsets (the ids' dtype)
    out_map: torch.Tensor  # [T * B] int64: element offset of each bag's output row, -1 for padding
    out_size: int  # elements of the output (the caller's vbe_output when given)
    out_align: int  # a power of two (<= 16) dividing every out_map entry
    output: Optional[torch.Tensor] = None  # the caller's vbe_output, written in place
    bag_begin: tuple = ()  # [T + 1] the caller's index of each feature's first bag (FATAL's messages name it)


def _pow2_divisor(g: int) -> int:
    align = 1
    while align < 16 and g % (align * 2) == 0:
        align *= 2
    return align


def check_batch_sizes(spec: TBESpec, batch_size_per_feature_per_rank) -> list[list[int]]:
    """The per-feature, per-rank batch sizes as ints, with FBGEMM's shape: one list per feature, the
    same number of ranks in each (ValueError otherwise, naming the feature)."""
    T = spec.plan.num_features
    if not isinstance(batch_size_per_feature_per_rank, (list, tuple)) or len(batch_size_per_feature_per_rank) != T:
        got = len(batch_size_per_feature_per_rank) if isinstance(batch_size_per_feature_per_rank, (list, tuple)) else type(
            batch_size_per_feature_per_rank).__name__
        raise InputError(f"batch_size_per_feature_per_rank must hold one list per feature (T={T}), got {got}")
    sizes, ranks = [], None
    for t, per_rank in enumerate(batch_size_per_feature_per_rank):
        if not isinstance(per_rank, (list, tuple)) or not per_rank:
            raise InputError(f"batch_size_per_feature_per_rank[{t}] must be a non-empty list of per-rank batch sizes")
        row = []
        for r, b in enumerate(per_rank):
            if isinstance(b, bool) or not isinstance(b, int) or b < 0:
                raise InputError(f"batch_size_per_feature_per_rank[{t}][{r}] = {b!r}: batch sizes are ints >= 0")
            row.append(int(b))
        if ranks is not None and len(row) != ranks:
            raise InputError(f"batch_size_per_feature_per_rank[{t}] has {len(row)} ranks, feature 0 has {ranks}")
        ranks = len(row)
        sizes.append(row)
    return sizes


def check_output(spec: TBESpec, vbe_output, vbe_output_offsets, ranks: int) -> None:
    """FBGEMM's check_allocated_vbe_output, as ValueErrors (the forward runs it before anything is written)."""
    T = spec.plan.num_features
    if (vbe_output is None) != (vbe_output_offsets is None):
        raise InputError("vbe_output and vbe_output_offsets must be given together")
    if not isinstance(vbe_output, torch.Tensor) or vbe_output.dim() != 1 or not vbe_output.is_contiguous():
        raise InputError("vbe_output must be a contiguous 1-D tensor")
    if vbe_output.dtype != spec.output_dtype:
        raise InputError(f"vbe_output is {vbe_output.dtype}; the module's output dtype is {spec.output_dtype}")
    if not isinstance(vbe_output_offsets, torch.Tensor) or tuple(vbe_output_offsets.shape) != (ranks, T):
        got = tuple(getattr(vbe_output_offsets, "shape", ()))
        raise InputError(f"vbe_output_offsets must have shape [ranks, features] = [{ranks}, {T}], got {got}")
    for name, x in (("vbe_output", vbe_output), ("vbe_output_offsets", vbe_output_offsets)):
        if x.device != spec.device:
            raise InputError(f"{name} is on {x.device}, the module on {spec.device}")
    if vbe_output_offsets.dtype not in (torch.int32, torch.int64):
        raise InputError(f"vbe_output_offsets must be int32 or int64, got {vbe_output_offsets.dtype}")


def vbe_layout(
    spec: TBESpec,
    offsets: torch.Tensor,
    sizes: Sequence[Sequence[int]],
    vbe_output: Optional[torch.Tensor] = None,
    vbe_output_offsets: Optional[torch.Tensor] = None,
) -> VBELayout:
    """The padded offsets and per-bag output table of one variable batch (``sizes``: check_batch_sizes'
    result; ``offsets``: already checked for their length, sum(sizes) + 1; ``vbe_output`` and its offsets:
    by check_output, before the forward writes anything)."""
    plan = spec.plan
    T, R = plan.num_features, len(sizes[0])
    dims = plan.feature_dims
    per_feature = [sum(row) for row in sizes]
    B = max(per_feature) if per_feature else 0
    device = offsets.device
    # Host ints -> one small int64 tensor, one host-to-device copy: bag starts per feature [T + 1], bags
    # per feature [T], rank starts within each feature [T, R + 1], dims [T], output block bases [T, R].
    bag_begin = [0]
    for n in per_feature:
        bag_begin.append(bag_begin[-1] + n)
    rank_begin = [[0] + [sum(row[: r + 1]) for r in range(R)] for row in sizes]
    if vbe_output is None:
        base, acc = [[0] * R for _ in range(T)], 0
        for r in range(R):  # rank-major
            for t in range(T):
                base[t][r] = acc
                acc += sizes[t][r] * dims[t]
        out_size = acc
        out_align = _pow2_divisor(math.gcd(*dims)) if dims else 1
    else:
        base, out_size = None, vbe_output.numel()
        out_align = 1  # the caller's offsets are device data: nothing is known about their alignment
    host = bag_begin + per_feature + [x for row in rank_begin for x in row] + list(dims)
    if base is not None:
        host += [x for row in base for x in row]
    small = torch.tensor(host, dtype=torch.int64).to(device, non_blocking=True)
    parts = torch.split(small, [T + 1, T, T * (R + 1), T] + ([T * R] if base is not None else []))
    bag_begin_d, per_feature_d, rank_begin_d, dims_d = parts[:4]

    padded = torch.empty(T * B + 1, dtype=offsets.dtype, device=device)
    out_map = torch.empty(T * B, dtype=torch.int64, device=device)
    if base is not None:
        base_d, stride_t, stride_r = parts[4], R, 1
    else:
        base_d, (stride_r, stride_t) = vbe_output_offsets, vbe_output_offsets.stride()
    for t0, features in grid_y_chunks(T):
        launch(
            _vbe_layout_kernel,
            (cdiv(max(B, 1), LAYOUT_BLOCK), features),
            (offsets, bag_begin_d, per_feature_d, rank_begin_d, dims_d, base_d, padded, out_map, B, R,
             bag_begin[-1], stride_t, stride_r, T, t0),
            dict(BLOCK=LAYOUT_BLOCK),
            4,
        )
    return VBELayout(B=B, offsets=padded, out_map=out_map, out_size=out_size, out_align=out_align,
                     output=vbe_output, bag_begin=tuple(bag_begin))
