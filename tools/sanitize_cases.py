"""A representative run of every kernel specialization, small enough for compute-sanitizer.

Run under each of its tools by tests/gpu/test_gpu_sanitizer.py (memcheck, racecheck, synccheck,
initcheck); alone it is a quick smoke run that prints one line per case. It covers: SUM, MEAN and
sequence (NONE) pooling; weighted, with and without a per-sample-weight gradient; int32 and int64 ids;
fp32, fp16 and bf16 weights; every optimizer variant tests/gpu/test_gpu_optimizers.py checks; the
short path alone, short + long split-K, and the fused and split long paths; the backward replayed from
CUDA graphs; the D-bucket forward on side streams, the backward's buckets on the device config's
streams, and a bucket's short kernel and long path on two (split paths), eager and replayed; the fused
bounds check fed bad ids (WARNING and IGNORE), FATAL rejecting them, and the separate check; the
hoisted transpose; a variable batch (VBE); tables of 0 rows whose (repaired) lookups read the zero row past
the tables.

    python tools/sanitize_cases.py [--list] [--only NAME,...]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Callable, Optional

import torch

from torchrec_triton_tbe._fbgemm import (
    BoundsCheckMode,
    EmbOptimType,
    PoolingMode,
    SparseType,
    UserEnabledConfigDefinition,
    WeightDecayMode,
)
from torchrec_triton_tbe.config import load_config
from torchrec_triton_tbe.module import TritonTBE

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: the interpreter (CI's smoke run)
# Widths in the 32, 64, 128 and 256 buckets, one not a power of two, one table shared by two features.
SPECS = [(3_000, 128), (500, 64), (400, 72), (40, 256), (200, 32)]
FTM = [0, 1, 1, 2, 3, 4]
B, L = 64, 8

RWA = EmbOptimType.EXACT_ROWWISE_ADAGRAD
OPTIMIZERS = {
    "sgd": (EmbOptimType.EXACT_SGD, {}),
    "sgd-clipped": (EmbOptimType.EXACT_SGD, dict(gradient_clipping=True, max_gradient=0.05)),
    "adagrad": (EmbOptimType.EXACT_ADAGRAD, {}),
    "rowwise": (RWA, {}),
    "rowwise-l2": (RWA, dict(weight_decay=0.05, weight_decay_mode=WeightDecayMode.L2)),
    "rowwise-decouple": (RWA, dict(weight_decay=0.05, weight_decay_mode=WeightDecayMode.DECOUPLE)),
    "rowwise-max-norm": (RWA, dict(max_norm=0.8)),
    "adam": (EmbOptimType.ADAM, dict(weight_decay=0.01)),
    "adam-rowwise-bias": (EmbOptimType.ADAM, dict(
        extra_optimizer_config=UserEnabledConfigDefinition(use_rowwise_bias_correction=True))),
    "partial-rowwise-adam": (EmbOptimType.PARTIAL_ROWWISE_ADAM, dict(weight_decay=0.01)),
    "partial-rowwise-adam-bf16": (EmbOptimType.PARTIAL_ROWWISE_ADAM, dict(
        optimizer_state_dtypes={"momentum1": SparseType.BF16, "momentum2": SparseType.BF16})),
    "lamb": (EmbOptimType.LAMB, dict(weight_decay=0.01)),
    "partial-rowwise-lamb": (EmbOptimType.PARTIAL_ROWWISE_LAMB, dict(weight_decay=0.01)),
    "lars-sgd": (EmbOptimType.LARS_SGD, dict(weight_decay=0.01, eta=0.01, momentum=0.9)),
}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    optimizer: str = "rowwise"
    pooling: PoolingMode = PoolingMode.SUM
    weights: SparseType = SparseType.FP16
    weighted: bool = False
    psw_grad: bool = False
    index_dtype: torch.dtype = torch.int64
    bounds: BoundsCheckMode = BoundsCheckMode.WARNING
    fused_bounds_check: bool = False
    hoist_transpose: bool = False
    bad_ids: bool = False
    long_path: Optional[str] = "split"  # None: the device config (all short on these small batches)
    graphs: bool = False  # replay the backward from CUDA graphs (three steps of one batch shape)
    streams: bool = False  # the D-bucket forward on side streams
    split_paths: bool = False  # each backward bucket's short kernel and long path on streams of their own
    split_heaviest: bool = False  # the heaviest backward bucket's two paths on two of four streams
    vbe: bool = False
    # A table of 0 rows first and one last, each read by a feature whose ids (all out of range there) the
    # bounds check repairs: they must read the zero row past the tables and update nothing.
    empty_tables: bool = False
    steps: int = 2

    def layout(self) -> tuple[list[tuple[int, int]], list[int]]:
        """(specs, feature_table_map) of this case's module."""
        specs, ftm = list(SPECS), list(FTM)
        if self.empty_tables:
            specs, ftm = [(0, 32)] + specs + [(0, 64)], [0] + [k + 1 for k in ftm] + [len(specs) + 1]
        if self.pooling == PoolingMode.NONE:
            specs = [(r, 64) for r, _ in specs]
        return specs, ftm


def _cases() -> list[Case]:
    cases = [Case(f"opt-{name}", optimizer=name) for name in OPTIMIZERS]
    cases += [
        Case("sum-fp32-int32", weights=SparseType.FP32, index_dtype=torch.int32),
        Case("mean-bf16-weighted", pooling=PoolingMode.MEAN, weights=SparseType.BF16, weighted=True),
        Case("sum-weighted-psw-grad", weighted=True, psw_grad=True),
        Case("mean-fp32-adagrad", pooling=PoolingMode.MEAN, weights=SparseType.FP32, optimizer="adagrad"),
        Case("sequence-fp16-int32", pooling=PoolingMode.NONE, index_dtype=torch.int32, bounds=BoundsCheckMode.FATAL),
        Case("sequence-bf16-adam", pooling=PoolingMode.NONE, weights=SparseType.BF16, optimizer="adam"),
        Case("short-only", long_path=None),
        Case("long-fused", long_path="fused"),
        Case("long-fused-fp32-lamb", long_path="fused", weights=SparseType.FP32, optimizer="lamb"),
        Case("graphs-replayed", long_path=None, graphs=True, steps=3),
        Case("graphs-replayed-long-fused", long_path="fused", graphs=True, steps=3, index_dtype=torch.int32),
        Case("bucket-streams", streams=True),
        Case("split-paths", split_paths=True),
        Case("split-paths-graphs-replayed", split_paths=True, graphs=True, steps=3),
        Case("split-heaviest", split_heaviest=True),
        Case("fused-bounds-warning-bad-ids", fused_bounds_check=True, bad_ids=True),
        Case("fused-bounds-ignore-bad-ids-int32", fused_bounds_check=True, bounds=BoundsCheckMode.IGNORE,
             bad_ids=True, index_dtype=torch.int32),
        Case("bounds-warning-bad-ids", bad_ids=True),
        Case("bounds-fatal-bad-ids", bounds=BoundsCheckMode.FATAL, bad_ids=True),
        Case("hoist", hoist_transpose=True),
        Case("hoist-fused-bounds-weighted", hoist_transpose=True, fused_bounds_check=True, weighted=True),
        Case("vbe-sum", vbe=True),
        Case("vbe-mean-weighted-fp32", vbe=True, pooling=PoolingMode.MEAN, weighted=True, weights=SparseType.FP32),
        Case("empty-tables-bounds-warning", empty_tables=True),
        Case("empty-tables-fused-ignore-weighted", empty_tables=True, fused_bounds_check=True,
             bounds=BoundsCheckMode.IGNORE, weighted=True, psw_grad=True),
        Case("empty-tables-sequence-fused-warning", empty_tables=True, fused_bounds_check=True,
             pooling=PoolingMode.NONE),
    ]
    return cases


def _batch(seed: int, case: Case, bags_per_feature: list[int]):
    """Skewed ids (u**4 * rows: long runs on the hot rows, short ones elsewhere), 0..2L-1 per bag."""
    g = torch.Generator().manual_seed(seed)
    specs, ftm = case.layout()
    lengths = [torch.randint(0, 2 * L, (n,), generator=g) for n in bags_per_feature]
    ids = []
    for (k, n) in zip(ftm, lengths):
        u = torch.rand(int(n.sum()), generator=g)
        # A table of 0 rows: every id is out of range (repaired to 0 by the bounds check).
        rows = specs[k][0] or 100
        ids.append((rows * u**4).long().clamp(max=rows - 1))
    idx = torch.cat(ids)
    offsets = torch.zeros(sum(bags_per_feature) + 1, dtype=torch.int64)
    offsets[1:] = torch.cat(lengths).cumsum(0)
    if case.bad_ids:
        pos = torch.randint(0, idx.numel(), (5,), generator=g)
        idx[pos] = torch.tensor([-7, 10**6, 3_000, -2, 123_456])
    psw = torch.rand(idx.numel(), generator=g).to(DEV) + 0.5 if case.weighted else None
    if psw is not None and case.psw_grad:
        psw.requires_grad_(True)
    return idx.to(DEV, case.index_dtype), offsets.to(DEV, case.index_dtype), psw


def _module(case: Case) -> TritonTBE:
    cfg = load_config(DEV)
    if case.long_path is not None:
        # Low threshold, small chunks: most lookups of the hot rows in long runs of several chunks.
        cfg = cfg.replace_backward(short_threshold=8, long_chunk=8, long_path=case.long_path)
    if not case.graphs:
        cfg = cfg.replace_backward(graph_max_lookups=0)
    if case.streams:
        cfg = cfg.replace_forward(bucket_streams=4, bucket_streams_min_lookups=0)
    if case.split_paths:
        # Eight streams: the four buckets' two lanes each, at any batch size.
        cfg = cfg.replace_backward(bucket_streams=8, bucket_streams_min_lookups=0, split_paths=True,
                                   split_paths_min_lookups=0, split_paths_max_lookups=0)
    if case.split_heaviest:
        # Four streams for the four buckets: the heaviest's short kernel and long path on two of them.
        cfg = cfg.replace_backward(bucket_streams=4, bucket_streams_min_lookups=0, split_heaviest=True,
                                   split_paths_min_lookups=0)
    optimizer, extra = OPTIMIZERS[case.optimizer]
    specs, ftm = case.layout()
    m = TritonTBE(specs, feature_table_map=ftm, device=DEV, optimizer=optimizer, pooling_mode=case.pooling,
                  weights_precision=case.weights, bounds_check_mode=case.bounds, learning_rate=0.05, eps=0.01,
                  fused_bounds_check=case.fused_bounds_check, hoist_transpose=case.hoist_transpose,
                  kernel_config=cfg, **extra)
    m.init_embedding_weights_uniform(-0.5, 0.5)
    return m


def _sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def run(case: Case) -> str:
    m = _module(case)
    T = len(case.layout()[1])
    bags = [B // 2 + 7 * t for t in range(T)] if case.vbe else [B] * T
    vbe = [[n] for n in bags] if case.vbe else None
    for step in range(case.steps):
        idx, off, psw = _batch(0 if case.graphs else step, case, bags)
        if case.bounds == BoundsCheckMode.FATAL and case.bad_ids:
            try:
                m(idx, off, psw)
            except ValueError:
                _sync()
                return "rejected (FATAL), nothing written"
            raise AssertionError("FATAL accepted bad ids")
        out = m(idx, off, psw, batch_size_per_feature_per_rank=vbe) if vbe else m(idx, off, psw)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(step)).to(DEV, out.dtype)
        out.backward(grad)
        if psw is not None and case.psw_grad:
            assert psw.grad is not None and bool(torch.isfinite(psw.grad).all())
    _sync()
    bad = [k for k, w in enumerate(m.split_embedding_weights()) if not bool(torch.isfinite(w).all())]
    assert not bad, f"non-finite weights in tables {bad}"
    if case.empty_tables:  # the zero row the empty tables' lookups read stays zero
        assert not bool(m.weights[m.spec.plan.empty_row_offset:].any()), "the empty tables' zero row was written"
    note = f"warnings={int(m.bounds_check_warning)}" if case.bad_ids or case.empty_tables else ""
    return f"ok {note}".strip()


def probe_graph_sort(n: int) -> str:
    """No kernel of ours: PyTorch alone, to tell initcheck's view of CUDA graphs apart from our code.
    Inside a captured graph, a fill kernel writes ``n`` int32 keys and ``torch.sort(stable=True)`` sorts
    them, as our backward sorts its keys (int32 in the graphs-replayed case). Up to PyTorch's small-sort
    size (4,096) its CUDA sort first fills the int64 permutation by copying an ``arange`` into it and
    copies the keys into the output (``fillSliceWithIndex``, ``values.copy_(self)`` in
    aten/src/ATen/native/cuda/Sort.cpp): device-to-device copy nodes whose sources only earlier nodes of
    the same graph wrote. At n = 2,816 the permutation copy is 22,528 bytes, the size of the open
    finding. A report for it here means initcheck counts such a source as unwritten; none means the
    finding needs another explanation."""
    dev = torch.device("cuda")
    out = torch.empty(n, dtype=torch.int32, device=dev)

    def body() -> None:
        keys = torch.full((n,), 7, dtype=torch.int32, device=dev)
        keys[::3] = 1
        out.copy_(torch.sort(keys, stable=True)[0])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()  # eager warm-up
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    ok = bool((out[: -(-n // 3)] == 1).all()) and bool((out[-(-n // 3):] == 7).all())
    return f"probe graph-sort n={n}: {'ok' if ok else 'WRONG'}"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    parser.add_argument("--only", default=None, help="comma-separated case names")
    parser.add_argument("--probe-graph-sort", type=int, metavar="N", default=None,
                        help="run only the PyTorch graph-sort probe with N keys (needs CUDA; see probe_graph_sort)")
    args = parser.parse_args(argv)
    if args.probe_graph_sort is not None:
        print(probe_graph_sort(args.probe_graph_sort), flush=True)
        return 0
    cases = _cases()
    if args.list:
        print("\n".join(c.name for c in cases))
        return 0
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {c.name for c in cases}
        if unknown:
            parser.error(f"unknown cases {sorted(unknown)}")
        cases = [c for c in cases if c.name in wanted]
    report: Callable[[str], None] = lambda s: print(s, flush=True)  # noqa: E731
    for case in cases:
        report(f"{case.name}: {run(case)}")
    report(f"sanitize_cases: {len(cases)} cases done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
