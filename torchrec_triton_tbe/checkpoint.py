"""FBGEMM's module ``state_dict`` loaded into ``TritonTBE``.

FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` saves each state (weights, momentum1, momentum2,
row_counter) as three flat buffers by placement, ``<name>_dev`` (DEVICE), ``<name>_uvm`` (MANAGED,
MANAGED_CACHING) and ``<name>_host`` (HOST), with ``<name>_placements`` and ``<name>_offsets`` saying
where each feature's table starts, plus metadata and cache buffers. This module keeps one flat buffer
per state, tables in table order. :func:`from_fbgemm` rewrites a state dict of FBGEMM's form into ours
in place, so ``TritonTBE.load_state_dict`` takes a checkpoint of a bare FBGEMM module of the same tables
(TorchRec checkpoints go through the per-table getters and interchange either way without this). One
way only: FBGEMM's module does not read this module's state dict. An FBGEMM module whose tables are
cached (MANAGED_CACHING) must be flushed (``flush()``) before it is saved, as for its own getters: its
``_uvm`` buffers lag the cache until then.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from torchrec_triton_tbe._fbgemm import EmbeddingLocation
from torchrec_triton_tbe.plan import TablePlan

logger = logging.getLogger(__name__)

_SUFFIX = {
    EmbeddingLocation.DEVICE.value: "dev",
    EmbeddingLocation.MANAGED.value: "uvm",
    EmbeddingLocation.MANAGED_CACHING.value: "uvm",
    EmbeddingLocation.HOST.value: "host",
}


def is_fbgemm(state_dict: dict, prefix: str) -> bool:
    """Whether the module's part of ``state_dict`` is FBGEMM's form: its weights by placement, not ours."""
    return prefix + "weights" not in state_dict and prefix + "weights_placements" in state_dict


def from_fbgemm(state_dict: dict, prefix: str, plan: TablePlan, states: dict[str, tuple[torch.Tensor, bool]],
                step: torch.Tensor) -> None:
    """Rewrites FBGEMM's entries under ``prefix`` into this module's: each of ``states`` (name -> (this
    module's buffer, one value per row?); a state its optimizer does not keep has an empty buffer and stays
    empty) gathered table by table from FBGEMM's placement buffers; ``iter`` as FBGEMM saved it (it does
    where its optimizer counts steps), else ``step``, this module's; every other FBGEMM entry under
    ``prefix`` (metadata, caches) dropped. A state whose placements FBGEMM did not save (its optimizer
    has no such state) is left out, for ``load_state_dict`` to report missing (or, non-strict, to keep
    this module's). Raises ``ValueError`` naming the difference where the checkpoint's tables do not
    match: rows or dims per feature, which features share a table, or a state's size (one value per row
    here, per element there, or the other way round)."""
    T = plan.num_features
    first_feature: dict[int, int] = {}
    for t, k in enumerate(plan.feature_table_map):
        first_feature.setdefault(k, t)
    for key, want in (("rows_per_table", [plan.rows[k] for k in plan.feature_table_map]),
                      ("feature_dims", list(plan.feature_dims))):
        got = state_dict.get(prefix + key)
        if got is not None and got.tolist() != want:
            raise ValueError(f"FBGEMM checkpoint: {key} {got.tolist()} per feature, this module has {want}")
    for name, (buffer, rowwise) in states.items():
        if buffer.numel() == 0:
            state_dict[prefix + name] = buffer.detach()
            continue
        if prefix + f"{name}_placements" not in state_dict:
            continue
        # The weights' tables alone: TritonTBE._load_from_state_dict appends the zero row of
        # TablePlan.empty_row_offset, as for its own checkpoints from before it.
        state_dict[prefix + name] = _gather(state_dict, prefix, name, plan, first_feature, T, rowwise)
    state_dict.setdefault(prefix + "iter", step.detach())
    kept = {prefix + n for n in (*states, "iter", "placeholder_autograd_tensor")}
    dropped = [k for k in state_dict if k.startswith(prefix) and "." not in k[len(prefix):] and k not in kept]
    for k in dropped:
        del state_dict[k]
    logger.debug("TritonTBE: from FBGEMM's checkpoint, left out %s", dropped)


def _gather(state_dict: dict, prefix: str, name: str, plan: TablePlan, first_feature: dict, T: int,
            rowwise: bool) -> torch.Tensor:
    placements = _entry(state_dict, prefix, f"{name}_placements", T)
    offsets = _entry(state_dict, prefix, f"{name}_offsets", T)
    for t, placement in enumerate(placements):
        if placement not in _SUFFIX:
            raise ValueError(f"FBGEMM checkpoint: {name}_placements[{t}] = {placement} is not a placement this "
                             f"module reads ({', '.join(EmbeddingLocation(p).name for p in _SUFFIX)})")
    # FBGEMM places a table once, where its features' (placement, offset) point: features share one of
    # this module's tables exactly where they share one of FBGEMM's.
    where: dict[tuple[int, int], int] = {}
    for t, k in enumerate(plan.feature_table_map):
        if plan.rows[k] == 0:  # an empty table starts where the next does
            continue
        k_there = where.setdefault((placements[t], offsets[t]), k)
        if k_there != k or (placements[first_feature[k]], offsets[first_feature[k]]) != (placements[t], offsets[t]):
            raise ValueError(f"FBGEMM checkpoint: feature {t} reads another table there than here "
                             f"(feature_table_map {list(plan.feature_table_map)} here)")
    # Each placement buffer holds exactly its tables: a state per row here and per element there (or the
    # other way round) sizes differently.
    table_size = [r if rowwise else r * d for r, d in zip(plan.rows, plan.dims)]
    sizes: dict[str, int] = {}  # by buffer (MANAGED and MANAGED_CACHING share _uvm)
    for k, t in first_feature.items():
        suffix = _SUFFIX[placements[t]]
        sizes[suffix] = sizes.get(suffix, 0) + table_size[k]
    for suffix, size in sizes.items():
        source = state_dict.get(f"{prefix}{name}_{suffix}")
        if source is not None and source.numel() != size:
            raise ValueError(f"FBGEMM checkpoint: {name}_{suffix} holds {source.numel()} values, this module's "
                             f"tables there take {size} ({'one per row' if rowwise else 'rows x dim'})")
    parts: list[torch.Tensor] = []
    for k, size in enumerate(table_size):
        t = first_feature.get(k)
        if size == 0:
            continue
        if t is None:
            raise ValueError(f"FBGEMM checkpoint: no feature reads table {k}, and FBGEMM's {name}_offsets place "
                             "tables by feature")
        placement = int(placements[t])
        source = state_dict.get(f"{prefix}{name}_{_SUFFIX[placement]}")
        begin = int(offsets[t])
        if source is None or source.numel() < begin + size:
            raise ValueError(f"FBGEMM checkpoint: table {k}'s {name} ({size} values from {begin}) is not in "
                             f"{name}_{_SUFFIX[placement]} ({0 if source is None else source.numel()} values)")
        parts.append(source.reshape(-1)[begin : begin + size].detach())
    return torch.cat([p.to(parts[0].dtype) for p in parts]) if parts else torch.zeros(0)


def _entry(state_dict: dict, prefix: str, key: str, T: int) -> Sequence[int]:
    value = state_dict.get(prefix + key)
    if value is None or value.numel() != T:
        raise ValueError(f"FBGEMM checkpoint: {prefix}{key} holds "
                         f"{'nothing' if value is None else value.numel()} entries, expected one per feature ({T})")
    return value.tolist()
