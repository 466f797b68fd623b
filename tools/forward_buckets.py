"""Per-bucket forward times of one suite shape on the GPU, and a small knob grid per bucket.

    python tools/forward_buckets.py --shape prod_t100_b2k [--suite h200] [--json out.json]

A heterogeneous shape's pooled forward is one launch per D bucket (ops/forward.py). This times each
bucket's launch alone (triton.testing.do_bench: median, L2 cleared between calls) with the configured
knobs, then over bag_lanes x gather x bags_per_program at that bucket's BLOCK_D, and prints per bucket
its features, lookups, the configured time and the best variant, next to the whole forward. Batches
come from the bench's workload (FBGEMM's request generator), as in the suite.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys

import torch
import triton

from torchrec_triton_tbe.bench.batches import make_workload
from torchrec_triton_tbe.bench.case import load_suite
from torchrec_triton_tbe.bench.report import environment
from torchrec_triton_tbe.bench.runner import RunOptions, build_modules
from torchrec_triton_tbe.config import tile_warps
from torchrec_triton_tbe.kernels.forward import _pooled_forward_kernel
from torchrec_triton_tbe.ops import forward as fwd_ops
from torchrec_triton_tbe.ops.launch import cdiv, grid_y_slices, launch

LANES, GATHERS, BAGS = (1, 4, 8, 16), (4, 8, 16), (1,)  # each variant compiles once per BLOCK_D: keep it small


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="h200")
    ap.add_argument("--shape", default="prod_t100_b2k")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    _, shapes = load_suite(args.suite, {})
    case = next(s.case for s in shapes if s.case.name == args.shape)
    w = make_workload(case, dev)
    m = build_modules(w, "exact_sgd", RunOptions(device=dev))["triton"]
    spec, r = m._spec, w.requests[0]
    B, N = case.batch_size, r.indices.numel()
    with torch.no_grad():
        whole = triton.testing.do_bench(lambda: m(r.indices, r.offsets))
    # One launch per bucket whatever forward.grouped_max_batch says (this tool times the buckets apart).
    per_bucket = dataclasses.replace(spec, config=spec.config.replace_forward(grouped_max_batch=0))
    launches = fwd_ops._launches(per_bucket, B, N, False, m.weights.element_size(), None)
    # The bucket of each launch, in _launches' order: every bucket with features, in slices of at most
    # one grid's second dimension (ops/launch.py grid_y_slices).
    ks = [k for k, b in enumerate(spec.plan.buckets) if b.features
          for _ in grid_y_slices(spec.tensors.bucket_features[k])]
    assert len(ks) == len(launches), (len(ks), len(launches))
    out = torch.empty(B, spec.plan.total_D, dtype=spec.output_dtype, device=dev)
    warning = torch.zeros(1, dtype=torch.int64, device=dev)
    tensors = spec.tensors
    lookups = torch.diff(r.offsets.view(-1)[:: B].long()).tolist()  # per feature (host sync: fine here)
    rows = []
    for k, (features, cols, grid, cx, warps, _) in zip(ks, launches):
        bucket = spec.plan.buckets[k]
        fargs = (m.weights, r.indices, r.offsets, m.weights, out, features, cols, tensors.feature_dim,
                 tensors.feature_weight_offset, tensors.feature_out_offset, tensors.feature_rows, warning, B,
                 spec.plan.total_D, warning, warning)  # the step count pointers: unused without ADVANCE

        def timed(c: dict, nw: int) -> float:
            g = (cdiv(B, c["BAGS"] * c["LANES"]), grid[1])
            return triton.testing.do_bench(lambda: launch(_pooled_forward_kernel, g, fargs, c, nw), warmup=5, rep=20)

        configured = timed(cx, warps)
        grid_ms = {}
        for lanes, gather, bags in itertools.product(LANES, GATHERS, BAGS):
            c = dict(cx, LANES=lanes, GATHER=gather, BAGS=bags)
            nw = tile_warps(spec.config.forward.num_warps.get(bucket.block_d), lanes * gather * bucket.block_d)
            grid_ms[f"lanes={lanes},gather={gather},bags={bags}"] = timed(c, nw)
        best = min(grid_ms, key=grid_ms.get)
        n = sum(lookups[f] for f in features.tolist())
        rows.append(dict(block_d=bucket.block_d, features=features.numel(), lookups=n,
                         configured=f"lanes={cx['LANES']},gather={cx['GATHER']},bags={cx['BAGS']}",
                         configured_ms=configured, best=best, best_ms=grid_ms[best], grid_ms=grid_ms))
    print(f"{args.shape}: whole forward {whole:.3f} ms; sum of bucket launches "
          f"{sum(x['configured_ms'] for x in rows):.3f} ms configured, {sum(x['best_ms'] for x in rows):.3f} best")
    print("| BLOCK_D | features | lookups | configured | ms | best | ms |")
    print("|---|---|---|---|---|---|---|")
    for x in rows:
        print(f"| {x['block_d']} | {x['features']} | {x['lookups']} | {x['configured']} | {x['configured_ms']:.4f} "
              f"| {x['best']} | {x['best_ms']:.4f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(environment=environment(dev, sys.argv), shape=args.shape, whole_ms=whole, buckets=rows),
                      fh, indent=1)


if __name__ == "__main__":
    main()
