"""Sweep the kernel knobs of configs/<target>.yaml on the GPU and report (optionally write) the best.

    python tools/sweep.py --target sm90 [--part fwd,bwd,route,meta] [--shapes uniform,zipf] [--write]
        [--weights fp16|fp32] [--optimizer rowwise|sgd] [--json out.json] [--grid KNOB=V1,V2 ...]

For each shape (FBGEMM's request generator, fp16 weights, fp32 output, SUM, bounds check off) it times
the forward over the forward grid (bags_per_program x gather x num_warps x bag_lanes at that shape's BLOCK_D;
with --weights fp32 the lanes go to bag_lanes_fp32, the table fp32 weights read) and
the fused update of the backward over the backward grid (tile x num_warps x programs_per_sm x waves), and
(part ``route``) run metadata + fused update over the short/long threshold, the long chunk and the
long-path schedule (split / fused), and (part ``meta``) the run metadata alone (linearize, sort and the
six metadata launches) over the metadata block, the totals' scan step and its warps, each the median
of CUDA-event timings after a warm-up
(``triton.testing.do_bench``, which clears L2 between calls). The winner
of each knob is the configuration with the smallest total time over the swept shapes; ``--write``
stores it into configs/<target>.yaml (and marks it tuned). Knobs change speed, never results; the CPU
test suite proves that for every knob (tests/test_routing.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
from pathlib import Path

import torch
import triton
import yaml

from torchrec_triton_tbe._fbgemm import BoundsCheckMode, EmbOptimType, SparseType
from torchrec_triton_tbe.config import KnobTable, config_dir, load_named
from torchrec_triton_tbe.module import TritonTBE
from torchrec_triton_tbe.ops import backward as bwd_ops
from torchrec_triton_tbe.ops import transpose as tr_ops

SHAPES = {
    "uniform": dict(B=65536, T=32, E=1_000_000, D=128, L=20, alpha=1.0),
    "zipf": dict(B=65536, T=32, E=1_000_000, D=128, L=20, alpha=1.15),
    "short": dict(B=131072, T=8, E=10_000_000, D=128, L=4, alpha=1.0),
    "default": dict(B=512, T=32, E=100_000, D=128, L=20, alpha=1.0),
    "d32": dict(B=65536, T=32, E=1_000_000, D=32, L=20, alpha=1.0),
    "d64": dict(B=65536, T=32, E=1_000_000, D=64, L=20, alpha=1.15),
    "hot": dict(B=131072, T=32, E=1_000_000, D=128, L=1, alpha=1.5),  # most lookups in runs >= 256
    "d256": dict(B=65536, T=16, E=1_000_000, D=256, L=20, alpha=1.15),
    "fp32": dict(B=65536, T=16, E=1_000_000, D=128, L=20, alpha=1.15),  # the suite's fp32 shape (--weights fp32)
}


def profile_case(default_shape: str, doc: str, extend=None) -> tuple:
    """The command line of the profile tools (--shape, --optimizer, --json; ``extend(parser)`` adds a
    tool's own) and their shape_case: (args, dims, TBE keyword arguments, ids, offsets, gradient)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default=default_shape, choices=sorted(SHAPES))
    ap.add_argument("--optimizer", default="rowwise", choices=["sgd", "rowwise"])
    ap.add_argument("--json")
    if extend is not None:
        extend(ap)
    args = ap.parse_args()
    logging.getLogger("fbgemm_gpu").setLevel(logging.ERROR)
    return (args, *shape_case(args.shape, args.optimizer))


def shape_case(name: str, optimizer: str = "rowwise", device: str = "cuda") -> tuple:
    """One shape as the stage / host profiles use it: (dims, TBE keyword arguments, ids, offsets, fp32
    output gradient). FBGEMM's request generator; fp16 weights, fp32 output, bounds check off and
    stochastic rounding off, as in the suite (FBGEMM's benchmark defaults)."""
    from fbgemm_gpu.tbe.utils import generate_requests

    s = SHAPES[name]
    opt = EmbOptimType.EXACT_ROWWISE_ADAGRAD if optimizer == "rowwise" else EmbOptimType.EXACT_SGD
    kw = dict(optimizer=opt, weights_precision=SparseType.FP16, output_dtype=SparseType.FP32, learning_rate=0.01,
              bounds_check_mode=BoundsCheckMode.NONE, stochastic_rounding=False)
    req = generate_requests(1, s["B"], s["T"], s["L"], s["E"], alpha=s["alpha"])[0]
    grad = torch.randn(s["B"], s["T"] * s["D"], device=device)
    return s, kw, req.indices.to(device), req.offsets.to(device), grad
FWD_GRID = dict(bags_per_program=[1, 2], gather=[2, 4, 8], num_warps=[1, 2], bag_lanes=[1, 4, 8])
BWD_GRID = dict(tile=[4, 8, 16, 32], num_warps=[1, 2], programs_per_sm=[16, 32], waves=[1])
ROUTE_GRID = dict(short_threshold=[64, 256, 1024], long_chunk=[64, 256, 1024], long_path=["split", "fused"])
META_GRID = dict(run_block=[1024, 2048, 4096], scan_block=[1024, 4096], scan_warps=[4, 8])


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=60, return_mode="median")


def with_table(table: KnobTable, block_d: int, value: int) -> KnobTable:
    d = dict(table.by_block_d)
    d[block_d] = value
    return KnobTable(table.default, tuple(sorted(d.items())))


def for_weights(section, name: str, weights: str, block_d: int, value: int) -> dict:
    """{knob: table} setting ``name`` at ``block_d`` in the table these weights read: ``<name>_fp32``
    for fp32 weights (starting from the fp16 table where the config has no fp32 one), else ``name``."""
    table = getattr(section, name)
    if weights == "fp32":
        return {name + "_fp32": with_table(getattr(section, name + "_fp32") or table, block_d, value)}
    return {name: with_table(table, block_d, value)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="sm90")
    ap.add_argument("--part", default="fwd,bwd")
    ap.add_argument("--shapes", default="uniform,zipf")
    ap.add_argument("--weights", default="fp16", choices=["fp16", "fp32"],
                    help="weights precision (the tile/warps tables are per BLOCK_D: --write only with fp16)")
    ap.add_argument("--optimizer", default="rowwise", choices=["rowwise", "sgd"],
                    help="the module's optimizer (the backward's fused update; --write only with rowwise)")
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--grid", nargs="*", default=[], metavar="KNOB=V1,V2",
                    help="narrow a grid, e.g. --grid tile=8,16 num_warps=1 (values as in configs/)")
    args = ap.parse_args()
    if args.write and args.weights != "fp16":
        ap.error("--write tunes the fp16 tables; sweep fp32 weights without it")
    if args.write and args.optimizer != "rowwise":
        ap.error("--write tunes with row-wise Adagrad (the tables are per BLOCK_D, not per optimizer)")
    for item in args.grid:
        knob, _, values = item.partition("=")
        grids = [g for g in (FWD_GRID, BWD_GRID, ROUTE_GRID, META_GRID) if knob in g]
        if not grids or not values:
            ap.error(f"--grid {item}: knobs are {sorted({*FWD_GRID, *BWD_GRID, *ROUTE_GRID, *META_GRID})}")
        for g in grids:
            g[knob] = [v if knob == "long_path" else int(v) for v in values.split(",")]
    logging.getLogger("fbgemm_gpu").setLevel(logging.ERROR)
    from fbgemm_gpu.tbe.utils import generate_requests

    base = load_named(args.target)
    dev = torch.device("cuda")
    results = {"fwd": {}, "bwd": {}, "route": {}, "meta": {}}
    parts = args.part.split(",")
    for name in args.shapes.split(","):
        s = SHAPES[name]
        B, T, E, D, L = s["B"], s["T"], s["E"], s["D"], s["L"]
        bd = triton.next_power_of_2(D)
        # Stochastic rounding off, as in the suite (FBGEMM's benchmark default, --stoc to enable).
        opt = EmbOptimType.EXACT_ROWWISE_ADAGRAD if args.optimizer == "rowwise" else EmbOptimType.EXACT_SGD
        m = TritonTBE([(E, D)] * T, device=dev, optimizer=opt,
                      weights_precision=SparseType.FP16 if args.weights == "fp16" else SparseType.FP32,
                      bounds_check_mode=BoundsCheckMode.NONE, kernel_config=base,
                      stochastic_rounding=False)
        req = generate_requests(1, B, T, L, E, alpha=s["alpha"])[0]
        idx, off = req.indices.to(dev), req.offsets.to(dev)
        grad = torch.randn(B, T * D, device=dev)
        if "fwd" in parts:
            for bags, gather, warps, lanes in itertools.product(*FWD_GRID.values()):
                cfg = base.replace_forward(
                    bags_per_program=bags,
                    gather=with_table(base.forward.gather, bd, gather),
                    num_warps=with_table(base.forward.num_warps, bd, warps),
                    **for_weights(base.forward, "bag_lanes", args.weights, bd, lanes),
                )
                m.set_kernel_config(cfg)
                try:
                    with torch.no_grad():
                        t = median_ms(lambda: m(idx, off))
                except Exception as e:  # noqa: BLE001 - a knob value the compiler rejects is skipped, not fatal
                    print(f"fwd {name:8s} bags={bags} gather={gather} warps={warps} lanes={lanes}: "
                          f"FAILED {str(e)[:120]}")
                    continue
                results["fwd"].setdefault((bags, gather, warps, lanes), {})[name] = t
                print(f"fwd {name:8s} bags={bags} gather={gather} warps={warps} lanes={lanes}: {t:.3f} ms",
                      flush=True)
        if "bwd" in parts:
            state = m.optimizer_tensors()
            for tile, warps, pps, waves in itertools.product(*BWD_GRID.values()):
                cfg = base.replace_backward(
                    **for_weights(base.backward, "tile", args.weights, bd, tile),
                    num_warps=with_table(base.backward.num_warps, bd, warps),
                    programs_per_sm=pps,
                    waves=waves,
                )
                spec = dataclasses.replace(m.spec, config=cfg)
                runs = tr_ops.build_runs(spec, idx, off, B)
                try:
                    t = median_ms(lambda: bwd_ops.fused_update(spec, state, runs, grad, off, None, B))
                except Exception as e:  # noqa: BLE001 - a knob value the compiler rejects is skipped, not fatal
                    print(f"bwd {name:8s} tile={tile} warps={warps} programs/SM={pps} waves={waves}: "
                          f"FAILED {str(e)[:120]}")
                    continue
                results["bwd"].setdefault((tile, warps, pps, waves), {})[name] = t
                print(f"bwd {name:8s} tile={tile} warps={warps} programs/SM={pps} waves={waves}: {t:.3f} ms",
                      flush=True)
        if "route" in parts:
            # Routing moves work between the run-metadata pass and the kernels: time both.
            state = m.optimizer_tensors()
            for threshold, chunk, long_path in itertools.product(*ROUTE_GRID.values()):
                cfg = base.replace_backward(short_threshold=threshold, long_chunk=chunk, long_path=long_path)
                spec = dataclasses.replace(m.spec, config=cfg)

                def step():
                    runs = tr_ops.build_runs(spec, idx, off, B)
                    bwd_ops.fused_update(spec, state, runs, grad, off, None, B)

                try:
                    t = median_ms(step)
                except Exception as e:  # noqa: BLE001 - a knob value the compiler rejects is skipped, not fatal
                    print(f"route {name:8s} threshold={threshold} chunk={chunk} {long_path}: FAILED {str(e)[:120]}")
                    continue
                results["route"].setdefault((threshold, chunk, long_path), {})[name] = t
                print(f"route {name:8s} threshold={threshold} chunk={chunk} {long_path}: {t:.3f} ms", flush=True)
        if "meta" in parts:
            for run_block, scan_block, scan_warps in itertools.product(*META_GRID.values()):
                cfg = dataclasses.replace(base, transpose=dataclasses.replace(
                    base.transpose, run_block=run_block, scan_block=scan_block, scan_warps=scan_warps))
                spec = dataclasses.replace(m.spec, config=cfg)
                t = median_ms(lambda: tr_ops.build_runs(spec, idx, off, B))
                results["meta"].setdefault((run_block, scan_block, scan_warps), {})[name] = t
                print(f"meta {name:8s} run_block={run_block} scan_block={scan_block} scan_warps={scan_warps}: "
                      f"{t:.3f} ms", flush=True)
    best = {}
    for part, table in results.items():
        if table:
            key, times = min(table.items(), key=lambda kv: sum(kv[1].values()))
            best[part] = (key, times)
            print(f"best {part}: {key} -> {times}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({p: [{"knobs": list(k), "ms": v} for k, v in t.items()] for p, t in results.items()}, fh, indent=1)
    if args.write and best:
        path = Path(config_dir()) / f"{args.target}.yaml"
        doc = yaml.safe_load(path.read_text())
        bd = triton.next_power_of_2(SHAPES[args.shapes.split(",")[0]]["D"])
        if "fwd" in best:
            bags, gather, warps, lanes = best["fwd"][0]
            doc["forward"]["bags_per_program"] = bags
            doc["forward"]["gather"][bd] = gather
            doc["forward"]["num_warps"][bd] = warps
            # A config from before the lanes mode has no table (or a bare int): start one from its default.
            old_lanes = doc["forward"].get("bag_lanes", 1)
            doc["forward"]["bag_lanes"] = {"default": old_lanes} if isinstance(old_lanes, int) else old_lanes
            doc["forward"]["bag_lanes"][bd] = lanes
        if "bwd" in best:
            tile, warps, pps, waves = best["bwd"][0]
            doc["backward"]["tile"][bd] = tile
            doc["backward"]["num_warps"][bd] = warps
            doc["backward"]["programs_per_sm"] = pps
            doc["backward"]["waves"] = waves
        if "route" in best:
            threshold, chunk, long_path = best["route"][0]
            doc["backward"]["short_threshold"] = threshold
            doc["backward"]["long_chunk"] = chunk
            doc["backward"]["long_path"] = long_path
        if "meta" in best:
            run_block, scan_block, scan_warps = best["meta"][0]
            doc["transpose"].update(run_block=run_block, scan_block=scan_block, scan_warps=scan_warps)
        doc["tuned"] = True
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
