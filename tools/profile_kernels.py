"""GPU time per kernel of one pass of a suite shape, ours beside FBGEMM's (GPU; torch.profiler).

    python tools/profile_kernels.py --shape vbe_t16_b1k_64k [--shape d32_uniform ...] [--passes fwd,bwd]
        [--optimizer exact_rowwise_adagrad] [--iters 10] [--suite h200] [--json out.json]
        [--compare fbgemm,torchrec_triton --torchrec-checkout .stage/torchrec]

Any suite shape the bench runs (fixed or variable batch, pooled or sequence): the bench's workload and
modules (bench.runner.build_modules: identical weights; ``--compare`` as the bench's, FBGEMM's by
default, TorchRec's Triton TBE from a checkout as in the bench), warmed up, then ``--iters`` calls of each pass
under torch.profiler, each kernel's device time summed by name and divided by the iterations. Beside it,
each pass's event time (median, timed as the bench times it: bench.timing.time_steps), so the kernels'
sum can be read against the wall: a sum well below the event time means gaps (launch-bound or streams idle), above it means kernels overlapped on
several streams. The backward pass re-runs the forward outside the profiled region, as the bench does.
What it answers: where a pass's GPU time goes (which kernel, which D bucket's launch), not how fast the
pass is: use bench.cli for that (its `--check` too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import torch

from torchrec_triton_tbe.bench.batches import make_workload
from torchrec_triton_tbe.bench.case import load_suite
from torchrec_triton_tbe.bench import peers
from torchrec_triton_tbe.bench.runner import RunOptions, backward_step, build_modules, forward_step, skip_reason
from torchrec_triton_tbe.bench.timing import time_steps


_LABEL = {"triton": "ours"}  # the JSON keys of earlier runs: ours, fbgemm


def _kernels(step, iters: int) -> dict[str, dict]:
    """{kernel name: {"calls": per iteration, "us": device microseconds per iteration}}."""
    from torch.profiler import ProfilerActivity, profile

    runs = [step(i) for i in range(iters)]  # forwards of the backward pass happen here, unprofiled
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for run in runs:
            run()
        torch.cuda.synchronize()
    out: dict[str, dict] = defaultdict(lambda: {"calls": 0.0, "us": 0.0})
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        k = out[ev.name[:120]]
        k["calls"] += 1 / iters
        k["us"] += ev.time_range.elapsed_us() / iters
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["us"]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="h200")
    ap.add_argument("--shape", action="append", required=True)
    ap.add_argument("--passes", default="fwd,bwd")
    ap.add_argument("--optimizer", default="exact_rowwise_adagrad")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json")
    ap.add_argument("--compare", default="fbgemm", help="comma list: fbgemm, torchrec_triton")
    ap.add_argument("--torchrec-checkout", default=os.environ.get(peers.CHECKOUT_ENV))
    args = ap.parse_args()
    if "torchrec_triton" in args.compare.split(",") and not args.torchrec_checkout:
        ap.error(f"--compare torchrec_triton needs --torchrec-checkout PATH (or ${peers.CHECKOUT_ENV})")
    if not torch.cuda.is_available():
        raise SystemExit("profile_kernels: needs a GPU (the CUDA kernels beside ours)")
    dev = torch.device("cuda")
    _, shapes = load_suite(args.suite, {})
    by_name = {s.case.name: s.case for s in shapes}
    report = []
    for name in args.shape:
        if name not in by_name:
            raise SystemExit(f"{name}: not a shape of suite {args.suite}")
        w = make_workload(by_name[name], dev)
        mods = build_modules(w, args.optimizer, RunOptions(device=dev, compare=args.compare,
                                                            torchrec_checkout=args.torchrec_checkout))
        for kernel, why in mods.errors.items():
            print(f"{name}: {kernel} not built: {why}")
        for p in args.passes.split(","):
            make = {"fwd": forward_step, "bwd": backward_step}[p]
            entry = {"shape": name, "pass": p, "optimizer": args.optimizer if p == "bwd" else None}
            labels = [(_LABEL.get(k, k), m) for k, m in mods.items()
                      if skip_reason(k, w, args.optimizer if p == "bwd" else None, dev) is None]
            for label, mod in labels:
                step = make(mod, w)
                for i in range(3):  # compile, capture, caches
                    step(i)()
                torch.cuda.synchronize()
                kernels = _kernels(step, args.iters)
                entry[label] = {"event_ms": time_steps(step, args.iters, 0, dev).median_ms, "kernel_sum_ms":
                                sum(k["us"] for k in kernels.values()) / 1e3, "kernels": kernels}
            report.append(entry)
            print(f"\n{name} {p}" + (f" ({args.optimizer})" if p == "bwd" else "")
                  + "".join(f"; {lab}: event {entry[lab]['event_ms']:.3f} ms, kernels {entry[lab]['kernel_sum_ms']:.3f} ms"
                            for lab, _ in labels))
            for lab, _ in labels:
                print(f"| {lab} kernel | calls | us |\n|---|---|---|")
                for kname, k in list(entry[lab]["kernels"].items())[:12]:
                    print(f"| {kname[:90]} | {k['calls']:.1f} | {k['us']:.1f} |")
        del mods, w
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
