"""Per-stage GPU times of our backward on a suite shape (heterogeneous tables), beside FBGEMM's (GPU).

    python tools/profile_suite_stages.py --shape prod_small_b16k [--suite h200] [--optimizer exact_rowwise_adagrad]
        [--json out.json]

tools/profile_stages.py does this for the homogeneous shapes of tools/sweep.py; this one takes the
bench's workload of a suite shape (FBGEMM's request generator, the suite's per-table rows, dims, bag
sizes, Zipf exponents) and ours / FBGEMM's modules with identical weights (bench.runner.build_modules),
and times on the first batch, each in isolation (median, triton.testing.do_bench): linearize, the sort,
all run metadata (linearize and sort included), the fused update (short, long and small-table kernels
of every D bucket, all routed as in training; where the small-table path applies, its buckets' kernels
alone too), and the whole backward of ours and of FBGEMM (CUDA
events around ``out.backward``). The update rewrites the weights each time it runs: these are
timings, not a training run. Per bucket, the update alone again (the other buckets' lookups still
in the runs) and the bucket's lookups and long-run share (RunPlan.stats over its slots).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from profile_stages import bench, timed_backward  # tools/ is on sys.path when this script runs
from torchrec_triton_tbe.bench.batches import make_workload
from torchrec_triton_tbe.bench.case import load_suite
from torchrec_triton_tbe.bench.runner import RunOptions, _call, build_modules
from torchrec_triton_tbe.ops import backward as bwd_ops
from torchrec_triton_tbe.ops import small_table as small_ops
from torchrec_triton_tbe.ops import transpose as tr_ops


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="h200")
    ap.add_argument("--shape", required=True)
    ap.add_argument("--optimizer", default="exact_rowwise_adagrad")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    _, shapes = load_suite(args.suite, {})
    case = next(s.case for s in shapes if s.case.name == args.shape)
    if case.pooling == "none" or case.batch_size_list:
        raise SystemExit(f"{args.shape}: pooled fixed-batch shapes only")
    w = make_workload(case, dev)
    mods = build_modules(w, args.optimizer, RunOptions(device=dev, compare=("fbgemm",)))
    ours, fb = mods["triton"], mods["fbgemm"]
    r = w.requests[0]
    dt = torch.int32 if case.indices_dtype == 32 else torch.int64
    idx, off, psw = r.indices.to(dt), r.offsets.to(dt), r.per_sample_weights
    spec, B = ours.spec, case.batch_size
    res = dict(shape=args.shape, optimizer=args.optimizer, lookups=idx.numel(), B=B)
    res["linearize"] = bench(lambda: tr_ops.linearize(spec, idx, off, B))
    keys, _, _ = tr_ops.linearize(spec, idx, off, B)
    res["sort"] = bench(lambda: torch.sort(keys, stable=True))
    res["run_metadata_all"] = bench(lambda: tr_ops.build_runs(spec, idx, off, B))
    runs = tr_ops.build_runs(spec, idx, off, B)
    res["runs"] = runs.stats()
    state = ours.optimizer_tensors()
    psw_f = psw.float() if psw is not None else None
    grad = w.grad_output.to(_call(ours, w, 0).dtype)  # what autograd hands the backward
    res["fused_update"] = bench(lambda: bwd_ops.fused_update(spec, state, runs, grad, off, psw_f, B, indices=idx))
    if small_ops.backward_applies(spec, None, B, idx.numel()):
        # The small-table path's share of the fused update: each small group's kernels alone.
        res["small_table_update"] = {
            f"group {g} (BLOCK_D {grp.block_d}, {len(grp.tables)} tables)": bench(
                lambda g=g: small_ops.backward(spec, g, state.kernel_args(), grad, idx, off, psw_f, B))
            for g, grp in enumerate(spec.plan.small_groups) if grp.features}
    res["ours_backward"] = timed_backward(lambda: _call(ours, w, 0), w.grad_output)
    res["fbgemm_backward"] = timed_backward(lambda: _call(fb, w, 0), w.grad_output)
    # Per bucket: its slots' run statistics (lookups, runs, long runs, longest run).
    lens = (runs.run_start[1:] - runs.run_start[:-1]).to(torch.int64)
    bounds = runs.bucket_run_bounds.tolist()
    res["buckets"] = []
    for k, bucket in enumerate(spec.plan.buckets):
        if not bucket.features:
            continue
        ln = lens[bounds[k]:bounds[k + 1]]
        ln = ln[ln > 0]
        res["buckets"].append(dict(block_d=bucket.block_d, tables=len(bucket.tables), lookups=int(ln.sum()),
                                   runs=int(ln.numel()), long_runs=int((ln >= runs.threshold).sum()),
                                   long_lookups=int(ln[ln >= runs.threshold].sum()),
                                   max_run=int(ln.max()) if ln.numel() else 0))
    for k, v in res.items():
        if k != "buckets":
            print(f"{k:22s} {v:.3f}" if isinstance(v, float) else f"{k:22s} {v}")
    print("| BLOCK_D | tables | lookups | runs | long runs | lookups in long runs | longest run |")
    print("|---|---|---|---|---|---|---|")
    for b in res["buckets"]:
        print(f"| {b['block_d']} | {b['tables']} | {b['lookups']:,} | {b['runs']:,} | {b['long_runs']:,} | "
              f"{b['long_lookups']:,} | {b['max_run']:,} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
