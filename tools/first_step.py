"""Where a cold first step's compile time goes: the kernel specializations one training step of a suite
shape launches, and how long Triton takes to compile them for a GPU target, one after another and in
parallel worker processes. Runs on a CPU (no GPU needed: the module is driven on CPU tensors with
launches recorded, as torchrec_triton_tbe.aot does, and the specializations are lowered to cubin).

    TRITON_INTERPRET=0 python tools/first_step.py --shape prod_t40_b16k [--optimizer exact_rowwise_adagrad]
        [--target 90] [--workers 1,2] [--rows-scale 0.01] [--json out.json]
    TRITON_CACHE_DIR=$(mktemp -d) python tools/first_step.py --cold-step plain|precompiled [--workers 16] ...
        (on a GPU: one process's first step, plain or after TritonTBE.precompile)
    TRITON_CACHE_DIR=$(mktemp -d) python tools/first_step.py --precompile-cpu warm-ordered|warm|ordered|plain ...
        (TritonTBE.precompile's worker processes on this CPU: with and without their warm-up and job order)
    TRITON_INTERPRET=0 python tools/first_step.py --first-job-probe 3 ...
        (a compile worker's first job, cold and warmed up)
    TRITON_INTERPRET=0 python tools/first_step.py --shape dlrm_t26_l1 --rows-scale 0.001 --dump-specs F
        (the step's specializations, nothing compiled: tools/compile_specs.py's input, e.g. for registers)

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
    rows = [max(1, case.bag_size_bound(k), round(case.num_embeddings_at(k) * rows_scale)) for k in range(case.num_tables)]
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
              "divisible": list(divisible), "num_warps": warps, "maxnreg": maxnreg, "target": target}
             for fn, sig, consts, divisible, warps, maxnreg in seen.values()]
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
    lower(fn, spec["signature"], spec["constexprs"], spec["divisible"], spec["num_warps"], spec["target"],
          spec.get("maxnreg"))
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
    if workers == 1:
        per_spec = [[k, sp["constexprs"].get("BLOCK_D"), round(t, 3)] for (k, t), sp in zip(per, specs)]
    by_kernel: dict = {}
    for kernel, seconds in per:
        entry = by_kernel.setdefault(kernel, [0, 0.0])
        entry[0] += 1
        entry[1] += seconds
    out = {"workers": workers, "pool": pool_kind if workers > 1 else "none", "wall_seconds": round(wall, 2),
           "sum_of_compiles_seconds": round(sum(s for _, s in per), 2),
           "by_kernel": {k: {"specializations": n, "seconds": round(s, 2)} for k, (n, s) in sorted(by_kernel.items())}}
    if workers == 1:
        out["per_specialization"] = per_spec  # [kernel, BLOCK_D, seconds] in recording order
    return out


def _replay(per_spec: list, workers: int, first: tuple) -> dict:
    """Makespans of the measured compile times handed out one job at a time to whichever of ``workers``
    is free (ops/precompile.Workers), in recording order and in ops/precompile.compile_order."""
    import heapq
    from types import SimpleNamespace

    from torchrec_triton_tbe.ops.precompile import compile_order

    def makespan(times):
        free = [0.0] * workers
        for t in times:
            heapq.heappush(free, heapq.heappop(free) + t)
        return round(max(free), 3)

    items = [SimpleNamespace(kernel=SimpleNamespace(fn=SimpleNamespace(__name__=k)),
                             constexprs={} if bd is None else {"BLOCK_D": bd}, seconds=t) for k, bd, t in per_spec]
    times = [t for _, _, t in per_spec]
    return {"workers": workers, "recorded_order": makespan(times),
            "compile_order": makespan([i.seconds for i in compile_order(items, first)]),
            "longest_first_known_times": makespan(sorted(times, reverse=True)),
            "bound": round(max(max(times), sum(times) / workers), 3)}


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
            "weights_sum": weights_sum,
            # The step count after the two steps: 2 where forwards advance it (TBESpec.advances_step_count:
            # as FBGEMM's, not SGD / Adagrad / LARS without stochastic rounding); the dry run adds nothing.
            "iter": int(module.iter), "iter_expected": 2 if module.spec.advances_step_count else 0}


def _precompile_cpu(shape: str, suite: str, optimizer: str, rows_scale: float, target: int, workers: int,
                    warm_up: bool, ordered: bool) -> dict:
    """TritonTBE.precompile's process path on this CPU, in this fresh process (empty TRITON_CACHE_DIR): the
    module on CPU tensors with launches recorded, the workers compiling for sm_``target``, the load phase
    a cache hit per specialization (aot.cubin_compiler). ``warm_up`` / ``ordered`` off: the workers start
    cold, the jobs go out in recording order (the behaviour before the warm-up and compile_order)."""
    import dataclasses

    import torch

    from torchrec_triton_tbe import _env, aot
    from torchrec_triton_tbe.module import TritonTBE
    from torchrec_triton_tbe.ops.precompile import precompile

    _env.RECORD_LAUNCHES = True  # compiled kernels (no interpreter) while the module lives on CPU tensors
    _, specs, kwargs, indices, offsets, psw = _shape_step(shape, suite, optimizer, rows_scale, torch.device("cpu"))
    module = TritonTBE(specs, kernel_config=f"sm{target}", **kwargs)
    if not ordered:
        cfg = module.spec.config
        module.set_kernel_config(dataclasses.replace(cfg, precompile=dataclasses.replace(cfg.precompile,
                                                                                        compile_first=())))
    job_fn = aot.cubin_job(target)
    if not warm_up:
        del job_fn.target
    report = precompile(module, indices, offsets, psw, workers=workers, compile_fn=aot.cubin_compiler(target),
                        pool="process", job_fn=job_fn)
    return {"shape": shape, "workers": workers, "warm_up": warm_up, "ordered": ordered,
            "specializations": report.specializations, "worker_seconds": round(report.worker_seconds, 3),
            "seconds": round(report.seconds, 3), "cache_hits": report.cache_hits,
            "load_compiles": report.load_compiles, "worker_errors": list(report.worker_errors)}


def _first_job_probe(specs: list[dict], target: int, reps: int, wait: float) -> dict:
    """How long a compile worker takes to answer its first job (the step's first specialization), started
    ``wait`` seconds earlier (the parent's recorded step, with a core to spare), cold or warmed up for
    the target (ops/precompile.Workers ``warm_up``); an empty Triton cache each time."""
    import importlib

    from torchrec_triton_tbe.aot import _job
    from torchrec_triton_tbe.ops.precompile import Workers

    s = specs[0]
    job = _job(getattr(importlib.import_module(s["module"]), s["kernel"]), s["signature"], s["constexprs"],
               s["divisible"], s["num_warps"], target, s.get("maxnreg"))
    seconds: dict = {"cold": [], "warm": []}
    for _ in range(reps):
        for kind, warm_up in (("cold", None), ("warm", ("cuda", target, 32))):
            with tempfile.TemporaryDirectory(prefix="first_step_cache_") as cache:
                os.environ["TRITON_CACHE_DIR"] = cache
                procs = Workers(1, warm_up=warm_up)
                try:
                    time.sleep(wait)
                    t0 = time.perf_counter()
                    errors = procs.run([job])
                    seconds[kind].append(round(time.perf_counter() - t0, 3))
                finally:
                    procs.close()
                if errors:
                    raise RuntimeError(f"first-job probe: {errors}")
    return {"kernel": s["kernel"], "wait_seconds": wait, "first_job_seconds": seconds}


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
    ap.add_argument("--precompile-cpu", choices=("warm-ordered", "warm", "ordered", "plain"), default=None,
                    help="instead: TritonTBE.precompile's process path on this CPU, once, in this process (give it an "
                         "empty TRITON_CACHE_DIR): workers warmed up and jobs in compile_order, either, or neither")
    ap.add_argument("--replay", default="", metavar="N[,N...]",
                    help="with a 1-worker pass: replay its per-specialization times on N workers, in recording order "
                         "and in the config's compile order (precompile.compile_first), after a warm-up compile")
    ap.add_argument("--first-job-probe", type=int, default=0, metavar="REPS",
                    help="instead: time a compile worker's first job, cold and warmed up, REPS times each")
    ap.add_argument("--dump-specs", default=None, metavar="FILE",
                    help="instead: write the step's specializations (tools/compile_specs.py's format) and stop")
    args = ap.parse_args(argv)
    if args.precompile_cpu:
        os.environ["TRITON_INTERPRET"] = "0"
        result = _precompile_cpu(args.shape, args.suite, args.optimizer, args.rows_scale, args.target,
                                 int(args.workers.split(",")[-1]), warm_up=args.precompile_cpu.startswith("warm"),
                                 ordered=args.precompile_cpu.endswith("ordered"))
        print(json.dumps(result))
        return 0
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
    if args.dump_specs:
        with open(args.dump_specs, "w") as fh:
            json.dump(specs, fh)
        print(f"first_step: wrote {len(specs)} specializations of {args.shape}'s step to {args.dump_specs}")
        return 0
    if args.first_job_probe:
        result = {"step": facts, **_first_job_probe(specs, args.target, args.first_job_probe, wait=2.0)}
        print(json.dumps(result))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=1)
        return 0
    if args.replay:  # the replayed workers are warm (Workers warm_up): so is this process, first
        with tempfile.TemporaryDirectory(prefix="first_step_cache_") as cache:
            _worker_init(cache)
            _compile(specs[0])
    passes = [_timed_pass(specs, int(w), args.pool) for w in args.workers.split(",")]
    replays = []
    if args.replay:
        from torchrec_triton_tbe.config import load_named

        serial = next((p for p in passes if p["workers"] == 1), None)
        if serial is None:
            raise SystemExit("--replay needs a 1-worker pass (--workers 1,...)")
        first = load_named(f"sm{args.target}").precompile.compile_first
        replays = [_replay(serial["per_specialization"], int(n), first) for n in args.replay.split(",")]
    import triton

    report = {"step": facts, "target": f"sm_{args.target}", "triton": triton.__version__, "cpus": os.cpu_count(),
              "specializations": len(specs), "passes": passes, "replays": replays}
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
    for r in replays:
        print(f"  replayed on {r['workers']} workers: recording order {r['recorded_order']:.2f} s, compile order "
              f"{r['compile_order']:.2f} s (longest first with the times known {r['longest_first_known_times']:.2f}, "
              f"bound {r['bound']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
