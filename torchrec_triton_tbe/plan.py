"""The flat table layout: the one place that knows where a (table, row) lives.

Everything the kernels need to address weights, outputs and sort keys is derived once, at module
construction, into a frozen :class:`TablePlan` plus a few small device tensors (:class:`PlanTensors`).

Three index spaces are in play:

* **weights**: all tables concatenated row-major into one flat buffer; table ``k`` starts at element
  ``weights_offsets[k]`` and has row stride ``dims[k]`` (64-bit offsets: one table may exceed 2^31
  elements).
* **output**: ``out[b, D_offsets[t] : D_offsets[t] + D_t]`` for feature ``t`` (FBGEMM's layout).
* **sort keys** (backward): lookup of feature ``t`` at row ``i`` gets key ``key_offsets[table(t)] + i``.
  Tables are laid out in key space ordered by D bucket (next power of two of D), so after the sort
  every bucket's runs are one contiguous range and each bucket's kernels launch with their own
  ``BLOCK_D`` without a compaction pass.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import torch
import triton

from torchrec_triton_tbe.ops import launch


def block_d(dim: int) -> int:
    """The power-of-two tile width a table of width ``dim`` is processed with."""
    return max(4, triton.next_power_of_2(dim))


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Features (and their tables) sharing one ``BLOCK_D``."""

    block_d: int
    features: tuple[int, ...]
    tables: tuple[int, ...]
    key_begin: int  # first sort key of this bucket's tables
    key_end: int  # one past the last
    small: bool = False  # small tables (kernels/small_table.py), where the call allows that path


@dataclasses.dataclass(frozen=True)
class SmallGroup:
    """Small tables (kernels/small_table.py) of one ``BLOCK_D``: what one launch of that path covers."""

    block_d: int
    features: tuple[int, ...]
    tables: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class TablePlan:
    rows: tuple[int, ...]  # per table
    dims: tuple[int, ...]  # per table
    feature_table_map: tuple[int, ...]  # per feature
    table_names: tuple[str, ...] = ()
    # The small-table path's reach (config.SmallTableConfig): tables of at most this many rows (0: none)
    # and at most small_max_dim columns, read by one feature each, form small_groups; with small_split
    # (the forward's path needs it: the generic forward skips whole buckets) they also get buckets of
    # their own, otherwise they stay in the generic buckets (one bucket more per width cost the H200
    # 0.27 ms of forward and 0.18 ms of backward on prod_t40_b16k, 2026-12-02).
    small_max_rows: int = 0
    small_max_dim: int = 0
    small_split: bool = True
    # FBGEMM's embedding_shard_info: per table, the whole table's rows and dim and where this module's
    # part starts (row offset, column offset); TorchRec passes it for its shards. Error messages only.
    shards: tuple[tuple[int, int, int, int], ...] = ()

    def table_label(self, k: int) -> str:
        return f"table {k} ({self.table_names[k]!r})" if self.table_names else f"table {k}"

    def shard_note(self, k: int) -> str:
        """For an error about table ``k``: where this module holds only a shard of it, which one, and that
        the ids and positions the error gives are the shard's; "" otherwise."""
        if len(self.shards) != len(self.rows):
            return ""
        full_rows, full_dim, row_offset, col_offset = self.shards[k]
        rows, dim = self.rows[k], self.dims[k]
        if (full_rows, full_dim) == (rows, dim):
            return ""
        return (f". This module holds a shard of that table: rows [{row_offset}, {row_offset + rows}) and columns "
                f"[{col_offset}, {col_offset + dim}) of its {full_rows} x {full_dim}; the ids, positions and samples "
                "here are those of the shard's batch (after TorchRec's bucketization), not of the batch as given")

    @functools.cached_property
    def num_tables(self) -> int:
        return len(self.rows)

    @functools.cached_property
    def num_features(self) -> int:
        return len(self.feature_table_map)

    @functools.cached_property
    def weights_offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for r, d in zip(self.rows, self.dims):
            out.append(acc)
            acc += r * d
        return tuple(out)

    @functools.cached_property
    def total_weight_elements(self) -> int:
        return sum(r * d for r, d in zip(self.rows, self.dims))

    @functools.cached_property
    def empty_row_offset(self) -> Optional[int]:
        """Element offset of a zero row past every table, which lookups of tables of 0 rows read; None
        where no table has 0 rows. Such a table (a row-wise shard of a table with fewer rows than ranks)
        has no row to read, and a bounds check that repairs (WARNING / IGNORE) turns its ids into 0, as
        FBGEMM's does, whose kernels then read the next table's row 0 or, after the last table, past the
        weights, and whose backward updates there. Here those lookups read this row and the backward
        drops them (feature_key_offset: the sentinel key): a bad id there pools zeros and updates nothing.
        16-element aligned, so it does not narrow the kernels' vector width (TBESpec.bucket_align)."""
        if all(self.rows):
            return None
        return -(-self.total_weight_elements // 16) * 16

    @functools.cached_property
    def weight_storage_elements(self) -> int:
        """Elements of the flat weights buffer: every table, then the zero row of empty_row_offset."""
        base = self.empty_row_offset
        return self.total_weight_elements if base is None else base + self.max_D

    @functools.cached_property
    def lookup_weight_offsets(self) -> tuple[int, ...]:
        """Per table: the element offset its lookups read row 0 at (weights_offsets, or the zero row)."""
        return tuple(o if r else self.empty_row_offset for o, r in zip(self.weights_offsets, self.rows))

    @functools.cached_property
    def total_rows(self) -> int:
        return sum(self.rows)

    @functools.cached_property
    def row_offsets(self) -> tuple[int, ...]:
        """First row of each table in the per-row optimizer state (table order)."""
        out, acc = [], 0
        for r in self.rows:
            out.append(acc)
            acc += r
        return tuple(out)

    @functools.cached_property
    def feature_dims(self) -> tuple[int, ...]:
        return tuple(self.dims[k] for k in self.feature_table_map)

    @functools.cached_property
    def D_offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for d in self.feature_dims:
            out.append(acc)
            acc += d
        return tuple(out + [acc])

    @functools.cached_property
    def total_D(self) -> int:
        return self.D_offsets[-1]

    @functools.cached_property
    def max_D(self) -> int:
        return max(self.dims) if self.dims else 0

    @functools.cached_property
    def small_tables(self) -> frozenset:
        """Tables the small-table path may take (see small_max_rows)."""
        readers = [0] * self.num_tables
        for k in self.feature_table_map:
            readers[k] += 1
        return frozenset(k for k in range(self.num_tables)
                         if 0 < self.rows[k] <= self.small_max_rows and self.dims[k] <= self.small_max_dim
                         and readers[k] == 1)

    @functools.cached_property
    def buckets(self) -> tuple[Bucket, ...]:
        # Generic buckets first, then the small tables' own (per width): each bucket's tables are one
        # contiguous key range either way.
        buckets, key = [], 0
        own = self.small_tables if self.small_split else frozenset()
        for small in (False, True):
            chosen = [k for k in range(self.num_tables) if (k in own) == small]
            for w in sorted({block_d(self.dims[k]) for k in chosen}):
                tables = tuple(k for k in chosen if block_d(self.dims[k]) == w)
                features = tuple(t for t, k in enumerate(self.feature_table_map) if k in tables)
                begin = key
                key += sum(self.rows[k] for k in tables)
                buckets.append(Bucket(w, features, tables, begin, key, small))
        return tuple(buckets)

    @functools.cached_property
    def small_groups(self) -> tuple[SmallGroup, ...]:
        """The small tables by width (with small_split: the small buckets' tables, in their order), in
        groups of at most MAX_GRID_Y: a group's launches take one feature (each table has one) per grid-y
        entry."""
        groups = []
        for w in sorted({block_d(self.dims[k]) for k in self.small_tables}):
            width = tuple(k for k in sorted(self.small_tables) if block_d(self.dims[k]) == w)
            for i, n in launch.grid_y_chunks(len(width)):
                tables = width[i:i + n]
                members = frozenset(tables)
                features = tuple(t for t, k in enumerate(self.feature_table_map) if k in members)
                groups.append(SmallGroup(w, features, tables))
        return tuple(groups)

    @functools.cached_property
    def key_offsets(self) -> tuple[int, ...]:
        """Per table: the sort key of its row 0 (tables grouped by bucket)."""
        out = [0] * self.num_tables
        for bucket in self.buckets:
            key = bucket.key_begin
            for k in bucket.tables:
                out[k] = key
                key += self.rows[k]
        return tuple(out)

    @functools.cached_property
    def sentinel_key(self) -> int:
        # Key of lookups outside every bag (offsets[0] > 0 is legal in FBGEMM): it sorts past all real
        # keys and lies outside every bucket's key range, so no kernel visits it.
        return self.total_rows

    @functools.cached_property
    def key_dtype(self) -> torch.dtype:
        # int32 keys halve the radix-sort width; only when every key (and the sentinel) fits.
        return torch.int32 if self.total_rows < 2**31 - 1 else torch.int64

    @staticmethod
    def build(
        specs: Sequence[tuple[int, int]],
        feature_table_map: Optional[Sequence[int]],
        table_names: Optional[Sequence[str]] = None,
        small_max_rows: int = 0,
        small_max_dim: int = 0,
        shards: Optional[Sequence[Sequence[int]]] = None,
    ) -> "TablePlan":
        rows = tuple(int(r) for r, _ in specs)
        dims = tuple(int(d) for _, d in specs)
        if not rows:
            raise ValueError("embedding_specs is empty: at least one table is required")
        for k, (r, d) in enumerate(zip(rows, dims)):
            if r < 0 or d <= 0:
                raise ValueError(f"table {k}: rows must be >= 0 and dim > 0, got rows={r}, dim={d}")
        ftm = tuple(range(len(rows))) if feature_table_map is None else tuple(int(k) for k in feature_table_map)
        if not ftm:
            raise ValueError("feature_table_map is empty: at least one feature is required")
        for t, k in enumerate(ftm):
            if not 0 <= k < len(rows):
                raise ValueError(f"feature_table_map[{t}] = {k} is not a table index in [0, {len(rows)})")
        names = tuple(table_names or ())
        if names and len(names) != len(rows):
            raise ValueError(f"table_names has {len(names)} entries for {len(rows)} tables")
        shard_info = tuple(tuple(int(x) for x in s) for s in shards or ())
        if shard_info and (len(shard_info) != len(rows) or any(len(s) != 4 for s in shard_info)):
            raise ValueError(f"embedding_shard_info has {len(shard_info)} entries for {len(rows)} tables; each is "
                             "(rows, dim, row offset, column offset) of the whole table")
        return TablePlan(rows, dims, ftm, names, int(small_max_rows), int(small_max_dim), shards=shard_info)


@dataclasses.dataclass(frozen=True)
class PlanTensors:
    """Per-feature and per-bucket lookup tables on the device (built once per module)."""

    feature_table: torch.Tensor  # int32 [T]
    feature_dim: torch.Tensor  # int32 [T]
    feature_rows: torch.Tensor  # int64 [T] rows of the feature's table (bounds check)
    feature_weight_offset: torch.Tensor  # int64 [T] element offset of the table in the flat weights
    feature_row_offset: torch.Tensor  # int64 [T] first row of the table in the per-row state
    feature_out_offset: torch.Tensor  # int32 [T] column offset in the pooled output
    feature_key_offset: torch.Tensor  # int64 [T] sort key of row 0 of the feature's table
    feature_small: torch.Tensor  # int32 [T] 1 where the feature's table is in a small-table bucket
    bucket_features: tuple[torch.Tensor, ...]  # int32 [T_k] per bucket
    small_group_features: tuple[torch.Tensor, ...]  # int32 [T_g] per TablePlan.small_groups entry
    bucket_key_bounds: torch.Tensor  # [K + 1] key_dtype: bucket k owns keys [b[k], b[k+1])
    # The one-launch pooled forward's entries (ops/forward.py, kernels/forward.py COL_CHUNKS): a
    # (feature, first column) pair per chunk_width-wide column slice of every feature, the generic
    # buckets' features first (widest first: their programs are the longest), then the small-table
    # buckets' (the first grouped_generic entries serve a call whose small tables take their own path).
    grouped_features: torch.Tensor  # int32 [E]
    grouped_cols: torch.Tensor  # int32 [E]
    grouped_generic: int
    chunk_width: int

    @staticmethod
    def build(plan: TablePlan, device: torch.device, chunk_width: int = 64) -> "PlanTensors":
        ftm = plan.feature_table_map
        i32 = dict(dtype=torch.int32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        key_bounds = [b.key_begin for b in plan.buckets] + [plan.buckets[-1].key_end]
        entries = []
        for small in (False, True):
            if small:
                generic = len(entries)
            feats = [t for b in plan.buckets if b.small == small for t in b.features]
            for t in sorted(feats, key=lambda t: (-plan.feature_dims[t], t)):
                entries += [(t, c) for c in range(0, plan.feature_dims[t], chunk_width)]
        return PlanTensors(
            feature_table=torch.tensor(ftm, **i32),
            feature_dim=torch.tensor(plan.feature_dims, **i32),
            feature_rows=torch.tensor([plan.rows[k] for k in ftm], **i64),
            feature_weight_offset=torch.tensor([plan.lookup_weight_offsets[k] for k in ftm], **i64),
            feature_row_offset=torch.tensor([plan.row_offsets[k] for k in ftm], **i64),
            feature_out_offset=torch.tensor(plan.D_offsets[:-1], **i32),
            # A table of 0 rows: its (repaired) lookups sort with the sentinel, which no kernel applies.
            feature_key_offset=torch.tensor([plan.key_offsets[k] if plan.rows[k] else plan.sentinel_key
                                             for k in ftm], **i64),
            feature_small=torch.tensor([int(k in plan.small_tables) for k in ftm], **i32),
            bucket_features=tuple(torch.tensor(b.features, **i32) for b in plan.buckets),
            small_group_features=tuple(torch.tensor(g.features, **i32) for g in plan.small_groups),
            bucket_key_bounds=torch.tensor(key_bounds, dtype=plan.key_dtype, device=device),
            grouped_features=torch.tensor([t for t, _ in entries], **i32),
            grouped_cols=torch.tensor([c for _, c in entries], **i32),
            grouped_generic=generic,
            chunk_width=chunk_width,
        )
