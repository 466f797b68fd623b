"""Where a cold first step's compile time goes: the kernel specializations one training step of a suite
shape launches, and how long Triton takes to compile them for a GPU target, one after another and in
parallel worker processes. Runs on a CPU (no GPU needed: the module is driven on CPU tensors with
launches recorded, as torchrec_triton_tbe.aot does, and the specializations are lowered to cubin).

    TRITON_INTERPRET=0 python tools/first_step.py --shape prod_t40_b16k [--optimizer exact_rowwise_adagrad]
        [--target 90] [--workers 1,2] [--rows-scale 0.01] [--json out.json]
    TRITON_CACHE_DIR=$(mktemp -d) python tools/first_step.py --cold-step plain|precompiled [--workers 16] ...
        (on a GPU: one process's first step, plain or after TritonTBE.precompile)

Each compile runs against an empty Triton cache (a fresh TRITON_CACHE_DIR per pass), so the times are
what a first step pays for compilation alone; loading the cubins and the step's own work come on top.
This machine's cores, not the GPU host's, set the numbers: run it there too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _shape_step(shape: str, suite: str, optimizer: str, rows_scale: float, device) -> tuple:
    """(case, TritonTBE constructor arguments and keywords, indices, offsets, per-sample weights) of the
    suite shape's first batch on ``device``, its tables' rows scaled (at least a bag's length of rows:
    FBGEMM's Zipf generator needs them)."""
    import dataclasses

    import numpy as np
    import torch

    from torchrec_triton_tbe._fbgemm import EmbOptimType, SparseType
    from torchrec_triton_tbe.bench.batches import make_workload
    from torchrec_triton_tbe.bench.case import load_suite

    _, shapes = load_suite(suite, {})
    found = [sh.case for sh in shapes if sh.case.name == shape]
    if not found:
        raise SystemExit(f"--shape {shape!r}: not in suite {suite!r}")
    case = found[0]
    np.random.seed(42)  # the mixed dims are drawn from it (bench/case.py)
    dims = case.table_dims()
    rows = [max(1, case.bag_size_at(k), round(case.num_embeddings_at(k) * rows_scale)) for k in range(case.num_tables)]
    if rows_scale != 1.0:
        case = dataclasses.replace(case, num_embeddings_list=tuple(rows), num_embeddings=max(rows))
    request = make_workload(case, device).requests[0]
    idx_dtype = torch.int32 if case.indices_dtype == 32 else torch.int64
    specs = list(zip(rows, dims))
    kwargs = dict(optimizer=EmbOptimType[optimizer.upper()], device=device, embedding_table_index_type=idx_dtype,
                  weights_precision=SparseType[case.weights_precision.upper()])
    return case, specs, kwargs, request.indices.to(idx_dtype), request.offsets.to(idx_dtype), request.per_sample_weights


def _record(shape: str, suite: str, optimizer: str, rows_scale: float, target: int) -> tuple[list[dict], dict]:
    """(the step's specializations as plain dicts, facts about the step)."""
    import torch

    from torchrec_triton_tbe import aot
    from torchrec_triton_tbe.module import TritonTBE

    case, specs, kwargs, indices, offsets, psw = _shape_step(shape, suite, optimizer, rows_scale, torch.device("cpu"))
    dims = [d for _, d in specs]
    t0 = time.time()
    # Recording lets the module live on CPU tensors with compiled (not interpreted) kernels; whatever
    # its construction launches counts too.
    with aot.recording() as seen:
        module = TritonTBE(specs, kernel_config=f"sm{target}", **kwargs)
        out = module(indices, offsets, psw)
        out.backward(torch.ones_like(out))
    host_s = time.time() - t0
    specs = [{"module": fn.fn.__module__, "kernel": fn.fn.__name__, "signature": sig, "constexprs": consts,
              "divisible": list(divisible), "num_warps": warps, "target": target}
             for fn, sig, consts, divisible, warps in seen.values()]
    facts = {"shape": shape, "tables": case.num_tables, "batch_size": case.batch_size, "lookups": int(indices.numel()),
             "distinct_dims": sorted(set(dims)), "rows_scale": rows_scale, "optimizer": optimizer,
             "weights_precision": case.weights_precision, "recorded_host_seconds": round(host_s, 2)}
    return specs, facts


def _compile(spec: dict) -> tuple[str, float]:
    """One specialization to cubin, in this process (a pool worker or the main one)."""
    import importlib

    from torchrec_triton_tbe.aot import lower

    fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    t0 = time.time()
    lower(fn, spec["signature"], spec["constexprs"], spec["divisible"], spec["num_warps"], spec["target"])
    return spec["kernel"], time.time() - t0


def _worker_init(cache_dir: str) -> None:
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    os.environ["TRITON_INTERPRET"] = "0"
    import torchrec_triton_tbe  # noqa: F401  (the kernels' package, as the main process imports it)


def _timed_pass(specs: list[dict], workers: int, pool_kind: str = "process") -> dict:
    with tempfile.TemporaryDirectory(prefix="first_step_cache_") as cache:
        t0 = time.time()
        if workers == 1:
            _worker_init(cache)
            per = [_compile(s) for s in specs]
        elif pool_kind == "thread":  # what TritonTBE.precompile uses
            _worker_init(cache)
            with ThreadPoolExecutor(workers) as pool:
                per = list(pool.map(_compile, specs))
        else:
            with ProcessPoolExecutor(workers, initializer=_worker_init, initargs=(cache,)) as pool:
                per = list(pool.map(_compile, specs))
        wall = time.time() - t0
    by_kernel: dict = {}
    for kernel, seconds in per:
        entry = by_kernel.setdefault(kernel, [0, 0.0])
        entry[0] += 1
        entry[1] += seconds
    return {"workers": workers, "pool": pool_kind if workers > 1 else "none", "wall_seconds": round(wall, 2), "sum_of_compiles_seconds": round(sum(s for _, s in per), 2),
            "by_kernel": {k: {"specializations": n, "seconds": round(s, 2)} for k, (n, s) in sorted(by_kernel.items())}}


def _cold_step(shape: str, suite: str, optimizer: str, rows_scale: float, mode: str, workers) -> dict:
    """On a GPU, in this fresh process (run it with an empty TRITON_CACHE_DIR): build the shape's module,
    then time its first training step, with ``mode`` "precompiled" preceded by TritonTBE.precompile."""
    import dataclasses

    import torch

    from torchrec_triton_tbe.module import TritonTBE
    from torchrec_triton_tbe.ops import launch as launch_ops

    _, specs, kwargs, indices, offsets, psw = _shape_step(shape, suite, optimizer, rows_scale, torch.device("cuda"))
    torch.manual_seed(0)
    module = TritonTBE(specs, **kwargs)
    module.init_embedding_weights_uniform(-0.1, 0.1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    report = module.precompile(indices, offsets, psw, workers=workers) if mode == "precompiled" else None
    t1 = time.perf_counter()
    cached = len(launch_ops._COMPILED)
    out = module(indices, offsets, psw)
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    weights_sum = float(module.weights.double().sum())
    # The same step again: what is left of step 1 once nothing is first (its compile, its launchers and
    # module loads, PyTorch's own first-use costs).
    out = module(indices, offsets, psw)
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    return {"mode": mode, "second_step_seconds": round(t3 - t2, 3), "shape": shape, "rows_scale": rows_scale, "lookups": int(indices.numel()),
            "precompile_seconds": round(t1 - t0, 3), "step_seconds": round(t2 - t1, 3),
            "first_step_total_seconds": round(t2 - t0, 3),
            "compiled_during_step": len(launch_ops._COMPILED) - cached,
            "precompile": None if report is None else dataclasses.asdict(report) | {"kernels": len(report.kernels)},
            "weights_sum": weights_sum, "step": int(module.iter) - 1}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="prod_t40_b16k")
    ap.add_argument("--suite", default="h200")
    ap.add_argument("--optimizer", default="exact_rowwise_adagrad")
    ap.add_argument("--target", type=int, default=90, help="compute capability to compile for")
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts, one timed pass each")
    ap.add_argument("--pool", choices=("process", "thread"), default="process",
                    help="workers are processes, or threads of this process (as TritonTBE.precompile's)")
    ap.add_argument("--rows-scale", type=float, default=1.0, help="multiply the tables' rows (memory only: the "
                    "specializations do not depend on row counts beyond their int32/int64 choice)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--cold-step", choices=("plain", "precompiled"), default=None,
                    help="on a GPU instead: time this process's first training step of the shape, plain or after "
                         "TritonTBE.precompile (run each in a fresh process with an empty TRITON_CACHE_DIR)")
    args = ap.parse_args(argv)
    if args.cold_step:
        workers = int(args.workers.split(",")[-1])
        result = _cold_step(args.shape, args.suite, args.optimizer, args.rows_scale, args.cold_step, workers)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=1)
        print(json.dumps(result))
        return 0
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("first_step: run with TRITON_INTERPRET=0 (kernels are compiled, not interpreted)", file=sys.stderr)
        return 2
    os.environ["TRITON_INTERPRET"] = "0"
    specs, facts = _record(args.shape, args.suite, args.optimizer, args.rows_scale, args.target)
    passes = [_timed_pass(specs, int(w), args.pool) for w in args.workers.split(",")]
    import triton

    report = {"step": facts, "target": f"sm_{args.target}", "triton": triton.__version__, "cpus": os.cpu_count(),
              "specializations": len(specs), "passes": passes}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    print(f"{facts['shape']}: {facts['tables']} tables, B={facts['batch_size']}, {facts['lookups']:,} lookups, "
          f"{facts['optimizer']}: {len(specs)} specializations for sm_{args.target} (Triton {triton.__version__}, "
          f"{os.cpu_count()} CPUs)")
    for p in passes:
        print(f"  {p['workers']} worker(s) ({p['pool']}): {p['wall_seconds']:.1f} s wall, {p['sum_of_compiles_seconds']:.1f} s of compiles")
    for kernel, v in passes[0]["by_kernel"].items():
        print(f"    {kernel:36s} {v['specializations']:3d} x  {v['seconds']:6.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
