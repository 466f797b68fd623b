"""Input validation and FBGEMM's bounds-check modes.

Host checks (dtypes, ranks, sizes) never touch data and never sync. Data checks depend on the mode:

* ``FATAL``: offsets and ids are checked on the device, then one host sync reads a 3-element verdict;
  a bad input raises ``ValueError`` naming the feature, table, sample and position, before any kernel
  writes anything (weights and optimizer state stay untouched). The only mode with a sync.
* ``WARNING`` / ``IGNORE``: FBGEMM's repair. ``offsets[-1]`` is set to ``len(indices)``; then each bag's
  ``[start, end)`` is clamped into ``[0, N]`` with ``start`` no less than the previous bag's end, which is
  what FBGEMM's sequential per-bag loop produces and equals ``cummax(clamp(offsets, 0, N))``; ids outside
  ``[0, rows)`` become 0. Repairs happen in place, as in FBGEMM. WARNING adds the number of repairs to
  the module's ``bounds_check_warning`` counter (on the device: no sync, so no per-batch log line).
  Offsets take one launch (kernels/bounds.py): a parallel check counting bad bags, whose last program
  to finish does the running max only when the count is not 0.
* ``NONE``: no data check: out-of-range ids read out of bounds, as in FBGEMM.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from torchrec_triton_tbe.errors import InputError, InputTypeError
from torchrec_triton_tbe.kernels.bounds import (
    CHECK_ONLY,
    REPAIR_COUNT,
    REPAIR_SILENT,
    _check_indices_kernel,
    _check_offsets_kernel,
)
from torchrec_triton_tbe.ops.launch import cdiv, launch, recording_into
from torchrec_triton_tbe.ops.spec import Bounds, TBESpec

INDEX_DTYPES = (torch.int32, torch.int64)
OFFSETS_BLOCK = 1024  # offsets per program of the check; per step of its last program's repair
IDS_BLOCK = 1024  # id positions per program of the id check (a flat, bandwidth-bound pass)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def validate_shapes(
    spec: TBESpec,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    feature_requires_grad: Optional[torch.Tensor],
    vbe_bags: Optional[int] = None,
) -> int:
    """Checks that need no data; returns B (fixed batch) or the bags of a variable batch (``vbe_bags``,
    the sum of batch_size_per_feature_per_rank: offsets must have one more element)."""
    T = spec.plan.num_features
    for name, x in (("indices", indices), ("offsets", offsets)):
        if not isinstance(x, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in INDEX_DTYPES:
            raise InputTypeError(f"{name} must be int32 or int64, got {x.dtype}")
        if x.dim() != 1:
            raise InputError(f"{name} must be 1-D, got shape {tuple(x.shape)}")
        if x.device != spec.device:
            raise InputError(f"{name} is on {x.device}, the module's tables are on {spec.device}")
    if vbe_bags is not None:
        if offsets.numel() != vbe_bags + 1:
            raise InputError(
                f"offsets has {offsets.numel()} elements; batch_size_per_feature_per_rank sums to {vbe_bags} "
                f"bags, so {vbe_bags + 1} are expected (feature-major, each feature's bags rank by rank)"
            )
    elif offsets.numel() < 1 or (offsets.numel() - 1) % T != 0:
        raise InputError(
            f"offsets has {offsets.numel()} elements; expected T*B+1 with T={T} features "
            f"(table-major: offsets[t*B+b] starts bag b of feature t)"
        )
    if per_sample_weights is not None:
        if spec.nobag:
            # FBGEMM has no weighted sequence kernel either: nothing would pool the weighted rows.
            raise InputError("per_sample_weights are not supported with pooling_mode=NONE (no pooling to weight)")
        if not isinstance(per_sample_weights, torch.Tensor) or per_sample_weights.dtype not in FLOAT_DTYPES:
            got = getattr(per_sample_weights, "dtype", type(per_sample_weights).__name__)
            raise InputTypeError(f"per_sample_weights must be a float32/float16/bfloat16 tensor, got {got}")
        if per_sample_weights.shape != indices.shape:
            raise InputError(
                f"per_sample_weights has shape {tuple(per_sample_weights.shape)}, indices {tuple(indices.shape)}: "
                "one weight per lookup is required"
            )
        if per_sample_weights.device != spec.device:
            raise InputError(f"per_sample_weights is on {per_sample_weights.device}, the module on {spec.device}")
    if feature_requires_grad is not None and feature_requires_grad.numel() != T:
        raise InputError(f"feature_requires_grad has {feature_requires_grad.numel()} elements, expected T={T}")
    return vbe_bags if vbe_bags is not None else (offsets.numel() - 1) // T


def check_finite(name: str, x: torch.Tensor) -> None:
    """The opt-in non-finite guard (``module.check_finite``): raises ``ValueError`` naming the first
    NaN / Inf element of ``x``. One sync (the verdict), two when it raises (the position)."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        first = bad.reshape(-1).nonzero()[0, 0].item()
        pos = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), x.shape))
        raise InputError(
            f"{name}[{', '.join(map(str, pos))}] = {x.reshape(-1)[first].item()} is not finite ({int(bad.sum())} non-finite "
            f"of {x.numel()}); module.check_finite is on, so nothing was updated"
        )


def _launch_id_check(spec: TBESpec, indices, offsets, B: int, mode: int, warning, first_bad) -> None:
    N, T = indices.numel(), spec.plan.num_features
    if N == 0 or B == 0:  # no bag: no id is read, so none is checked
        return
    launch(
        _check_indices_kernel,
        (cdiv(N, IDS_BLOCK),),
        (indices, offsets, spec.tensors.feature_rows, warning, first_bad, B, N, T, max(T - 1, 0).bit_length()),
        dict(MODE=mode, BLOCK=IDS_BLOCK),
        4,
    )


def _repaired_offsets(offsets: torch.Tensor, N: int) -> torch.Tensor:
    fixed = offsets.clone()
    fixed[-1:].fill_(N)  # fill_, not item assignment: no host-to-device copy, no sync
    return torch.cummax(fixed.clamp(0, N), dim=0).values


def _invalid_bags(offsets: torch.Tensor, N: int) -> torch.Tensor:
    start, end = offsets[:-1], offsets[1:]
    return (start < 0) | (start > end) | (end > N)


def check_and_repair(
    spec: TBESpec,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    B: int,
    warning: torch.Tensor,
    ids: bool = True,
    bag_begin: Sequence[int] = (),
) -> None:
    """Runs the module's bounds-check mode on offsets that repair_offsets has already handled (WARNING /
    IGNORE; before VBE pads them): FATAL's check, or the ids' repair. ``ids=False`` leaves that repair
    to the forward kernel (fused bounds check). ``bag_begin`` (VBE): the caller's index of each
    feature's first bag, for FATAL's messages."""
    mode = spec.bounds
    if mode == Bounds.NONE:
        return
    if mode == Bounds.FATAL:
        _fatal_check(spec, indices, offsets, B, bag_begin)
        return
    if ids:
        id_mode = REPAIR_COUNT if mode == Bounds.WARNING else REPAIR_SILENT
        _launch_id_check(spec, indices, offsets, B, id_mode, warning, warning)


def repair_offsets(spec: TBESpec, offsets: torch.Tensor, N: int, warning: torch.Tensor, scratch: torch.Tensor) -> None:
    """WARNING / IGNORE: checks the caller's offsets and, when bad, repairs them in place, as FBGEMM does,
    in one launch (counted under WARNING); check_and_repair's id repair follows. Nothing under NONE or
    FATAL (FATAL's check is check_and_repair's).
    ``scratch``: the module's int32[2] zeros, the check's count and tickets (kernels/bounds.py), zero
    again after it."""
    mode = spec.bounds
    if mode in (Bounds.NONE, Bounds.FATAL):
        return
    num_bags = offsets.numel() - 1
    launch(
        _check_offsets_kernel,
        # At least one program: with B = 0 (offsets [x]) the last offset must still equal N, as FBGEMM has it.
        (max(1, cdiv(num_bags, OFFSETS_BLOCK)),),
        (offsets, scratch, warning, num_bags, N),
        dict(COUNT=mode == Bounds.WARNING, BLOCK=OFFSETS_BLOCK),
        4,
    )


def _fatal_check(spec: TBESpec, indices: torch.Tensor, offsets: torch.Tensor, B: int,
                 bag_begin: Sequence[int] = ()) -> None:
    N = indices.numel()
    device = offsets.device
    big = torch.iinfo(torch.int64).max
    bad_bags = _invalid_bags(offsets, N)
    bag_ids = torch.arange(bad_bags.numel(), device=device)
    first_bad_bag = torch.where(bad_bags, bag_ids, big).amin() if bad_bags.numel() else torch.tensor(big)
    # Check ids over repaired offsets so the kernel's loops stay inside [0, N) whatever the offsets.
    safe = _repaired_offsets(offsets, N).to(offsets.dtype)
    first_bad_id = torch.full((1,), N, dtype=torch.int64, device=device)
    _launch_id_check(spec, indices, safe, B, CHECK_ONLY, first_bad_id, first_bad_id)
    if recording_into() is not None:
        # Precompile's dry run records launches without running them: offsets a recorded kernel would have
        # written (VBE's padded copy) hold garbage, and no verdict exists; the real step checks this input.
        return
    # The one sync of FATAL mode: a 3-element verdict.
    last, bad_bag, bad_pos = torch.stack(
        [offsets[-1].to(torch.int64), first_bad_bag.to(device), first_bad_id[0]]
    ).tolist()
    plan = spec.plan
    if last != N:
        raise InputError(
            f"bounds check (FATAL): offsets[-1] = {last} but indices has {N} elements; they must be equal"
        )
    if bad_bag != big:
        t, b = divmod(bad_bag, B)
        s, e = offsets[bad_bag].item(), offsets[bad_bag + 1].item()
        # VBE: the caller's bag (a real bag's padded offsets are the caller's, so s and e are too).
        at = bag_begin[t] + b if bag_begin else bad_bag
        raise InputError(
            f"bounds check (FATAL): bag {at} (feature {t}, {plan.table_label(plan.feature_table_map[t])}, sample {b}) "
            f"spans offsets[{at}:{at + 2}] = [{s}, {e}); offsets must be non-decreasing within [0, {N}]"
            + plan.shard_note(plan.feature_table_map[t])
        )
    if bad_pos != N:
        bag = int(torch.searchsorted(safe, torch.tensor(bad_pos, dtype=safe.dtype, device=device), right=True)) - 1
        t, b = divmod(bag, B)
        k = plan.feature_table_map[t]
        raise InputError(
            f"bounds check (FATAL): indices[{bad_pos}] = {indices[bad_pos].item()} is out of range for feature {t} "
            f"({plan.table_label(k)}, {plan.rows[k]} rows), sample {b}; ids must lie in [0, {plan.rows[k]})"
            + plan.shard_note(k)
        )
