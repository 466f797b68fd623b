"""Where the TorchRec demo's step time goes, `fused` (FBGEMM) vs ours (on a GPU; on a CPU it runs the
interpreter against FBGEMM's CPU TBE, whose times mean nothing: that is the tool's own test).

    python tools/demo_profile.py [--steps 20] [--cprofile N] [--json out.json]   (demo options as torchrec_demo)

Builds the demo's two DistributedModelParallel models (torchrec_demo), warms both up on every batch,
times --steps rounds of one step of each, alternating which goes first (CUDA-synchronized wall clock as
the demo, and the host's issue time: until the step's last call returned, before that synchronize;
interleaved because the host's speed drifts by 10-30 % within a device session, which made two
back-to-back blocks of steps disagree), reports each model's median and the median of the
per-round ratios, then profiles three steps of each with torch.profiler and prints the GPU kernels
and host ops that take the most time. ``--cprofile N``: also N steps of each under cProfile (Python-level
host time without torch.profiler's hooks, which inflate Triton launches: docs/performance.md), the
functions with the most own time per step, and those whose own time differs most between the two;
and our modules' backward graph captures and replays after the warm-up and after the timed steps.
``--pipeline-rounds R``: then, on two more models built for TorchRec's TrainPipelineSparseDist (the
plain-loop models freed first), R interleaved rounds of ``--pipeline-block K`` (default 10)
``progress()`` calls per model with one synchronize per block, not per step: the steady-state step
time of a pipelined loop, where a step's GPU tail overlaps the next step's host work (the plain
loop's per-step synchronize and loss read keep them apart). The pipeline copies each batch to the GPU
inside ``progress()``; from pageable host memory that copy does not overlap anything.
``--pipeline-pinned``: the batches in pinned memory instead, as a DataLoader with ``pin_memory=True``
hands them over (a GPU only).
"""

import cProfile
import itertools
import json
import pstats
import statistics
import sys
import time

import torch

from torchrec_triton_tbe import torchrec_demo as demo
from torchrec_triton_tbe.plugin import TritonTBEOptions, TritonTBESharder, use_fused, use_triton_tbe


def profile_steps(dmp, opt, batches, setup, n=3):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if setup.gpu:
        torch.cuda.synchronize()
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for b in batches[:n]:
            demo._step(dmp, opt, b, setup)
    kernels, host = [], []
    for ev in prof.key_averages():
        dev = getattr(ev, "self_device_time_total", getattr(ev, "self_cuda_time_total", 0))
        if dev > 0 and ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append((ev.key[:70], ev.count // n, dev / n / 1e3))
        host.append((ev.key[:70], ev.count // n, ev.self_cpu_time_total / n / 1e3))
    kernels.sort(key=lambda r: -r[2])
    host.sort(key=lambda r: -r[2])
    return kernels, host


def cprofile_steps(dmp, opt, batches, setup, n: int) -> dict:
    """{"dir/file:line(function)": (own seconds, calls) per step} over n steps under cProfile."""
    prof = cProfile.Profile()
    prof.enable()
    for i in range(n):
        demo._step(dmp, opt, batches[i % len(batches)], setup)
    prof.disable()
    stats = pstats.Stats(prof).stats
    return {f"{'/'.join(f.split('/')[-3:])}:{line}({name})": (tt / n, nc / n)
            for (f, line, name), (_, nc, tt, _, _) in stats.items()}


def graph_counts(dmp) -> list:
    """(captures, replays) of each of our TBE modules' backward graphs (ops/graphs.py)."""
    from torchrec_triton_tbe.plugin import triton_tbe_modules

    return [(m._backward_graphs.captures, m._backward_graphs.replays) for m in triton_tbe_modules(dmp)]


def build_models(tables, setup, args, sharder, options, dense_in, pipeline: bool) -> dict:
    """{"fused": (dmp, optimizer), "triton": ...}: the demo's model on its plan, once with FBGEMM's kernel
    and once with ours (``pipeline``: the model TorchRec's train pipelines take). _plan returns {module
    path: plan}: _switch converts each (use_fused on the dict itself would leave it unchanged)."""
    plan = demo._plan(demo._model(tables, setup, dense_in, pipeline), tables, args.sharding, setup, pipeline)
    return {
        "fused": demo._dmp(tables, setup, demo._switch(plan, use_fused), sharder, dense_in, args.learning_rate,
                           pipeline),
        "triton": demo._dmp(tables, setup, demo._switch(plan, lambda p: use_triton_tbe(p, options=options)), sharder,
                            dense_in, args.learning_rate, pipeline),
    }


def pipeline_steps(tables, setup, args, sharder, options, dense_in, batches, rounds: int, block: int,
                   pinned: bool = False) -> dict:
    """Median ms per step of each model in a pipelined loop (TrainPipelineSparseDist), ``block`` steps
    per timing, ``rounds`` rounds alternating which model goes first (see the module docstring)."""
    models = build_models(tables, setup, args, sharder, options, dense_in, pipeline=True)
    pipes = {name: demo._pipeline("pipeline", dmp, opt, setup.device) for name, (dmp, opt) in models.items()}
    feed = demo._pipeline_batches(batches)
    if pinned:
        feed = [b.pin_memory() for b in feed]
    feeds = {name: itertools.cycle(feed) for name in pipes}
    for name, pipe in pipes.items():  # warm-up: every batch twice
        for _ in range(2 * len(batches)):
            pipe.progress(feeds[name])
    ms: dict = {name: [] for name in pipes}
    names = list(pipes)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            if setup.gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(block):
                pipes[name].progress(feeds[name])
            if setup.gpu:
                torch.cuda.synchronize()
            ms[name].append((time.perf_counter() - t0) * 1e3 / block)
    ratios = [f / t for f, t in zip(ms["fused"], ms["triton"])]
    return {"rounds": rounds, "block": block, "pinned": pinned, "fused_over_triton_median": statistics.median(ratios),
            **{name: {"median_ms": statistics.median(v), "ms": v} for name, v in ms.items()}}


def _take(argv: list, flag: str):
    if flag not in argv:
        return argv, None
    i = argv.index(flag)
    return argv[:i] + argv[i + 2:], argv[i + 1]


def main():
    argv, out_json = _take(sys.argv[1:], "--json")
    argv, cprofile_n = _take(argv, "--cprofile")
    argv, pipeline_rounds = _take(argv, "--pipeline-rounds")
    argv, pipeline_block = _take(argv, "--pipeline-block")
    pinned = "--pipeline-pinned" in argv
    argv = [a for a in argv if a != "--pipeline-pinned"]
    gpu = torch.cuda.is_available()
    if pinned and not gpu:
        raise SystemExit("--pipeline-pinned: pinned host memory needs CUDA; run it on a GPU")
    args = demo._parse(argv, gpu=gpu)
    setup = demo._init_process_group(gpu)
    torch.manual_seed(args.seed)
    tables = demo._tables(args)
    dense_in = 13
    index_dtype = torch.int32 if args.index_dtype == "int32" else torch.int64
    fused_params = dict(optimizer=demo.OPTIMIZERS[args.optimizer], learning_rate=args.learning_rate, eps=1e-2,
                        embedding_table_index_type=index_dtype, embedding_table_offset_type=index_dtype)
    options = TritonTBEOptions(index_dtype=index_dtype, hoist_transpose=args.hoist_transpose,
                               fused_bounds_check=args.fused_bounds_check)
    sharder = [TritonTBESharder(fused_params=fused_params)]
    # The plain loop (the one this profile has always timed).
    models = build_models(tables, setup, args, sharder, options, dense_in, pipeline=False)
    batches = demo._batches(tables, args, setup, dense_in)
    res = {"args": vars(args)}
    for dmp, opt in models.values():
        for b in batches:  # warm-up: every batch once (kernel specializations compile, graphs capture)
            demo._step(dmp, opt, b, setup)
        for b in batches:
            demo._step(dmp, opt, b, setup)
    res["graphs_after_warm_up"] = graph_counts(models["triton"][0])
    ms = {name: [] for name in models}
    issue = {name: [] for name in models}
    names = list(models)
    for i in range(args.steps):
        b = batches[i % len(batches)]
        for name in (names if i % 2 == 0 else names[::-1]):
            t: dict = {}
            ms[name].append(demo._step(*models[name], b, setup, timings=t)[1])
            issue[name].append(t["issue_ms"])
    ratios = [f / t for f, t in zip(ms["fused"], ms["triton"])]
    res["interleaved_steps"] = args.steps
    res["fused_over_triton_median"] = statistics.median(ratios)
    for name, (dmp, opt) in models.items():
        kernels, host = profile_steps(dmp, opt, batches, setup)
        res[name] = {"median_ms": statistics.median(ms[name]), "ms": ms[name], "gpu_ms": sum(k[2] for k in kernels),
                     "issue_median_ms": statistics.median(issue[name]), "issue_ms": issue[name],
                     "kernels": kernels[:30], "host": host[:30]}
        print(f"{name}: median {statistics.median(ms[name]):.2f} ms/step (host issue {res[name]['issue_median_ms']:.2f}), "
              f"GPU kernels {res[name]['gpu_ms']:.2f} ms/step")
        print("  kernels: " + "; ".join(f"{k} x{c} {t:.3f}" for k, c, t in kernels[:12]))
        print("  host:    " + "; ".join(f"{k} x{c} {t:.3f}" for k, c, t in host[:12]))
    res["graphs_after_timing"] = graph_counts(models["triton"][0])
    print(f"our backward graphs (captures, replays) per module: after warm-up {res['graphs_after_warm_up']}, "
          f"after the timed and profiled steps {res['graphs_after_timing']}")
    if cprofile_n:
        own = {name: cprofile_steps(dmp, opt, batches, setup, int(cprofile_n)) for name, (dmp, opt) in models.items()}
        res["cprofile_own_ms_per_step"] = {}
        for name, funcs in own.items():
            top = sorted(funcs.items(), key=lambda kv: -kv[1][0])[:40]
            ours = sum(t for k, (t, _) in funcs.items() if "torchrec_triton_tbe/" in k)
            res["cprofile_own_ms_per_step"][name] = {
                "total": sum(t for t, _ in funcs.values()) * 1e3, "in_torchrec_triton_tbe": ours * 1e3,
                "top": [(k, t * 1e3, c) for k, (t, c) in top]}
            print(f"{name} cProfile: {res['cprofile_own_ms_per_step'][name]['total']:.2f} ms own time per step "
                  f"({ours * 1e3:.2f} in torchrec_triton_tbe); top: "
                  + "; ".join(f"{k} {t * 1e3:.3f} x{c:g}" for k, (t, c) in top[:8]))
        keys = set(own["fused"]) | set(own["triton"])
        zero = (0.0, 0.0)
        diff = sorted(((k, (own["triton"].get(k, zero)[0] - own["fused"].get(k, zero)[0]) * 1e3) for k in keys),
                      key=lambda kv: -abs(kv[1]))[:40]
        res["cprofile_own_ms_per_step"]["triton_minus_fused"] = diff
        print("triton - fused own ms per step: " + "; ".join(f"{k} {v:+.3f}" for k, v in diff[:12]))
    print(f"fused / triton per interleaved round: median {res['fused_over_triton_median']:.3f} over {args.steps} rounds "
          f"(> 1: ours faster)")
    if pipeline_rounds:
        models.clear()  # the plain-loop models' tables and state, before two more models are built
        if setup.gpu:
            torch.cuda.empty_cache()
        pipe = pipeline_steps(tables, setup, args, sharder, options, dense_in, batches, int(pipeline_rounds),
                              int(pipeline_block or 10), pinned)
        res["pipeline"] = pipe
        print(f"pipelined loop (TrainPipelineSparseDist, one synchronize per {pipe['block']} steps, "
              f"{'pinned' if pinned else 'pageable'} batches): fused "
              f"{pipe['fused']['median_ms']:.2f}, triton {pipe['triton']['median_ms']:.2f} ms/step; fused / triton "
              f"per round: median {pipe['fused_over_triton_median']:.3f} over {pipe['rounds']} rounds")
    if out_json:
        with open(out_json, "w") as f:
            json.dump(res, f, indent=1)
    if setup.created_pg:
        torch.distributed.destroy_process_group()
    return res


if __name__ == "__main__":
    main()
