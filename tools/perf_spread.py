"""The spread of bench results over runs of one setting in separate processes.

    python tools/perf_spread.py out/streams_procs_st1_1.json out/streams_procs_st1_2.json ... out/streams_procs_st4_5.json

Files are grouped by their name without the trailing ``_<run>.json`` (``streams_procs_st1``,
``streams_procs_st4``); for each group, shape and pass it prints how many runs there were and the min /
median / max of our median ms and of FBGEMM's, and the median over runs of each side's host issue
time (bench/timing.py ``host_median_ms``, where the JSON has it). Made for settings whose time differs
per process (the pooled forward's bucket streams, docs/performance.md "fp32 weights"), where one run
per setting decides nothing.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def group_name(path: str) -> str:
    return re.sub(r"_\d+$", "", Path(path).stem)


def spread(paths: list[str]) -> dict:
    """{(group, shape, pass): {"triton": [ms...], "fbgemm": [ms...], "triton_host": [ms...], "fbgemm_host":
    [ms...]}} over the files' shapes."""
    out: dict = defaultdict(lambda: {"triton": [], "fbgemm": [], "triton_host": [], "fbgemm_host": []})
    for path in paths:
        with open(path) as fh:
            d = json.load(fh)
        for s in d["shapes"]:
            for p, x in s.get("results", {}).items():
                row = out[(group_name(path), s["name"], p)]
                for who in ("triton", "fbgemm"):
                    if who in x and "median_ms" in x[who]:
                        row[who].append(x[who]["median_ms"])
                    if who in x and "host_median_ms" in x[who]:
                        row[who + "_host"].append(x[who]["host_median_ms"])
    return out


def fmt(v: list) -> str:
    return f"{min(v):.3f} / {statistics.median(v):.3f} / {max(v):.3f}" if v else "—"


def main(paths: list[str]) -> None:
    rows = spread(paths)
    print("| setting | shape | pass | runs | ours ms min / median / max | FBGEMM ms min / median / max "
          "| host ms, ours / FBGEMM (median) |")
    print("|---|---|---|---|---|---|---|")
    for (group, shape, p), v in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        if not v["triton"] and not v["fbgemm"]:
            continue
        host = " / ".join(f"{statistics.median(h):.3f}" if h else "—" for h in (v["triton_host"], v["fbgemm_host"]))
        print(f"| {group} | {shape} | {p} | {len(v['triton'])} | {fmt(v['triton'])} | {fmt(v['fbgemm'])} | {host} |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
