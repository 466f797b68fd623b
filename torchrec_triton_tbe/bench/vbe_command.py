"""FBGEMM's ``vbe`` benchmark command (variable batch size per feature), as this CLI runs it.

``torchrec-triton-tbe-bench vbe --batch-size-list ... --num-tables T ...`` takes that command's own
options (``split_table_batched_embeddings_benchmark.py vbe``: its per-table lists and
``--num-tables``, all required as there, plus the ``--bench-*`` and ``--emb-*`` families of
FBGEMM's ``TBEBenchmarkingConfigLoader`` and ``EmbeddingOpsCommonConfigLoader``, same names and
defaults) and reads them as FBGEMM does: ``--alpha-list None`` is uniform ids for every table and one
value applies to every table; ``--bag-size-sigma-list None`` draws every bag size with a sigma of 0
(the same sizes, through the generator's variable-size path, whose draws differ); row-wise Adagrad,
learning rate and eps 0.1. What FBGEMM's command itself refuses (``--bench-num-requests`` other than
the iterations, a GPU cache flush, host-mapped UVM) and what TritonTBE does not have (SSD tables, other
embedding locations, merged outputs of several ops, traces) is refused with the reason; what FBGEMM's
command takes and ignores (``--emb-location``; ``--print-kernel-summary`` and ``--upload-perf-data``
without a trace) is accepted with a note. The A/B options (``--compare``, ``--check``, ``--optimizer``,
``--json``, ...) are this CLI's, as for ``device``.
Lines: FBGEMM's two, ``T: .., Bs: [..], Ds: [..], Ls: [..], Es: [..], alphas: [..]`` and ``fwd: Xus,
bwd: Yus``, per kernel (and optimizer), from median times, as FBGEMM's ``benchmark_vbe`` reports them
(fbgemm-gpu 1.6.0 prints no ``alphas:``). The loop is not FBGEMM's: that one times forward and backward
in one loop over the batches (the backward's gradient a fresh ``rand_like`` each time) after
``--bench-warmup-iterations`` forward-backward runs on the first batch; here, as for ``device``, the
forward and the backward (its forward outside the timed region, one fixed ``randn`` gradient) are timed
in two loops, each after that many warm-up runs plus one, walking the batches (bench/timing.py says why).
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

from torchrec_triton_tbe.bench.case import (
    PRECISIONS,
    BenchCase,
    _comma_list,
    _flag,
    add_ab_options,
    check_fbgemm_only_options,
)

# FBGEMM's EmbeddingLocation.str_values() (fbgemm-gpu 1.9); only device memory is benchmarked here.
_LOCATIONS = ("device", "managed", "managed_caching", "host", "mtia")
# FBGEMM's vbe options that name what is not benchmarked here: name -> (FBGEMM's default, why refused).
VBE_REFUSED = {
    "ssd": (False, "no SSD tables here"),
    "merge_output": (False, "merged outputs of several TBE ops are not benchmarked here (TritonTBE takes "
                     "vbe_output: tests/test_vbe.py)"),
    "bench_flush_gpu_cache_size": (0, "FBGEMM's vbe command refuses it too"),
    "bench_export_trace": (False, "trace export is not implemented here"),
    "emb_uvm_host_mapped": (False, "FBGEMM's vbe command refuses it too"),
}
# Options FBGEMM's vbe command takes and does not read (fbgemm-gpu 1.6.0 to its main branch): its tables
# are in device memory whatever --emb-location says, and the other two act only on the trace that
# --bench-export-trace (refused above) would take. Accepted at any value, as there, with a note saying so.
VBE_IGNORED = {
    "emb_location": ("device", "FBGEMM's vbe command ignores it: its tables are in device memory (as here)"),
    "print_kernel_summary": (False, "FBGEMM's vbe command reads it only with --bench-export-trace"),
    "upload_perf_data": (False, "FBGEMM's vbe command reads it only with --bench-export-trace"),
}


def build_vbe_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchrec-triton-tbe-bench vbe",
        allow_abbrev=False,  # as FBGEMM's click: `--alpha` is not `--alpha-list`
        description="A/B benchmark of TritonTBE vs FBGEMM's TBE with a variable batch per feature, in the "
        "format of FBGEMM's split_table_batched_embeddings_benchmark.py vbe (same options and defaults).",
    )
    g = p.add_argument_group("FBGEMM `vbe` options (same names and defaults)")
    for name, kind in (("batch-size", int), ("embedding-dim", int), ("bag-size", int), ("num-embeddings", int)):
        g.add_argument(f"--{name}-list", type=_comma_list(kind), required=True)
    g.add_argument("--bag-size-sigma-list", type=_comma_list(int, none_ok=True), default=None)
    g.add_argument("--alpha-list", default="None", help="'None': uniform ids; one value: every table; or one per table")
    g.add_argument("--num-tables", type=int, required=True)
    g.add_argument("--weighted", action="store_true")
    g.add_argument("--print-kernel-summary", action="store_true")
    g.add_argument("--ssd", action="store_true")
    g.add_argument("--ssd-prefix", default="/tmp/ssd_benchmark")
    g.add_argument("--merge-output", action="store_true")
    g.add_argument("--merge-output-num-ranks", type=int, default=8)
    g.add_argument("--merge-output-num-tbe-ops", type=int, default=2)
    b = p.add_argument_group("FBGEMM's TBEBenchmarkingConfigLoader options")
    b.add_argument("--bench-iterations", type=int, default=100)
    b.add_argument("--bench-num-requests", type=int, default=-1)
    b.add_argument("--bench-warmup-iterations", type=int, default=0)
    b.add_argument("--bench-flush-gpu-cache-size", type=int, default=0)
    b.add_argument("--bench-export-trace", action="store_true")
    b.add_argument("--bench-trace-url", default="{emb_op_type}_tbe_{phase}_trace_{ospid}.json")
    b.add_argument("--upload-perf-data", action="store_true")
    e = p.add_argument_group("FBGEMM's EmbeddingOpsCommonConfigLoader options")
    e.add_argument("--emb-weights-dtype", type=str.lower, choices=PRECISIONS, default="fp32")
    e.add_argument("--emb-cache-dtype", default=None, help="no embedding cache here: accepted at any value")
    e.add_argument("--emb-output-dtype", type=str.lower, choices=PRECISIONS, default="fp32")
    e.add_argument("--emb-stochastic-rounding", action="store_true")
    e.add_argument("--emb-pooling-mode", type=str.lower, choices=("sum", "mean", "none"), default="sum")
    e.add_argument("--emb-uvm-host-mapped", action="store_true")
    e.add_argument("--emb-location", type=str.lower, choices=_LOCATIONS, default="device")
    e.add_argument("--emb-bounds-check", type=int, default=1, help="FBGEMM's BoundsCheckMode (default 1, WARNING)")
    add_ab_options(p, BenchCase())
    x = p.add_argument_group("Options of this CLI's `device` it keeps")
    x.add_argument("--indices-dtype", type=int, choices=(32, 64), default=64)
    return p


def refused(args: argparse.Namespace) -> Optional[str]:
    """Why a vbe command line cannot run here (None: it can)."""
    why = check_fbgemm_only_options(args, VBE_REFUSED)
    if why is not None:
        return why
    if args.bench_num_requests not in (-1, args.bench_iterations):
        return "--bench-num-requests: FBGEMM's vbe command refuses it (one batch per iteration)"
    if args.suite:
        return "vbe with --suite: a suite's shapes say their own command (`command:`)"
    return None


def ignored(args: argparse.Namespace) -> list[str]:
    """Notes for the options given that FBGEMM's vbe command takes and ignores (VBE_IGNORED)."""
    return [f"note: {_flag(name)} {getattr(args, name)}: {why}"
            for name, (default, why) in VBE_IGNORED.items() if getattr(args, name) != default]


def _alphas(text: str, T: int) -> tuple[float, ...]:
    if text in ("None", ""):
        return (0.0,) * T  # FBGEMM: uniform ids
    if "," not in text:
        return (float(text),) * T
    return tuple(float(a) for a in text.split(","))


def vbe_case(args: argparse.Namespace) -> BenchCase:
    """The BenchCase of a vbe command line (BenchCase checks the lists' lengths, as FBGEMM asserts them)."""
    T = args.num_tables
    values: dict[str, Any] = dict(
        command="vbe",
        num_tables=T,
        batch_size=max(args.batch_size_list),
        batch_size_list=args.batch_size_list,
        embedding_dim_list=args.embedding_dim_list,
        bag_size_list=args.bag_size_list,
        bag_size_sigma_list=args.bag_size_sigma_list or (0,) * T,
        num_embeddings_list=args.num_embeddings_list,
        alpha_list=_alphas(args.alpha_list, T),
        weighted=args.weighted,
        iters=args.bench_iterations,
        warmup_runs=args.bench_warmup_iterations,
        weights_precision=args.emb_weights_dtype,
        output_dtype=args.emb_output_dtype,
        stoc=args.emb_stochastic_rounding,
        pooling=args.emb_pooling_mode,
        bounds_check_mode=args.emb_bounds_check,
        indices_dtype=args.indices_dtype,
        optimizers=args.optimizers,
        passes=args.passes,
    )
    return BenchCase(name="cli", **values)


def vbe_lines(prefix: str, case: BenchCase, Ds, fwd_us: Optional[float], bwd_us: Optional[float]) -> list[str]:
    """FBGEMM's vbe lines (its one logging record holds both), after ``prefix`` (kernel, optimizer)."""
    T = case.num_tables
    head = (f"T: {T}, Bs: {list(case.batch_size_list)}, Ds: {list(Ds)}, Ls: {list(case.bag_size_list)}, "
            f"Es: {list(case.num_embeddings_list)}, alphas: {list(case.alpha_list)}")
    times = ", ".join(f"{name}: {us:.0f}us" for name, us in (("fwd", fwd_us), ("bwd", bwd_us)) if us is not None)
    return [f"{prefix} {head}", f"{prefix} {times}"]
