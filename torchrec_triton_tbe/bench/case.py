"""One benchmark case (a shape and its options), the command-line parser, and suite files.

Option names and defaults are those of FBGEMM's ``split_table_batched_embeddings_benchmark.py device``
(``TbeBenchClickInterface.common_options / table_options / device_options`` plus the ``device``
command's own options), so a command line written for FBGEMM's benchmark means the same here (its
command name, ``device``, may lead: cli.py drops it; ``device-with-spec`` leads a command line of that
FBGEMM command: per-table lists only, T their length, ``--bag-size-sigma-list`` for bag sizes that vary
per sample, batches drawn as that command draws them; ``vbe`` leads one of FBGEMM's vbe command, whose
options bench/vbe_command.py reads). FBGEMM's options for what TritonTBE does not have
(``FBGEMM_ONLY_OPTIONS``: UVM / cache placement, SSD, the dense module, request files, traces) are accepted
at FBGEMM's defaults and refused with the reason otherwise, rather than ignored.
Per-table ``--num-embeddings-list``, ``--bag-size-list``, ``--alpha-list`` and ``--batch-size-list`` (a
variable batch per feature) extend ``device``: they draw the batches table by table, as FBGEMM's
``device-with-spec`` and ``vbe`` commands do, but with generate_requests' default Zipf oversampling
(those commands oversample bags of at most 5 ids 5x: lead with ``device-with-spec`` for its sampling rule;
the batches then follow FBGEMM's seeds and draws, except Zipf ids' row permutation, which FBGEMM's commands
leave unseeded and batches.py seeds: the same distribution, other rows).
Differences: ``--optimizer`` (FBGEMM's ``device`` has only ``--row-wise/--no-row-wise``, i.e. row-wise
Adagrad or EXACT_ADAGRAD, which map onto it; here every optimizer TritonTBE implements, by FBGEMM's
EmbOptimType names in lower case); the weight types FBGEMM quantizes (int8, fp8, ...) are not offered
because TritonTBE does not implement them.

Precedence when a suite is used: FBGEMM's defaults < the suite's ``defaults`` < the shape entry <
options given explicitly on the command line (so ``--suite h200 --iters 20`` shortens every shape).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import yaml

# FBGEMM's EmbOptimType member names, lower case (runner.py maps them back).
OPTIMIZERS = ("exact_sgd", "exact_rowwise_adagrad", "exact_adagrad", "adam", "partial_rowwise_adam", "lamb",
              "partial_rowwise_lamb", "lars_sgd")
PASSES = ("fwd", "bwd")
POOLINGS = ("sum", "mean", "none")
LIST_FIELDS = ("embedding_dim_list", "num_embeddings_list", "bag_size_list", "bag_size_sigma_list", "alpha_list",
               "batch_size_list")
PRECISIONS = ("fp32", "fp16", "bf16")
# FBGEMM's BoundsCheckMode values: FATAL, WARNING, IGNORE, NONE, then V2_IGNORE, V2_WARNING, V2_FATAL (which
# FBGEMM's TBE, and TritonTBE, run as the first three).
BOUNDS_CHECK_MODES = range(7)
# Options of FBGEMM's `device` command that configure what TritonTBE does not have (caches, UVM, SSD, the
# dense module, request files, traces): accepted at FBGEMM's default, refused otherwise (runs with them
# would not measure the same thing on both sides). name -> (default, why refused).
FBGEMM_ONLY_OPTIONS = {
    "managed": ("device", "every table lives in device memory here (no UVM or cache placement)"),
    "uvm_host_mapped": (False, "no UVM here"),
    "ssd": (False, "no SSD tables here"),
    "ssd_prefix": ("/tmp/ssd_benchmark", "no SSD tables here"),
    "dense": (False, "the dense (non-TBE) module is not part of this A/B"),
    "tables": (None, "request files are not read here"),
    "requests_data_file": (None, "request files are not read here"),
    "indices_file": (None, "request files are not read here"),
    "offsets_file": (None, "request files are not read here"),
    "weighted_num_requires_grad": (None, "per-sample-weight gradients are not benchmarked here"),
    "export_trace": (False, "trace export is not implemented here (tools/profile_kernels.py profiles kernels)"),
    "trace_url": ("{tbe_type}_tbe_{phase}_trace_{ospid}.json", "trace export is not implemented here"),
    "deterministic": (False, "not implemented here"),
}
# FBGEMM's cache knobs: accepted at any value, since FBGEMM reads them only with a cache (which --managed
# refuses). name -> (default, help).
FBGEMM_CACHE_OPTIONS = {
    "cache_precision": (None, "no embedding cache here: FBGEMM reads it only with one"),
    "cache_load_factor": (0.2, "no embedding cache here: FBGEMM reads it only with one"),
}
# FBGEMM parses these case-insensitively.
_LOWERED = {"managed"}
# FBGEMM's benchmark commands this CLI mirrors (a command line may start with one; `device` when none):
# `device` (T, E, D, L for every table, or our per-table lists), `device-with-spec` (per-table lists
# only, T their length, batches drawn table by table with FBGEMM's Zipf oversampling rule and optional
# normal bag sizes) and `vbe` (a batch size per table too; its own option names: bench/vbe_command.py).
FBGEMM_COMMANDS = ("device", "device-with-spec", "vbe")
# The commands that draw each table's batches with FBGEMM's per-table rule (Zipf oversampled 5x for bags
# of at most 5 ids, 3x above; the bag-size sigmas).
PER_TABLE_COMMANDS = ("device-with-spec", "vbe")
# Options FBGEMM's `device-with-spec` does not have and which would change its batches: `device`'s one
# T, E, D, L for every table (the lists replace them), --mixed, --num-requests (it draws one batch per
# iteration), and our --batch-size-list (variable batches are FBGEMM's `vbe` command). Ours that only add
# to it stay: --optimizer, --indices-dtype, --alpha-list (printed as the line's `a:`), --compare, ...
NOT_IN_DEVICE_WITH_SPEC = ("num_tables", "num_embeddings", "embedding_dim", "bag_size", "mixed", "num_requests",
                           "batch_size_list")
# `device` options FBGEMM's `device-with-spec` has in no version (1.6.0 to its main branch, August 2026):
# its click refuses them ("No such option"), so they are refused here too, even at their defaults.
DEVICE_ONLY_OPTIONS = ("uvm_host_mapped", "ssd", "ssd_prefix", "dense", "tables", "requests_data_file",
                       "indices_file", "offsets_file", "weighted_num_requires_grad", "cache_load_factor")
# FBGEMM's device-with-spec defaults for its lists (its click options: "128", "100000", "20").
DEVICE_WITH_SPEC_LISTS = {"embedding_dim_list": (128,), "num_embeddings_list": (100_000,), "bag_size_list": (20,)}
# --compare: FBGEMM's TBE, and TorchRec's Triton TBE (bench/peers.py; needs --torchrec-checkout).
COMPARE_KERNELS = ("fbgemm", "torchrec_triton")
# A bare --compare: FBGEMM's flag of that name (fbgemm-gpu >= 1.8; its device, device-with-spec and vbe
# commands rerun the case on FBGEMM's CPU TBE and compare outputs), which this CLI does not run.
FBGEMM_CPU_COMPARE = ("<FBGEMM's --compare flag>",)


@dataclasses.dataclass(frozen=True)
class BenchCase:
    """Everything that defines one measured shape. Field names are the CLI options' ``dest`` names
    (``--batch-size`` -> ``batch_size``) and the keys of suite entries."""

    name: str = "cli"
    # The FBGEMM benchmark command whose batches and lines this case reproduces (FBGEMM_COMMANDS).
    command: str = "device"
    batch_size: int = 512
    num_tables: int = 32
    num_embeddings: int = 100_000
    embedding_dim: int = 128
    bag_size: int = 20
    alpha: float = 1.0  # <= 1: uniform ids; > 1: Zipf(alpha) (FBGEMM's generator)
    weighted: bool = False
    pooling: str = "sum"
    weights_precision: str = "fp32"
    output_dtype: str = "fp32"
    indices_dtype: int = 64
    bounds_check_mode: int = 3  # FBGEMM's BoundsCheckMode: 3 = NONE
    mixed: bool = False  # FBGEMM's --mixed: D_t = round_up(randint(0.5 D, 1.5 D), 4), np seed 42
    embedding_dim_list: Optional[tuple[int, ...]] = None  # explicit per-table D (FBGEMM's device-with-spec)
    # Per-table lists (FBGEMM's device-with-spec / vbe): rows, bag sizes, Zipf alphas, and batch sizes. Any
    # of them makes the batches per table, FBGEMM's vbe way (generate_requests(B_t, 1 table, L_t, E_t,
    # alpha_t) per table, concatenated); batch_size_list makes the batch variable per feature (VBE, one
    # rank: batch_size_per_feature_per_rank = [[B_t]], FBGEMM's vbe command).
    num_embeddings_list: Optional[tuple[int, ...]] = None
    bag_size_list: Optional[tuple[int, ...]] = None
    # Per-table standard deviations of the bag size (FBGEMM's --bag-size-sigma-list): each sample's bag
    # size is drawn once, int(normal(L_t, sigma_t)) clipped at 0 (so some bags are empty), and the same
    # sizes are used by every batch (FBGEMM's generate_requests(sigma_L=...)); L_t is then the mean.
    bag_size_sigma_list: Optional[tuple[int, ...]] = None
    alpha_list: Optional[tuple[float, ...]] = None
    batch_size_list: Optional[tuple[int, ...]] = None
    stoc: bool = False
    reuse: float = 0.0
    iters: int = 100
    warmup_runs: int = 0  # FBGEMM's benchmark_requests adds one more
    num_requests: int = -1  # batches to generate and rotate through; -1: as many as iters
    flush_gpu_cache_size_mb: int = 0
    optimizers: tuple[str, ...] = ("exact_rowwise_adagrad",)  # FBGEMM's default: --row-wise
    passes: tuple[str, ...] = PASSES

    def __post_init__(self) -> None:
        problems = []
        for field in ("batch_size", "num_tables", "num_embeddings", "embedding_dim", "iters"):
            if getattr(self, field) < 1:
                problems.append(f"{field} must be >= 1")
        if self.bag_size < 0:
            problems.append("bag_size must be >= 0")
        if self.warmup_runs < 0:
            problems.append("warmup_runs must be >= 0")
        if self.num_requests == 0 or self.num_requests < -1:
            problems.append("num_requests must be >= 1 (or -1 for iters)")
        if self.pooling not in POOLINGS:
            problems.append(f"pooling {self.pooling!r}: choose from {', '.join(POOLINGS)}")
        lengths_ok = True
        for field in LIST_FIELDS:
            values = getattr(self, field)
            if values is not None and len(values) != self.num_tables:
                problems.append(f"{field} has {len(values)} entries for {self.num_tables} tables")
                lengths_ok = False
        if self.embedding_dim % 4 and self.embedding_dim_list is None:
            problems.append("embedding_dim must be a multiple of 4 (as FBGEMM requires)")
        if self.bounds_check_mode not in BOUNDS_CHECK_MODES:
            problems.append(f"bounds_check_mode {self.bounds_check_mode}: FBGEMM's BoundsCheckMode values are "
                            f"{min(BOUNDS_CHECK_MODES)}-{max(BOUNDS_CHECK_MODES)}")
        for field in ("num_embeddings_list", "batch_size_list"):
            if any(v < 1 for v in getattr(self, field) or ()):
                problems.append(f"{field} entries must be >= 1")
        if any(v < 0 for v in self.bag_size_list or ()):
            problems.append("bag_size_list entries must be >= 0")
        if any(v < 0 for v in self.bag_size_sigma_list or ()):
            problems.append("bag_size_sigma_list entries must be >= 0")
        if self.bag_size_sigma_list is not None and self.reuse > 0:
            # FBGEMM's generate_requests asserts it ("Does not support generating Ls from stats for reuse").
            problems.append("bag_size_sigma_list with reuse > 0: FBGEMM's generator does not support it")
        if self.command not in FBGEMM_COMMANDS:
            problems.append(f"command {self.command!r}: choose from {', '.join(FBGEMM_COMMANDS)}")
        elif self.command == "device-with-spec":
            missing = [f for f in DEVICE_WITH_SPEC_LISTS if getattr(self, f) is None]
            if missing:
                problems.append(f"command device-with-spec takes per-table lists: {', '.join(missing)} missing")
            if self.mixed:
                problems.append("command device-with-spec has no --mixed (its dims are embedding_dim_list)")
            if self.num_requests not in (-1, self.iters):
                problems.append("command device-with-spec draws one batch per iteration (num_requests -1)")
            if self.batch_size_list is not None:
                problems.append("command device-with-spec has one batch size (variable batches: FBGEMM's vbe)")
        elif self.command == "vbe":
            missing = [f for f in ("batch_size_list", *DEVICE_WITH_SPEC_LISTS) if getattr(self, f) is None]
            if missing:
                problems.append(f"command vbe takes per-table lists: {', '.join(missing)} missing")
            if self.num_requests not in (-1, self.iters):
                problems.append("command vbe draws one batch per iteration (num_requests -1)")
        if self.pooling == "none" and (self.mixed or len(set(self.table_dims_static())) > 1):
            problems.append("pooling none needs one embedding dim for every table (FBGEMM's sequence kernels)")
        if self.pooling == "none" and self.batch_size_list is not None:
            problems.append("pooling none with batch_size_list: FBGEMM has no variable batch for sequence lookups")
        if self.pooling == "none" and self.weighted:
            problems.append("pooling none with weighted: per-sample weights weight a pooled sum (FBGEMM's sequence "
                            "lookup takes none)")
        for field in ("weights_precision", "output_dtype"):
            if getattr(self, field) not in PRECISIONS:
                problems.append(f"{field} {getattr(self, field)!r}: TritonTBE supports {', '.join(PRECISIONS)}")
        if self.indices_dtype not in (32, 64):
            problems.append("indices_dtype must be 32 or 64")
        if not self.optimizers or any(o not in OPTIMIZERS for o in self.optimizers):
            problems.append(f"optimizers {self.optimizers}: choose from {', '.join(OPTIMIZERS)}")
        if not self.passes or any(p not in PASSES for p in self.passes):
            problems.append(f"passes {self.passes}: choose from {', '.join(PASSES)}")
        if self.embedding_dim_list is not None:
            if self.mixed:
                problems.append("mixed and embedding_dim_list exclude each other")
            if any(d < 1 or d % 4 for d in self.embedding_dim_list):
                problems.append("embedding_dim_list entries must be positive multiples of 4 (as FBGEMM requires)")
        for t in range(self.num_tables if lengths_ok else 0):
            E, L, alpha = self.num_embeddings_at(t), self.bag_size_at(t), self.alpha_at(t)
            if alpha > 1.0 and E < L:
                problems.append(f"table {t}: Zipf ids need num_embeddings >= bag_size (FBGEMM's generator asserts it)")
                break
        if problems:
            raise ValueError(f"benchmark case {self.name!r}: " + "; ".join(problems))

    @property
    def requests_count(self) -> int:
        return self.iters if self.num_requests == -1 else self.num_requests

    @property
    def per_table(self) -> bool:
        """Whether the batches are drawn table by table (device-with-spec, or any per-table list but the
        dims)."""
        return self.command in PER_TABLE_COMMANDS or any(
            getattr(self, f) is not None for f in LIST_FIELDS if f != "embedding_dim_list")

    @property
    def vbe(self) -> bool:
        return self.batch_size_list is not None

    def batch_size_at(self, t: int) -> int:
        return self.batch_size if self.batch_size_list is None else self.batch_size_list[t]

    def num_embeddings_at(self, t: int) -> int:
        return self.num_embeddings if self.num_embeddings_list is None else self.num_embeddings_list[t]

    def bag_size_at(self, t: int) -> int:
        return self.bag_size if self.bag_size_list is None else self.bag_size_list[t]

    def bag_size_sigma_at(self, t: int) -> Optional[int]:
        return None if self.bag_size_sigma_list is None else self.bag_size_sigma_list[t]

    def bag_size_bound(self, t: int) -> int:
        """A bound on table t's largest bag (L_t, or L_t + 6 sigma_t where sizes are drawn): what a table
        must have rows for when its ids are Zipf (FBGEMM's generator asserts E >= the largest bag)."""
        sigma = self.bag_size_sigma_at(t)
        return self.bag_size_at(t) + (6 * sigma if sigma else 0)

    def alpha_at(self, t: int) -> float:
        return self.alpha if self.alpha_list is None else self.alpha_list[t]

    @property
    def lookups(self) -> int:
        """Lookups per batch; with bag_size_sigma_list, their expected count (the drawn count is in the
        workload's generator stats)."""
        return sum(self.batch_size_at(t) * self.bag_size_at(t) for t in range(self.num_tables))

    def table_dims_static(self) -> list[int]:
        """Per-table D where it is known without drawing (explicit list or one D); mixed: unknown (one
        entry per table of the base D, only for validation)."""
        return list(self.embedding_dim_list) if self.embedding_dim_list is not None else [self.embedding_dim]

    def table_dims(self) -> list[int]:
        """Per-table D. For ``mixed`` this draws from NumPy's global generator exactly as FBGEMM's
        ``device`` does right after ``np.random.seed(42)``, so call it once, right after seeding."""
        if self.embedding_dim_list is not None:
            return list(self.embedding_dim_list)
        if self.mixed:
            D = self.embedding_dim
            return [_round_up(int(np.random.randint(low=int(0.5 * D), high=int(1.5 * D))), 4)
                    for _ in range(self.num_tables)]
        return [self.embedding_dim] * self.num_tables

    def label(self) -> str:
        """Self-describing label, e.g. ``B65536_T32_E1000000_D128_L20_a1.15_fp16`` ("list" where a
        per-table list replaces the value)."""
        d = "mixed" if self.mixed else ("list" if self.embedding_dim_list else str(self.embedding_dim))
        b = "vbe" if self.vbe else str(self.batch_size)
        e = "list" if self.num_embeddings_list else str(self.num_embeddings)
        L = "list" if self.bag_size_list else str(self.bag_size)
        a = "list" if self.alpha_list else f"{self.alpha:g}"
        extra = "".join([
            "_Lsigma" if self.bag_size_sigma_list else "",
            {"device-with-spec": "_spec", "vbe": "_vbecmd"}.get(self.command, ""),
            "_w" if self.weighted else "",
            "_i32" if self.indices_dtype == 32 else "",
            f"_{self.pooling}" if self.pooling != "sum" else "",
        ])
        return f"B{b}_T{self.num_tables}_E{e}_D{d}_L{L}_a{a}_{self.weights_precision}{extra}"

    def options(self) -> dict[str, Any]:
        """JSON-friendly options, with num_requests resolved."""
        out = dataclasses.asdict(self)
        out["num_requests"] = self.requests_count
        for key in ("optimizers", "passes", *LIST_FIELDS):
            if out[key] is not None:
                out[key] = list(out[key])
        return out


CASE_FIELDS = tuple(f.name for f in dataclasses.fields(BenchCase) if f.name != "name")
LIST_KINDS = {"embedding_dim_list": int, "num_embeddings_list": int, "bag_size_list": int,
              "bag_size_sigma_list": int, "alpha_list": float, "batch_size_list": int}


def _round_up(a: int, b: int) -> int:
    return (a + b - 1) // b * b


def _comma_list(kind, choices: Optional[Sequence[str]] = None, none_ok: bool = False):
    """A comma-separated option; ``none_ok``: FBGEMM's spelling of "not given", ``None``, gives None."""

    def parse(text: str):
        if none_ok and str(text).strip() == "None":
            return None
        try:
            items = tuple(kind(x.strip()) for x in str(text).split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected a comma-separated list of {kind.__name__} values") from None
        if choices is not None:
            bad = [x for x in items if x not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"{bad}: choose from {', '.join(choices)}")
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        return items

    return parse


def add_ab_options(p: argparse.ArgumentParser, default: "BenchCase") -> None:
    """The options this CLI adds to FBGEMM's (every command): contenders, checks, suites, output."""
    x = p.add_argument_group("A/B options")
    x.add_argument("--optimizer", dest="optimizers", type=_comma_list(str, OPTIMIZERS), default=default.optimizers,
                   help="comma-separated, of: " + ", ".join(OPTIMIZERS) + " (default exact_rowwise_adagrad, "
                   "FBGEMM's --row-wise)")
    x.add_argument("--passes", type=_comma_list(str, PASSES), default=default.passes,
                   help="fwd,bwd (bwd times out.backward(grad) only; forward runs outside the timed region)")
    x.add_argument("--compare", type=_comma_list(str, COMPARE_KERNELS), default=None, nargs="?",
                   const=FBGEMM_CPU_COMPARE,
                   help="comma-separated, of: fbgemm (FBGEMM's TBE), torchrec_triton (TorchRec's Triton TBE, "
                   "from --torchrec-checkout): also run them on the same batches with the same initial weights. "
                   "Without a value it is FBGEMM's flag (fbgemm-gpu >= 1.8: a CPU baseline), refused here")
    x.add_argument("--torchrec-checkout", default=None,
                   help="for --compare torchrec_triton: a directory holding torchrec/distributed/triton_tbe/*.py "
                   "(default $TORCHREC_CHECKOUT; tools/stage_torchrec_triton.sh makes .stage/torchrec)")
    x.add_argument("--check", action="store_true",
                   help="compare outputs (and weights after one backward) of every compared kernel against "
                   "ours on the first batch")
    x.add_argument("--suite", default=None, help="shape suite: a name in configs/suites/ or a YAML path")
    x.add_argument("--only", type=_comma_list(str), default=None, help="run only these suite shapes (names)")
    x.add_argument("--json", default=None, help="write results here (rewritten after every shape)")
    x.add_argument("--plot", default=None, help="PNG: GB/s per shape for both kernels, and the speed-up")
    x.add_argument("--kernel-config", default=None, help="TritonTBE kernel_config: a name (sm90) or YAML path")
    x.add_argument("--fused-bounds-check", action="store_true", help="TritonTBE fused_bounds_check=True")
    x.add_argument("--hoist-transpose", action="store_true", help="TritonTBE hoist_transpose=True")
    x.add_argument("--verbose", action="store_true", help="keep FBGEMM's INFO logging")


def build_parser() -> argparse.ArgumentParser:
    default = BenchCase()
    # allow_abbrev=False: FBGEMM's click takes no abbreviated option (``--alpha`` is not ``--alpha-list``).
    p = argparse.ArgumentParser(
        prog="torchrec-triton-tbe-bench",
        allow_abbrev=False,
        description="A/B benchmark of TritonTBE vs FBGEMM's TBE, in the format of FBGEMM's "
        "split_table_batched_embeddings_benchmark.py device (same options and defaults).",
    )
    g = p.add_argument_group("FBGEMM `device` options (same names and defaults)")
    g.add_argument("--alpha", type=float, default=default.alpha,
                   help="<= 1.0: uniform ids; > 1.0: Zipf (FBGEMM suggests 1.15 training, 1.09 inference)")
    g.add_argument("--batch-size", type=int, default=default.batch_size)
    g.add_argument("--weights-precision", choices=PRECISIONS, default=default.weights_precision)
    g.add_argument("--stoc", action="store_true", default=default.stoc, help="stochastic rounding")
    g.add_argument("--iters", type=int, default=default.iters)
    g.add_argument("--warmup-runs", type=int, default=default.warmup_runs,
                   help="warm-up runs before timing (plus one, as FBGEMM's benchmark_requests)")
    g.add_argument("--reuse", type=float, default=default.reuse, help="inter-batch index reuse rate")
    g.add_argument("--flush-gpu-cache-size-mb", type=int, default=default.flush_gpu_cache_size_mb)
    g.add_argument("--bag-size", type=int, default=default.bag_size)
    g.add_argument("--embedding-dim", type=int, default=default.embedding_dim)
    g.add_argument("--mixed", action="store_true", default=default.mixed,
                   help="per-table D = round_up(randint(0.5D, 1.5D), 4), NumPy seed 42")
    g.add_argument("--num-embeddings", type=int, default=default.num_embeddings)
    g.add_argument("--num-tables", type=int, default=default.num_tables)
    g.add_argument("--row-wise", action=argparse.BooleanOptionalAction, default=None,
                   help="FBGEMM compatibility: --row-wise = --optimizer exact_rowwise_adagrad (the default); "
                   "--no-row-wise = --optimizer exact_adagrad")
    g.add_argument("--weighted", action="store_true", default=default.weighted)
    g.add_argument("--pooling", type=str.lower, choices=POOLINGS, default=default.pooling,
                   help="none: sequence lookups (one output row per id; every table one D)")
    g.add_argument("--bounds-check-mode", type=int, choices=BOUNDS_CHECK_MODES, default=default.bounds_check_mode,
                   metavar="{0..6}", help="FBGEMM's BoundsCheckMode: 0 FATAL, 1 WARNING, 2 IGNORE, 3 NONE (default); "
                   "4-6 V2_IGNORE, V2_WARNING, V2_FATAL (run as IGNORE, WARNING, FATAL, as FBGEMM's TBE does)")
    g.add_argument("--output-dtype", choices=PRECISIONS, default=default.output_dtype)
    g.add_argument("--indices-dtype", type=int, choices=(32, 64), default=default.indices_dtype,
                   help="32 casts indices and offsets inside the timed call, as FBGEMM's benchmark does")
    g.add_argument("--num-requests", type=int, default=default.num_requests,
                   help="batches to generate and rotate through (-1: iters)")

    f = p.add_argument_group("FBGEMM `device` options for what TritonTBE does not have: accepted at FBGEMM's "
                             "default only")
    for name, (value, why) in {**FBGEMM_ONLY_OPTIONS, **FBGEMM_CACHE_OPTIONS}.items():
        flag = _flag(name)
        if isinstance(value, bool):
            f.add_argument(flag, action="store_true", help=why)
        else:
            f.add_argument(flag, default=value, type=str.lower if name in _LOWERED else None,
                           help=f"{why} (FBGEMM's default: {value})")

    add_ab_options(p, default)
    x = p.add_argument_group("Per-table lists (FBGEMM's device-with-spec; --alpha-list and --batch-size-list ours)")
    x.add_argument("--embedding-dim-list", type=_comma_list(int), default=None,
                   help="explicit per-table D, comma-separated (as FBGEMM's device-with-spec)")
    x.add_argument("--num-embeddings-list", type=_comma_list(int), default=None, help="per-table rows (E)")
    x.add_argument("--bag-size-list", type=_comma_list(int), default=None, help="per-table bag sizes (L)")
    x.add_argument("--bag-size-sigma-list", type=_comma_list(int, none_ok=True), default=None,
                   help="per-table standard deviations of the bag size (FBGEMM's device-with-spec): sizes drawn "
                   "once per sample from int(normal(L_t, sigma_t)), negatives 0; 'None' (FBGEMM's default): fixed")
    x.add_argument("--alpha-list", type=_comma_list(float, none_ok=True), default=None,
                   help="per-table Zipf alphas ('None': --alpha for every table)")
    x.add_argument("--batch-size-list", type=_comma_list(int), default=None,
                   help="per-table batch sizes: a variable batch per feature (VBE), as FBGEMM's vbe command")
    # Not an option: the command word that may lead the command line (cli.py), `device` unless named.
    p.set_defaults(command=default.command)
    return p


def _flag(name: str) -> str:
    """The option spelling of a dest name, as FBGEMM spells it."""
    return "--" + (name if name == "requests_data_file" else name.replace("_", "-"))


def check_fbgemm_only_options(args: argparse.Namespace,
                              options: Mapping[str, tuple[Any, str]] = FBGEMM_ONLY_OPTIONS) -> Optional[str]:
    """Why the FBGEMM-only options given cannot run here (None: they are FBGEMM's defaults).
    ``options``: name -> (FBGEMM's default, why refused)."""
    for name, (default, why) in options.items():
        value = getattr(args, name)
        if value != default:
            return f"{_flag(name)} {value}: not supported: {why}"
    return None


def device_with_spec_options(args: argparse.Namespace, given: Mapping[str, Any]) -> dict[str, Any]:
    """The explicit options of a ``device-with-spec`` command line, completed as FBGEMM's command reads
    them: its list defaults, T = len(--embedding-dim-list). Options it does not have that would change
    its batches (NOT_IN_DEVICE_WITH_SPEC) are refused, as FBGEMM's click refuses them; ours that only add
    to it (--optimizer, --indices-dtype, --alpha-list, --compare, ...) are kept."""
    if args.suite:
        raise ValueError("device-with-spec with --suite: a suite's shapes say their own command (`command:`)")
    foreign = [f for f in NOT_IN_DEVICE_WITH_SPEC if f in given]
    if foreign:
        flags = ", ".join("--" + f.replace("_", "-") for f in foreign)
        raise ValueError(f"{flags}: not options of FBGEMM's device-with-spec (its tables are --embedding-dim-list, "
                         "--num-embeddings-list and --bag-size-list, T their length; one batch per iteration, "
                         "one batch size)")
    foreign = [_flag(f) for f in DEVICE_ONLY_OPTIONS if f in given]
    if foreign:
        raise ValueError(f"{', '.join(foreign)}: not options of FBGEMM's device-with-spec (options of its device "
                         "command)")
    out = {**DEVICE_WITH_SPEC_LISTS, **given, "command": "device-with-spec"}
    out["num_tables"] = T = len(out["embedding_dim_list"])
    alphas = out.get("alpha_list")
    if alphas is not None and len(alphas) == 1:
        out["alpha_list"] = alphas * T  # one value: every table (as FBGEMM's vbe reads its --alpha-list)
    args.command = "device-with-spec"
    return out


def explicit_options(parser: argparse.ArgumentParser, argv: Sequence[str]) -> dict[str, Any]:
    """The options the command line actually sets (to let them override suite entries)."""
    quiet = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for action in parser._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            kwargs = dict(dest=action.dest, default=argparse.SUPPRESS)
            if isinstance(action, argparse._StoreTrueAction):
                quiet.add_argument(*action.option_strings, action="store_true", **kwargs)
            elif isinstance(action, argparse.BooleanOptionalAction):
                quiet.add_argument(*action.option_strings, action=argparse.BooleanOptionalAction, **kwargs)
            else:
                quiet.add_argument(*action.option_strings, type=action.type, nargs=action.nargs, const=action.const,
                                   **kwargs)
    given, _ = quiet.parse_known_args(list(argv))
    return vars(given)


def case_from_mapping(values: Mapping[str, Any], name: str) -> BenchCase:
    """A BenchCase from option values (CLI namespace, suite entry); unknown keys are an error."""
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        field = key.replace("-", "_")
        if field not in CASE_FIELDS:
            raise ValueError(f"{name}: unknown option {key!r}; known: {', '.join(CASE_FIELDS)}")
        if field in ("optimizers", "passes"):
            value = tuple(value.split(",")) if isinstance(value, str) else tuple(value)
        elif field in LIST_KINDS and value == "None":  # FBGEMM's spelling, as on the command line
            value = None
        elif field in LIST_KINDS and value is not None:
            kind = LIST_KINDS[field]
            value = tuple(kind(float(d)) if kind is int else kind(d)
                          for d in (value.split(",") if isinstance(value, str) else value))
        elif field in ("num_embeddings", "batch_size", "num_tables", "embedding_dim", "bag_size") and \
                isinstance(value, float):
            if not value.is_integer():  # YAML reads 1e6 as a float
                raise ValueError(f"{name}: {key} must be an integer, got {value}")
            value = int(value)
        kwargs[field] = value
    if kwargs.get("command") == "device-with-spec" and "num_tables" not in kwargs and \
            kwargs.get("embedding_dim_list") is not None:
        kwargs["num_tables"] = len(kwargs["embedding_dim_list"])  # FBGEMM's: T = len(embedding-dim-list)
    return BenchCase(name=name, **kwargs)


def resolve_optimizers(args: argparse.Namespace, given: Mapping[str, Any]) -> Optional[tuple[str, ...]]:
    """FBGEMM's --row-wise/--no-row-wise mapped onto --optimizer; None when neither says anything."""
    row_wise = given.get("row_wise")
    if row_wise is None:
        return tuple(given["optimizers"]) if "optimizers" in given else None
    meant = ("exact_rowwise_adagrad",) if row_wise else ("exact_adagrad",)
    if "optimizers" in given and tuple(given["optimizers"]) != meant:
        flag = "--row-wise" if row_wise else "--no-row-wise"
        raise SystemExit(f"{flag} means --optimizer {meant[0]}; give one or the other")
    return meant


@dataclasses.dataclass(frozen=True)
class SuiteShape:
    case: BenchCase
    baseline_ms: Optional[dict[str, float]]  # FBGEMM CUDA reference from the suite file, for the record
    note: str = ""


def suite_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    from torchrec_triton_tbe.config import config_dir

    path = config_dir() / "suites" / f"{name_or_path}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no suite named {name_or_path!r} (looked for {path})")
    return path


class UnknownShapes(ValueError):
    """``load_suite``'s ``only`` names shapes the suite does not have."""


def load_suite(name_or_path: str, overrides: Mapping[str, Any],
               only: Optional[Sequence[str]] = None) -> tuple[dict[str, Any], list[SuiteShape]]:
    """(suite header, shapes). ``overrides`` are the explicit command-line options (win over the file).
    ``only``: these shapes alone, in the file's order (``UnknownShapes`` for a name the file lacks); the others
    are not built, so an override that does not fit them (``--num-tables`` against their lists) is no error."""
    path = suite_path(name_or_path)
    with open(path) as fh:
        doc = yaml.safe_load(fh)
    unknown = set(doc) - {"name", "description", "defaults", "optimizers", "passes", "shapes"}
    if unknown:
        raise ValueError(f"{path}: unknown top-level keys {sorted(unknown)}")
    base = dict(doc.get("defaults") or {})
    for key in ("optimizers", "passes"):
        if key in doc:
            base[key] = doc[key]
    shapes = []
    names = set()
    for entry in doc.get("shapes") or []:
        entry = dict(entry)
        name = entry.pop("name", None)
        if not name or name in names:
            raise ValueError(f"{path}: every shape needs a unique name (got {name!r})")
        names.add(name)
        baseline = entry.pop("baseline_ms", None)
        note = entry.pop("note", "")
        if only is not None and name not in only:
            continue
        values = {**base, **entry, **overrides}
        shapes.append(SuiteShape(case_from_mapping(values, name), baseline, note))
    unknown = [n for n in (only or ()) if n not in names]
    if unknown:
        raise UnknownShapes(f"--only: no shapes named {unknown} in {path}; known: {sorted(names)}")
    header = {"name": doc.get("name", path.stem), "path": str(path), "description": doc.get("description", "")}
    return header, shapes
