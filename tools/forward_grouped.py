"""The pooled forward in one launch for every D bucket (config forward.grouped_max_batch) against one
launch per bucket, and FBGEMM's CUDA TBE, on suite shapes at several batch sizes (GPU).

    python tools/forward_grouped.py --runs prod_t100_b2k:2048,prod_t40_b16k:8192 --widths 32,64 \
        [--suite h200] [--iters 20] [--json out.json]

Per run (shape:batch, the batch overriding the suite's) one workload (the bench's batches, FBGEMM's
request generator) and one pair of modules; our module switches kernel configs in place
(set_kernel_config): configs/sm90.yaml with forward.grouped_max_batch 0 ("per bucket") and, per
width W, grouped_max_batch unbounded with grouped_block_d W. Every variant's output on the first batch
is checked against FBGEMM's (the bench's forward tolerance) before it is timed (the bench's timing:
CUDA events, median over --iters after a warm-up over every batch). FBGEMM is timed first and last;
the table shows both. Give each number that matters a process of its own (one run): in one long
process (seven runs, 2026-12-01) the last run's per-bucket forward measured 0.39 ms where a fresh
process and the suite measured 0.21-0.24 (docs/performance.md "One forward launch").
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from torchrec_triton_tbe.bench.batches import make_workload
from torchrec_triton_tbe.bench.case import load_suite
from torchrec_triton_tbe.bench.report import environment
from torchrec_triton_tbe.bench.runner import _FWD_TOL, RunOptions, _call, _compare, build_modules, forward_step
from torchrec_triton_tbe.bench.timing import time_steps
from torchrec_triton_tbe.config import load_named


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="h200")
    ap.add_argument("--runs", default="prod_t100_b2k:2048,prod_t40_b16k:2048,prod_t40_b16k:8192,prod_t40_b16k:16384")
    ap.add_argument("--widths", default="32,64")
    ap.add_argument("--config", default="sm90", help="the base kernel config (name or path)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the tool under the interpreter")
    args = ap.parse_args()
    dev = torch.device(args.device)
    base = load_named(args.config)
    variants = {"per_bucket": base.replace_forward(grouped_max_batch=0)}
    for w in (int(x) for x in args.widths.split(",") if x):
        variants[f"one_launch_w{w}"] = base.replace_forward(grouped_max_batch=1 << 30, grouped_block_d=w)
    rows, failed = [], 0
    for run in args.runs.split(","):
        shape, batch = run.split(":")
        _, shapes = load_suite(args.suite, {"batch_size": int(batch)})
        case = next(s.case for s in shapes if s.case.name == shape)
        w = make_workload(case, dev)
        mods = build_modules(w, "exact_sgd", RunOptions(device=dev, compare=("fbgemm",)))
        ours, fb = mods["triton"], mods["fbgemm"]
        warmup = max(case.warmup_runs + 1, len(w.requests))
        lookups = sum(x.indices.numel() for x in w.requests) // len(w.requests)
        # D buckets with features: the one launch replaces that many (it needs two at least).
        buckets = sum(1 for b in ours.spec.plan.buckets if b.features)
        row = dict(shape=shape, batch=int(batch), lookups=lookups, buckets=buckets, ms={}, check={})
        with torch.no_grad():
            row["ms"]["fbgemm_first"] = time_steps(forward_step(fb, w), args.iters, warmup, dev).median_ms
            expected = _call(fb, w, 0)
            for name, cfg in variants.items():
                ours.set_kernel_config(cfg)
                tol = _FWD_TOL[case.weights_precision]
                row["check"][name] = _compare(_call(ours, w, 0), expected, *tol)
                if not row["check"][name]["ok"]:
                    failed += 1
                row["ms"][name] = time_steps(forward_step(ours, w), args.iters, warmup, dev).median_ms
            row["ms"]["fbgemm_last"] = time_steps(forward_step(fb, w), args.iters, warmup, dev).median_ms
        rows.append(row)
        print(json.dumps(row), flush=True)
        del mods, ours, fb, w
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    names = ["fbgemm_first", "fbgemm_last", *variants]
    print("| shape | B | lookups | " + " | ".join(names) + " | checks |")
    print("|---|---|---|" + "---|" * (len(names) + 1))
    for x in rows:
        ok = all(c["ok"] for c in x["check"].values())
        print(f"| {x['shape']} | {x['batch']} | {x['lookups']:,} | " + " | ".join(f"{x['ms'][n]:.3f}" for n in names)
              + f" | {'ok' if ok else 'MISMATCH'} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(environment=environment(dev, sys.argv), runs=rows), fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
