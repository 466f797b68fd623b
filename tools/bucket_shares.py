"""How a suite shape's work splits over the D buckets, from its table list alone (no GPU, no batches).

For each BLOCK_D bucket of the shape's tables (plan.TablePlan, as the module builds it): its lookups
(batch x each table's fixed bag size, as the suite's generator draws them), its share of the lookups
and of the backward's gradient bytes (lookups x BLOCK_D x 4: each lookup reads one fp32 gradient row
of the bucket's tile width), and the stream the backward's assignment gives its short kernel
(ops/backward.update_lanes with the config's ``backward`` knobs, no small-table path; a bucket whose
long path takes a stream of its own, backward.split_paths, is counted on its short kernel's). The
busiest stream's share beside the heaviest bucket's says how much a better balance could gain: the
update cannot finish before its heaviest bucket. Then the one-launch forward's column slices
(``forward.grouped_block_d`` wide, ops/forward.py; narrow features on their ``forward.grouped_narrow``
tiles): which share of the tiles' columns the tables fill, weighted by lookups.

    python tools/bucket_shares.py --shape prod_t40_b16k [--shape prod_t100_b2k ...] [--config sm90] [--json out.json]

These are proportions of a byte model, not timings (docs/performance.md uses them to say where the
production backward's critical path is).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torchrec_triton_tbe.config import load_named  # noqa: E402
from torchrec_triton_tbe.ops.backward import update_lanes  # noqa: E402
from torchrec_triton_tbe.plan import TablePlan  # noqa: E402

SUITE = Path(__file__).resolve().parent.parent / "configs" / "suites" / "h200.yaml"


def shape_tables(name: str, suite: Path = SUITE) -> tuple[int, list[int], list[int], list[int]]:
    """(batch, rows, dims, bag sizes) per table of suite shape ``name`` (the single values spread over
    num_tables where the shape has no list)."""
    doc = yaml.safe_load(suite.read_text())
    for shape in doc["shapes"]:
        if shape["name"] == name:
            n = int(shape["num_tables"])
            rows = shape.get("num_embeddings_list") or [shape["num_embeddings"]] * n
            dims = shape.get("embedding_dim_list") or [shape["embedding_dim"]] * n
            bags = shape.get("bag_size_list") or [shape["bag_size"]] * n
            if "batch_size_list" in shape:
                raise ValueError(f"{name}: a variable batch per table (VBE) is not modelled here")
            return int(shape["batch_size"]), [int(r) for r in rows], [int(d) for d in dims], [int(b) for b in bags]
    raise ValueError(f"no shape {name!r} in {suite}")


def shares(name: str, config: str = "sm90") -> dict:
    B, rows, dims, bags = shape_tables(name)
    cfg = load_named(config)
    plan = TablePlan.build(list(zip(rows, dims)), None)
    buckets = [b for b in plan.buckets if b.features]
    lookups = [B * sum(bags[k] for k in b.tables) for b in buckets]
    grad_bytes = [n * b.block_d * 4 for n, b in zip(lookups, buckets)]
    total_lookups, total_bytes = sum(lookups), sum(grad_bytes)
    num_lanes, lanes = update_lanes(cfg.backward, [len(b.features) * b.block_d for b in buckets], total_lookups, False)
    bcfg = cfg.backward
    n_streams = min(bcfg.bucket_streams, num_lanes) if total_lookups >= bcfg.bucket_streams_min_lookups else 1
    per_stream = [0.0] * max(n_streams, 1)
    rows_out = []
    for (b, n, g), (lane, long_lane) in zip(zip(buckets, lookups, grad_bytes), lanes):
        stream = lane % len(per_stream)
        per_stream[stream] += g / total_bytes
        rows_out.append(dict(block_d=b.block_d, tables=len(b.tables), lookups=n, lookup_share=n / total_lookups,
                             grad_byte_share=g / total_bytes, stream=stream,
                             long_stream=long_lane % len(per_stream)))
    width = cfg.forward.grouped_block_d
    # A feature within a narrow level (forward.grouped_narrow) pools that level's width, else its slices.
    levels = [w for w, _ in cfg.forward.narrow_levels(width, dims)]
    tiles = [next((w for w in levels if d <= w), -(-d // width) * width) for d in dims]
    used = sum(B * bags[k] * dims[k] for k in range(len(dims)))
    slots = sum(B * bags[k] * tiles[k] for k in range(len(dims)))
    return dict(shape=name, config=config, batch=B, lookups=total_lookups, bucket_streams=n_streams,
                buckets=rows_out, busiest_stream_share=max(per_stream),
                heaviest_bucket_share=max(r["grad_byte_share"] for r in rows_out),
                grouped_block_d=width, grouped_applies=0 < B <= cfg.forward.grouped_max_batch,
                slice_column_use=used / slots)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", required=True, help="a suite shape (repeatable)")
    ap.add_argument("--config", default="sm90", help="kernel config name or path (default sm90)")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)
    results = [shares(s, args.config) for s in args.shape]
    for r in results:
        print(f"{r['shape']}: B={r['batch']}, {r['lookups'] / 1e6:.2f} M lookups, {len(r['buckets'])} buckets "
              f"on {r['bucket_streams']} streams")
        print("| BLOCK_D | tables | lookups (M) | lookup share | gradient-byte share | stream | long path's |")
        print("|---|---|---|---|---|---|---|")
        for b in r["buckets"]:
            print(f"| {b['block_d']} | {b['tables']} | {b['lookups'] / 1e6:.2f} | {b['lookup_share']:.2f} | "
                  f"{b['grad_byte_share']:.2f} | {b['stream']} | {b['long_stream']} |")
        print(f"busiest stream {r['busiest_stream_share']:.2f} of the gradient bytes, heaviest bucket "
              f"{r['heaviest_bucket_share']:.2f}; one-launch forward ({'taken' if r['grouped_applies'] else 'not taken'} "
              f"at this batch): {r['grouped_block_d']}-wide slices {r['slice_column_use']:.2f} used (lookup-weighted)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
