"""Kernel tuning knobs, loaded from ``configs/<target>.yaml``.

Knobs change speed, never results: gather width, bag lanes, bags per program and warps for the
forward; the short/long run threshold, the long-run chunk, gather width, warps and persistent-grid
size for the backward. Per-``BLOCK_D`` values are looked up with :meth:`KnobTable.get` (exact key,
else ``default``).

Target selection (:func:`load_config`): an explicit ``KernelConfig`` or file path wins; else the
environment variable ``TORCHREC_TRITON_TBE_CONFIG`` (a target name such as ``sm90`` or a path); else
``interpreter`` under ``TRITON_INTERPRET=1`` and ``sm<major><minor>`` of the device on CUDA.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Union

import torch
import yaml

from torchrec_triton_tbe import _env


@dataclasses.dataclass(frozen=True)
class KnobTable:
    """An int knob keyed by BLOCK_D, with a default."""

    default: int
    by_block_d: tuple[tuple[int, int], ...] = ()

    def get(self, block_d: int) -> int:
        return self._table.get(block_d, self.default)

    @functools.cached_property
    def _table(self) -> dict:
        # Looked up per launch on the host path of every call: built once, not per get().
        return dict(self.by_block_d)

    @staticmethod
    def parse(value: Union[int, Mapping[Any, int]], name: str) -> "KnobTable":
        if isinstance(value, int):
            return KnobTable(value)
        if "default" not in value:
            raise ValueError(f"config knob {name!r} needs a 'default' entry, got {dict(value)}")
        pairs = tuple(sorted((int(k), int(v)) for k, v in value.items() if k != "default"))
        return KnobTable(int(value["default"]), pairs)


def _by_weights(table: KnobTable, fp32_table: Optional[KnobTable], block_d: int, weight_bytes: int) -> int:
    """A knob with its own table for fp32 weights (rows twice as wide as fp16/bf16 rows of that BLOCK_D);
    without one, the shared table."""
    return (fp32_table if weight_bytes >= 4 and fp32_table is not None else table).get(block_d)


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    # Groups of bag_lanes bags pooled one after another per program (by BLOCK_D; an int is every width's).
    bags_per_program: KnobTable
    gather: KnobTable  # ids of each bag per step (by BLOCK_D)
    num_warps: KnobTable
    bag_lanes: KnobTable = KnobTable(1)  # bags pooled side by side (by BLOCK_D); 1: one bag at a time
    # The same for fp32 weights, whose rows are twice as wide as fp16/bf16 rows of that BLOCK_D (None:
    # bag_lanes). configs/sm90.yaml has none since fp32 rows are summed in fp32 (docs/performance.md,
    # "fp32 weights": one lane at 128 won 1 % on one shape and lost 1.6x with one id per bag).
    bag_lanes_fp32: Optional[KnobTable] = None
    # Sequence (PoolingMode.NONE) forward: lookups per program and its warps (kernels/sequence.py).
    # 32 where a config leaves it out: Triton 3.6 (torch 2.11's) fails to compile the kernel at 16
    # ("PassManager::run failed" at every BLOCK_D from 32 with 1-8 warps, and at 4 with 1 warp);
    # 3.8 compiles them (tools/compile_specs.py, 2026-12-04).
    sequence_block: int = 32
    sequence_warps: int = 4
    # Streams the D-bucket launches of one pooled forward are spread over (1: the caller's stream
    # only), for forwards of at least bucket_streams_min_lookups lookups. At a small batch each
    # bucket's launch lasts as long as its longest bags' chain of dependent id -> row loads while most
    # of the GPU idles; on one stream those chains run one bucket after another. The fork and join
    # cost a few host microseconds per side stream, which launch-bound forwards cannot spare.
    bucket_streams: int = 1
    bucket_streams_min_lookups: int = 0
    # Batches of at most small_batch bags per feature (0: none) take the *_small knobs, fp32 weights
    # too (until 2026-12-02 only 2-byte ones: fp32 rows at B = 2,048 then ran the B = 65,536 knobs, and
    # prod_t100_b2k's fp32 forward took 2.2x FBGEMM's time). The tables above were tuned at
    # B = 65,536, where every SM is full of programs and a few rows in flight per program suffice; at
    # B = 2,048 a launch holds too few programs to cover the latency of its dependent id -> row loads
    # that way, and one bag group per program with more rows per step ran the launches of a 100-table
    # shape in half the time (tools/forward_buckets.py).
    small_batch: int = 0
    bags_per_program_small: int = 1
    gather_small: Optional[KnobTable] = None  # None: gather
    bag_lanes_small: Optional[KnobTable] = None  # None: bag_lanes
    # Pooled forwards of at most grouped_max_batch bags per feature (0: never) over two or more D
    # buckets go in one launch instead of one per bucket: each feature split into grouped_block_d-wide
    # column slices, one program per slice and bag group (kernels/forward.py COL_CHUNKS). At small
    # batches the host issues the bucket launches slower than the GPU runs them (FBGEMM issues one);
    # the slices trade some masked lanes on narrow features for that. The slice's knobs are the
    # tables' (and the small-batch ones') at BLOCK_D = grouped_block_d.
    grouped_max_batch: int = 0
    grouped_block_d: int = 64
    # In that launch, features at most grouped_narrow[i] wide (the first width that holds them; at most
    # two ascending powers of two below the slice width, () for none) pool tiles that wide instead of
    # the slice's, with grouped_block_d / width times the rows per step: grouped_narrow_lanes (by width,
    # at most that ratio) times the bags side by side, the rest as more ids per step (kernels/forward.py
    # NARROW). A 4-wide feature in a 64-wide slice masked 15 of 16 columns of every tile and took as many
    # dependent id -> row steps per bag as a 64-wide one.
    grouped_narrow: tuple[int, ...] = ()
    grouped_narrow_lanes: KnobTable = KnobTable(1)
    # Where bags are shorter than a lanes launch's GATHER (the host shrinks it to the mean bag length,
    # ops/forward.lanes_gather), widen LANES by the factor GATHER shrank, up to this many lanes (0: keep the
    # table's lanes): a step then still loads about LANES * GATHER rows. With one id per bag (DLRM-style
    # features) and lanes 2 / gather 4 at BLOCK_D = 128, a step otherwise loads 2 rows behind one dependent
    # offsets -> id -> row chain, a quarter of what the tables were tuned for on bags of 20.
    short_bag_max_lanes: int = 0

    def narrow_levels(self, block_d: int, dims: Iterable[int]) -> tuple[tuple[int, int], ...]:
        """((width, lanes), ...) of the one-launch forward at slice width ``block_d`` over features of
        widths ``dims``: the grouped_narrow widths below block_d that some feature takes (a width no
        feature takes would only add a branch to compile). From host ints only."""
        dims = sorted(set(dims))
        levels, below = [], 0
        for w in self.grouped_narrow:
            if w < block_d and any(below < d <= w for d in dims):
                levels.append((w, min(self.grouped_narrow_lanes.get(w), block_d // w)))
            below = max(below, w)
        return tuple(levels)

    def lanes(self, block_d: int, weight_bytes: int) -> int:
        return _by_weights(self.bag_lanes, self.bag_lanes_fp32, block_d, weight_bytes)

    def knobs(self, block_d: int, weight_bytes: int, batch: int) -> tuple[int, int, int]:
        """(bags_per_program, bag_lanes, gather) of a pooled launch at this BLOCK_D, weight width and
        batch size (bags per feature: a host int)."""
        if batch <= self.small_batch:
            return (self.bags_per_program_small, (self.bag_lanes_small or self.bag_lanes).get(block_d),
                    (self.gather_small or self.gather).get(block_d))
        return self.bags_per_program.get(block_d), self.lanes(block_d, weight_bytes), self.gather.get(block_d)

    def __post_init__(self) -> None:
        # Callers (tests, tools, replace_forward) may still give one int for every width.
        if isinstance(self.bags_per_program, int):
            object.__setattr__(self, "bags_per_program", KnobTable(self.bags_per_program))


@dataclasses.dataclass(frozen=True)
class TransposeConfig:
    bags_per_program: int  # bags linearized side by side per program
    lookups_per_step: int  # ids of each bag read per step
    num_warps: int
    # Run metadata (kernels/transpose.py): slots / runs per program of a metadata pass, and the step
    # width / warps of the one-program scan of the per-program totals between the passes (serial: on
    # 42 M lookups 41 k totals take 41 steps of 1,024).
    run_block: int = 1024
    scan_block: int = 1024
    scan_warps: int = 4


# Schedules of the long-run (split-K) backward, identical in results (kernels/backward_long.py).
LONG_PATHS = ("split", "fused")


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    short_threshold: int  # runs with at least this many lookups take the long (split-K) path
    long_chunk: int  # lookups per split-K chunk of a long run
    tile: KnobTable  # by BLOCK_D: short runs side by side per program (short kernel), slots per step (long path)
    num_warps: KnobTable
    programs: int  # persistent grid size when programs_per_sm == 0
    programs_per_sm: int
    long_path: str = "split"  # LONG_PATHS: two launches ("split") or one with a countdown ("fused")
    # > 0: once a kernel specialization has been compiled, its persistent grid is this many full waves
    # (SMs x the programs its registers / warps / shared memory let one SM hold); 0: always the grid above.
    waves: int = 0
    # `tile` for fp32 weights (None: `tile`). Their rows are twice as wide as fp16/bf16 rows of that
    # BLOCK_D: on the H200 the short kernel at BLOCK_D=128 took 5.94 ms with the fp16 tile (8) and
    # 4.02 ms with 4 (docs/performance.md).
    tile_fp32: Optional[KnobTable] = None
    # Backwards of at most this many lookups replay from CUDA graphs (ops/graphs.py; 0: never): they are
    # launch-bound, and the replay copies the ids and offsets once more (the gradient is read in place;
    # larger batches are GPU-bound and would only pay the copies). At most graph_cache captured shapes
    # per module.
    graph_max_lookups: int = 0
    graph_cache: int = 8
    # Streams the D buckets' update kernels of one backward are spread over (1: the caller's stream
    # only), for backwards of at least bucket_streams_min_lookups lookups: each bucket's short and long
    # kernels stay in order on one stream, and the buckets (disjoint rows, their own workspace chunks)
    # overlap where one bucket's kernels leave most of the GPU idle (few runs, a long tail). Inside a
    # captured backward the streams are parallel branches of the graph.
    bucket_streams: int = 1
    bucket_streams_min_lookups: int = 0
    # With bucket streams: a bucket's short kernel and its long path (partials, then apply) on streams
    # of their own, in backwards of split_paths_min_lookups to split_paths_max_lookups lookups (0: no
    # upper bound) whose buckets leave streams idle (2 x buckets <= bucket_streams). Short and long runs
    # are disjoint rows and only the long path reads the workspace, so the two may overlap; what
    # overlaps is one kernel's tail (persistent programs finishing unevenly) with the other's start,
    # which a one-bucket backward (every homogeneous shape) has no other way to get. With more buckets
    # than that, the buckets already fill the streams (splitting them measured 0.7-1.7 % slower).
    split_paths: bool = False
    split_paths_min_lookups: int = 0
    split_paths_max_lookups: int = 0
    # Where the buckets do fill the streams (2 x buckets > bucket_streams): the heaviest bucket alone
    # (features x BLOCK_D, from the plan) puts its short kernel and long path on two streams, the first
    # two, and the other buckets go round the rest, in backwards of split_paths_min_lookups to
    # split_heaviest_max_lookups lookups (0: no upper bound). The production shapes' update cannot end
    # before that bucket (40-61 % of their gradient bytes, tools/bucket_shares.py), and round-robin puts
    # another bucket on its stream.
    split_heaviest: bool = False
    split_heaviest_max_lookups: int = 0
    # The long path's own tile (slots per step of the partials kernel, partials per step of the apply)
    # and warps, by BLOCK_D (None: the short kernel's tile / num_warps). Its partials kernel reads fp32
    # gradient rows and no weights, so one table serves every weight precision.
    long_tile: Optional[KnobTable] = None
    long_warps: Optional[KnobTable] = None
    # The long path's apply (one optimizer step per long run): partials summed per step and warps, by
    # BLOCK_D (None: the long path's tile / warps), and chunks a program looks at per step for the first
    # chunks of runs (1: one at a time). A hot row's run has thousands of chunks whose partials one program
    # sums, a tile per step. The fused schedule sums them with the same tile but on the long path's warps
    # (apply_warps is the split apply's only): the two give identical bits when those warps are equal, as
    # the last sum across a tile follows the compiled layout.
    apply_tile: Optional[KnobTable] = None
    apply_warps: Optional[KnobTable] = None
    apply_scan: int = 1
    # The short kernel's cap on registers per thread (Triton's maxnreg), by BLOCK_D; 0 or None: the
    # compiler's choice. A cap below what ptxas wants spills to local memory, and buys resident warps:
    # the short kernel ran at 15 % occupancy with 147 registers at BLOCK_D 128 on dlrm_t26_l1 (Nsight
    # Compute, docs/performance.md; prod_t40_b16k's mixed-width bucket compiles to 168 from a CPU), and
    # the persistent grid follows the compiled occupancy (`waves`).
    max_registers: Optional[KnobTable] = None

    def long_knobs(self, block_d: int, row_bytes: int) -> tuple[int, int]:
        """(tile, num_warps) of the long path's kernels at this BLOCK_D (before tile_warps' cap)."""
        tile = self.long_tile.get(block_d) if self.long_tile is not None else self.tiles(block_d, row_bytes)
        return tile, (self.long_warps or self.num_warps).get(block_d)

    def apply_knobs(self, block_d: int, row_bytes: int) -> tuple[int, int]:
        """(tile, num_warps) of the long path's apply at this BLOCK_D (before tile_warps' cap)."""
        tile, warps = self.long_knobs(block_d, row_bytes)
        return (self.apply_tile.get(block_d) if self.apply_tile is not None else tile,
                self.apply_warps.get(block_d) if self.apply_warps is not None else warps)

    def short_maxnreg(self, block_d: int) -> Optional[int]:
        """The short kernel's register cap at this BLOCK_D (None: none)."""
        cap = self.max_registers.get(block_d) if self.max_registers is not None else 0
        return cap or None

    def tiles(self, block_d: int, row_bytes: int) -> int:
        """The tile for rows of ``row_bytes`` per element: weights plus the element-wise optimizer
        state the update carries in registers beside them (Adam: 8 B more), so an fp16 table with
        element-wise state takes the fp32 table's tile."""
        return _by_weights(self.tile, self.tile_fp32, block_d, row_bytes)

    def grid_programs(self, device: torch.device) -> int:
        if self.programs_per_sm > 0 and device.type == "cuda":
            return self.programs_per_sm * _sm_count(device)
        return max(1, self.programs)


@dataclasses.dataclass(frozen=True)
class SmallTableConfig:
    """The small-table path (kernels/small_table.py): tables of at most ``max_rows`` rows (0: none) and
    at most ``max_dim`` columns, each read by exactly one feature, pool through a per-bag histogram
    multiplied with the table, and their backward sums the gradient per row the same way (no sort
    runs, no per-lookup gradient gathers). Fixed-batch pooled forwards only; variable batches (VBE),
    the fused bounds check and sequence tables keep the generic path for every table. ``forward`` /
    ``backward`` (1 or 0): which passes take the path; the other runs those tables' buckets through the
    generic kernels. ``backward_min_bag``: the backward takes a small table's feature only when its
    bags hold at least this many ids on average in the call (0: always); decided per call and feature
    on the device, from the offsets (no sync), by the sort keys' pass and the path's kernels alike, so
    every lookup goes to exactly one of the two paths. ``backward_min_batch``: backwards of fewer bags
    per feature keep the generic kernels for every table (a host decision, from B)."""

    max_rows: int = 0
    max_dim: int = 128
    bags: int = 16  # bags per histogram (the dot's M / K): a power of two >= 16
    groups: int = 8  # histograms per forward program (the table is loaded once per program)
    backward_groups: int = 8  # histograms per backward partials program (one partial tile each)
    positions: int = 128  # lookups per one-hot step of an unweighted histogram: a power of two >= 16
    apply_chunks: int = 32  # partial tiles summed per step of the apply: a power of two
    forward: int = 1
    backward: int = 1
    backward_min_bag: int = 0
    backward_min_batch: int = 0
    num_warps: int = 4


_TOP_LEVEL_KEYS = {"target", "tuned", "forward", "transpose", "backward", "small_table", "precompile"}


def _refuse_unknown(d: Mapping[str, Any], known: set, what: str, where: str) -> None:
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"invalid kernel config {where}: unknown {what}keys {unknown} (known: {sorted(known)})")


def _bool(value: Any, name: str, where: str) -> bool:
    """A yes/no knob: YAML's true/false, or 0/1."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"invalid kernel config {where}: {name} must be true or false, got {value!r}")


def _small_table(d: Mapping[str, Any], where: str) -> SmallTableConfig:
    _refuse_unknown(d, {f.name for f in dataclasses.fields(SmallTableConfig)}, "small_table ", where)
    return SmallTableConfig(**{k: int(v) for k, v in d.items()})


@dataclasses.dataclass(frozen=True)
class PrecompileConfig:
    """``TritonTBE.precompile`` (ops/precompile.py): ``compile_first`` names the kernels whose compile
    jobs go out to the workers first, in this order (widest BLOCK_D first within one), the rest
    following in recording order. Kernel names, not a measure of the GPU: compile time is host work.
    ``load_threads``: the threads that load the compiled kernels (0: one per worker); ``max_workers``:
    at most this many compile processes (0: one per CPU share). Host work too."""

    compile_first: tuple = ()
    load_threads: int = 0
    max_workers: int = 0


def _precompile(d: Mapping[str, Any], where: str) -> PrecompileConfig:
    _refuse_unknown(d, {"compile_first", "load_threads", "max_workers"}, "precompile ", where)
    first = d.get("compile_first") or []
    if not isinstance(first, (list, tuple)) or not all(isinstance(n, str) for n in first):
        raise ValueError(f"invalid kernel config {where}: precompile.compile_first must be a list of kernel names")
    counts = {}
    for key in ("load_threads", "max_workers"):
        value = d.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"invalid kernel config {where}: precompile.{key} must be an int >= 0, got {value!r}")
        counts[key] = value
    return PrecompileConfig(compile_first=tuple(first), **counts)


# Resident thread blocks per SM, by compute capability (CUDA occupancy tables; 32 on sm_80/90/100).
_MAX_BLOCKS_PER_SM = {8: 32, 9: 32, 10: 32, 12: 24}


def resident_programs(n_regs: int, num_warps: int, shared_bytes: int, props: Any) -> int:
    """How many programs of a compiled kernel one SM holds at once: the least of the block, warp,
    register and shared-memory limits. Registers are allocated per warp in units of 256 from four
    scheduler partitions of a quarter of the file each (a warp cannot straddle two), which is what
    Nsight Compute reports on the H200: 224 registers per thread -> 8 one-warp programs, 166 -> 12.
    The driver reserves 1 KiB of shared memory per block."""
    regs_per_warp = -(-max(n_regs, 1) * 32 // 256) * 256
    partition = getattr(props, "regs_per_multiprocessor", 65536) // 4
    limits = [
        _MAX_BLOCKS_PER_SM.get(props.major, 16),
        props.max_threads_per_multi_processor // (32 * num_warps),
        4 * (partition // regs_per_warp) // num_warps,
    ]
    if shared_bytes:
        limits.append(getattr(props, "shared_memory_per_multiprocessor", 0) // (shared_bytes + 1024))
    return max(1, min(limits))


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    target: str
    tuned: bool
    forward: ForwardConfig
    transpose: TransposeConfig
    backward: BackwardConfig
    source: str = ""
    small_table: SmallTableConfig = SmallTableConfig()
    precompile: PrecompileConfig = PrecompileConfig()

    def replace_backward(self, **changes: int) -> "KernelConfig":
        """A copy with some backward knobs changed (routing sweeps, tuning)."""
        return dataclasses.replace(self, backward=dataclasses.replace(self.backward, **changes))

    def replace_small_table(self, **changes: int) -> "KernelConfig":
        cfg = dataclasses.replace(self, small_table=dataclasses.replace(self.small_table, **changes))
        cfg.validate()
        return cfg

    def replace_forward(self, **changes: Any) -> "KernelConfig":
        return dataclasses.replace(self, forward=dataclasses.replace(self.forward, **changes))

    @staticmethod
    def from_dict(d: Mapping[str, Any], source: str = "") -> "KernelConfig":
        where = source or str(d.get("target", "?"))
        # A misspelt knob would otherwise be dropped and its default used without a word.
        _refuse_unknown(d, _TOP_LEVEL_KEYS, "", where)
        f, tr, b = d["forward"], d["transpose"], d["backward"]
        for name, section, cls in (("forward", f, ForwardConfig), ("transpose", tr, TransposeConfig),
                                   ("backward", b, BackwardConfig)):
            _refuse_unknown(section, {x.name for x in dataclasses.fields(cls)}, name + " ", where)
        cfg = KernelConfig(
            target=str(d["target"]),
            tuned=bool(d.get("tuned", False)),
            forward=ForwardConfig(
                bags_per_program=KnobTable.parse(f["bags_per_program"], "forward.bags_per_program"),
                gather=KnobTable.parse(f["gather"], "forward.gather"),
                num_warps=KnobTable.parse(f["num_warps"], "forward.num_warps"),
                # Absent in configs written before the lanes mode: the sequential path.
                bag_lanes=KnobTable.parse(f.get("bag_lanes", 1), "forward.bag_lanes"),
                bag_lanes_fp32=(KnobTable.parse(f["bag_lanes_fp32"], "forward.bag_lanes_fp32")
                                if "bag_lanes_fp32" in f else None),
                sequence_block=int(f.get("sequence_block", ForwardConfig.sequence_block)),
                sequence_warps=int(f.get("sequence_warps", 4)),
                bucket_streams=int(f.get("bucket_streams", 1)),
                bucket_streams_min_lookups=int(f.get("bucket_streams_min_lookups", 0)),
                small_batch=int(f.get("small_batch", 0)),
                bags_per_program_small=int(f.get("bags_per_program_small", 1)),
                gather_small=KnobTable.parse(f["gather_small"], "forward.gather_small") if "gather_small" in f else None,
                bag_lanes_small=(KnobTable.parse(f["bag_lanes_small"], "forward.bag_lanes_small")
                                 if "bag_lanes_small" in f else None),
                grouped_max_batch=int(f.get("grouped_max_batch", 0)),
                grouped_block_d=int(f.get("grouped_block_d", 64)),
                grouped_narrow=tuple(int(w) for w in (f.get("grouped_narrow") or ())),
                grouped_narrow_lanes=KnobTable.parse(f.get("grouped_narrow_lanes", 1), "forward.grouped_narrow_lanes"),
                short_bag_max_lanes=int(f.get("short_bag_max_lanes", 0)),
            ),
            transpose=TransposeConfig(
                bags_per_program=int(tr["bags_per_program"]),
                lookups_per_step=int(tr["lookups_per_step"]),
                num_warps=int(tr["num_warps"]),
                run_block=int(tr.get("run_block", 1024)),
                scan_block=int(tr.get("scan_block", 1024)),
                scan_warps=int(tr.get("scan_warps", 4)),
            ),
            backward=BackwardConfig(
                short_threshold=int(b["short_threshold"]),
                long_chunk=int(b["long_chunk"]),
                tile=KnobTable.parse(b["tile"], "backward.tile"),
                num_warps=KnobTable.parse(b["num_warps"], "backward.num_warps"),
                programs=int(b.get("programs", 0)),
                programs_per_sm=int(b.get("programs_per_sm", 0)),
                long_path=str(b.get("long_path", "split")),
                waves=int(b.get("waves", 0)),
                tile_fp32=KnobTable.parse(b["tile_fp32"], "backward.tile_fp32") if "tile_fp32" in b else None,
                graph_max_lookups=int(b.get("graph_max_lookups", 0)),
                graph_cache=int(b.get("graph_cache", 8)),
                bucket_streams=int(b.get("bucket_streams", 1)),
                bucket_streams_min_lookups=int(b.get("bucket_streams_min_lookups", 0)),
                split_paths=_bool(b.get("split_paths", False), "backward.split_paths", source or str(d["target"])),
                split_paths_min_lookups=int(b.get("split_paths_min_lookups", 0)),
                split_paths_max_lookups=int(b.get("split_paths_max_lookups", 0)),
                split_heaviest=_bool(b.get("split_heaviest", False), "backward.split_heaviest",
                                     source or str(d["target"])),
                split_heaviest_max_lookups=int(b.get("split_heaviest_max_lookups", 0)),
                long_tile=KnobTable.parse(b["long_tile"], "backward.long_tile") if "long_tile" in b else None,
                long_warps=KnobTable.parse(b["long_warps"], "backward.long_warps") if "long_warps" in b else None,
                apply_tile=KnobTable.parse(b["apply_tile"], "backward.apply_tile") if "apply_tile" in b else None,
                apply_warps=(KnobTable.parse(b["apply_warps"], "backward.apply_warps")
                             if "apply_warps" in b else None),
                apply_scan=int(b.get("apply_scan", 1)),
                max_registers=(KnobTable.parse(b["max_registers"], "backward.max_registers")
                               if "max_registers" in b else None),
            ),
            source=source,
            small_table=_small_table(d.get("small_table") or {}, source or str(d["target"])),
            precompile=_precompile(d.get("precompile") or {}, source or str(d["target"])),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        def pow2(x: int) -> bool:
            return x > 0 and x & (x - 1) == 0

        problems = []
        bpp = self.forward.bags_per_program
        if min([bpp.default] + [v for _, v in bpp.by_block_d]) < 1:
            problems.append(f"forward.bags_per_program values must be >= 1, got {bpp}")
        for name, table in [
            ("forward.gather", self.forward.gather),
            ("forward.num_warps", self.forward.num_warps),
            ("forward.bag_lanes", self.forward.bag_lanes),
            ("forward.bag_lanes_fp32", self.forward.bag_lanes_fp32 or KnobTable(1)),
            ("forward.gather_small", self.forward.gather_small or KnobTable(1)),
            ("forward.bag_lanes_small", self.forward.bag_lanes_small or KnobTable(1)),
            ("forward.grouped_narrow_lanes", self.forward.grouped_narrow_lanes),
            ("backward.tile", self.backward.tile),
            ("backward.tile_fp32", self.backward.tile_fp32 or KnobTable(1)),
            ("backward.num_warps", self.backward.num_warps),
            ("backward.long_tile", self.backward.long_tile or KnobTable(1)),
            ("backward.long_warps", self.backward.long_warps or KnobTable(1)),
            ("backward.apply_tile", self.backward.apply_tile or KnobTable(1)),
            ("backward.apply_warps", self.backward.apply_warps or KnobTable(1)),
            ("backward.apply_scan", KnobTable(self.backward.apply_scan)),
        ]:
            for v in [table.default] + [v for _, v in table.by_block_d]:
                if not pow2(v):
                    problems.append(f"{name} values must be powers of two, got {v}")
        for name, v in [
            ("forward.sequence_block", self.forward.sequence_block),
            ("forward.sequence_warps", self.forward.sequence_warps),
            ("transpose.bags_per_program", self.transpose.bags_per_program),
            ("transpose.lookups_per_step", self.transpose.lookups_per_step),
            ("transpose.num_warps", self.transpose.num_warps),
            ("transpose.run_block", self.transpose.run_block),
            ("transpose.scan_block", self.transpose.scan_block),
            ("transpose.scan_warps", self.transpose.scan_warps),
        ]:
            if not pow2(v):
                problems.append(f"{name} must be a power of two, got {v}")
        if not (pow2(self.forward.grouped_block_d) and 16 <= self.forward.grouped_block_d <= 1024):
            # >= 16: a slice's first column must keep every row start's 16-element alignment.
            problems.append(f"forward.grouped_block_d must be a power of two in [16, 1024], got "
                            f"{self.forward.grouped_block_d}")
        narrow = self.forward.grouped_narrow
        if (len(narrow) > 2 or not all(pow2(w) and 4 <= w < self.forward.grouped_block_d for w in narrow)
                or list(narrow) != sorted(set(narrow))):
            problems.append(f"forward.grouped_narrow must hold at most two ascending powers of two in [4, "
                            f"grouped_block_d), got {list(narrow)}")
        if self.forward.short_bag_max_lanes != 0 and not pow2(self.forward.short_bag_max_lanes):
            problems.append(f"forward.short_bag_max_lanes must be 0 (off) or a power of two, got "
                            f"{self.forward.short_bag_max_lanes}")
        for name, v, least, hint in [
            ("forward.bags_per_program_small", self.forward.bags_per_program_small, 1, ""),
            ("forward.small_batch", self.forward.small_batch, 0, " (0: never)"),
            ("forward.bucket_streams", self.forward.bucket_streams, 1, " (1: the caller's stream only)"),
            ("forward.bucket_streams_min_lookups", self.forward.bucket_streams_min_lookups, 0, ""),
            ("forward.grouped_max_batch", self.forward.grouped_max_batch, 0, " (0: never)"),
            ("backward.short_threshold", self.backward.short_threshold, 1, ""),
            ("backward.long_chunk", self.backward.long_chunk, 1, ""),
            ("backward.waves", self.backward.waves, 0, ""),
            ("backward.graph_max_lookups", self.backward.graph_max_lookups, 0, " (0: no CUDA graphs)"),
            ("backward.graph_cache", self.backward.graph_cache, 1, ""),
            ("backward.bucket_streams", self.backward.bucket_streams, 1, " (1: the caller's stream only)"),
            ("backward.bucket_streams_min_lookups", self.backward.bucket_streams_min_lookups, 0, ""),
            ("backward.split_paths_min_lookups", self.backward.split_paths_min_lookups, 0, ""),
            ("backward.split_paths_max_lookups", self.backward.split_paths_max_lookups, 0, " (0: no upper bound)"),
            ("backward.split_heaviest_max_lookups", self.backward.split_heaviest_max_lookups, 0,
             " (0: no upper bound)"),
        ]:
            if v < least:
                problems.append(f"{name} must be >= {least}{hint}")
        st = self.small_table
        if not 0 <= st.max_rows <= 128:
            problems.append(f"small_table.max_rows must be in [0, 128] (0: no small tables), got {st.max_rows}")
        if st.max_dim < 1 or st.groups < 1 or st.backward_groups < 1:
            problems.append("small_table.max_dim, small_table.groups and small_table.backward_groups must be >= 1")
        if not (pow2(st.bags) and st.bags >= 16) or not pow2(st.num_warps):
            problems.append("small_table.bags must be a power of two >= 16 and small_table.num_warps a power of two")
        if st.num_warps > 4:
            # 8 warps with backward_groups > 1 updated ~100-180 weights wrongly on the H200 (Triton 3.6,
            # prod_small_b16k, 2026-12-02; 4 warps, or 8 with one group, matched FBGEMM): not understood.
            problems.append(f"small_table.num_warps must be at most 4, got {st.num_warps}")
        if not (pow2(st.positions) and st.positions >= 16) or not pow2(st.apply_chunks):
            problems.append("small_table.positions must be a power of two >= 16 and small_table.apply_chunks a "
                            "power of two")
        if st.backward_min_bag < 0 or st.backward_min_batch < 0:
            problems.append(f"small_table.backward_min_bag and small_table.backward_min_batch must be >= 0 (0: "
                            f"always), got {st.backward_min_bag}, {st.backward_min_batch}")
        if st.forward not in (0, 1) or st.backward not in (0, 1):
            problems.append(f"small_table.forward and small_table.backward must be 0 or 1, got {st.forward}, "
                            f"{st.backward}")
        if self.backward.long_path not in LONG_PATHS:
            problems.append(f"backward.long_path must be one of {LONG_PATHS}, got {self.backward.long_path!r}")
        regs = self.backward.max_registers or KnobTable(0)
        for v in [regs.default] + [v for _, v in regs.by_block_d]:
            # ptxas allocates a thread's registers in multiples of 8, at most 255 (sm_70 on).
            if v != 0 and not (32 <= v <= 255 and v % 8 == 0):
                problems.append(f"backward.max_registers values must be 0 (no cap) or a multiple of 8 in [32, 248], "
                                f"got {v}")
        if problems:
            raise ValueError(f"invalid kernel config {self.source or self.target}: " + "; ".join(problems))


def tile_warps(wanted: int, tile_elements: int) -> int:
    """num_warps for a kernel whose largest tile has ``tile_elements`` elements: at most one warp per
    256 elements. More warps than that replicate elements across threads, which buys nothing and, with
    vectorised loads, trips a layout-conversion bug in Triton 3.6 ('mask type matches ptr type')."""
    return max(1, min(wanted, tile_elements // 256))


def config_dir() -> Path:
    """``configs/`` of a source checkout, else the copy installed inside the package."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "configs", here / "configs"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"no configs/ directory next to {here}")


@functools.lru_cache(maxsize=None)
def _load_file(path: str) -> KernelConfig:
    with open(path) as fh:
        return KernelConfig.from_dict(yaml.safe_load(fh), source=path)


def load_named(name_or_path: str) -> KernelConfig:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml"):
        return _load_file(str(p.resolve()))
    path = config_dir() / f"{name_or_path}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no kernel config named {name_or_path!r} (looked for {path})")
    return _load_file(str(path))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_target(device: torch.device) -> str:
    if _env.interpreting() or device.type != "cuda":
        return "interpreter"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def load_config(device: torch.device, override: Optional[Union[str, KernelConfig]] = None) -> KernelConfig:
    if isinstance(override, KernelConfig):
        return override
    name = override or os.environ.get("TORCHREC_TRITON_TBE_CONFIG") or default_target(device)
    try:
        return load_named(name)
    except FileNotFoundError:
        if override is not None or "TORCHREC_TRITON_TBE_CONFIG" in os.environ:
            raise
        warnings.warn(
            f"torchrec_triton_tbe: no tuned kernel config for {name}; using sm90's values "
            f"(correct, possibly slow). Add configs/{name}.yaml to tune for this GPU.",
            stacklevel=3,
        )
        return load_named("sm90")
