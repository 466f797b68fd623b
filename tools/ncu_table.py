"""One line per kernel launch of an Nsight Compute raw CSV (`ncu --import R.ncu-rep --csv --page raw
--print-units base`):
duration, DRAM bytes and throughput, achieved and theoretical occupancy, registers, grid, and the two
largest warp stall reasons (cycles per issued instruction). tools/device_session.sh `ncu` prints it.

    python tools/ncu_table.py ncu_dlrm_t26_l1.csv [--json out.json]

Units are read from the CSV's second row (ncu writes one per column) and converted to µs and MB.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from typing import Optional

# ncu 2025 (the H200 image) writes "us" / "Mbyte"; older versions spell times out ("usecond").
_TIME = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6, "nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}
_BYTES = {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3, "Tbyte": 1e6}
_STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")
COLUMNS = {
    "us": "gpu__time_duration.sum",
    "dram_read_MB": "dram__bytes_read.sum",
    "dram_write_MB": "dram__bytes_write.sum",
    "dram_pct": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "occ_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "occ_theory_pct": "sm__maximum_warps_per_active_cycle_pct",
    "regs": "launch__registers_per_thread",
    "grid": "launch__grid_size",
    "block": "launch__block_size",
}


def _number(text: str) -> Optional[float]:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def rows(path: str) -> list[dict]:
    """Each launch of the CSV as {kernel, us, dram_read_MB, ..., stalls: [(reason, ratio), ...]}."""
    with open(path, newline="") as fh:
        table = list(csv.reader(fh))
    if len(table) < 2:
        return []
    header, units = table[0], table[1]
    col = {name: i for i, name in enumerate(header)}
    name_col = col.get("Kernel Name", col.get("Function Name"))
    if name_col is None:
        raise ValueError(f"{path}: no 'Kernel Name' column (is it `ncu --csv --page raw` output?)")
    out = []
    for raw in table[2:]:
        if len(raw) != len(header):
            continue
        rec: dict = {"kernel": raw[name_col]}
        for key, metric in COLUMNS.items():
            i = col.get(metric)
            value = _number(raw[i]) if i is not None else None
            if value is not None and key == "us":
                value *= _TIME.get(units[i], float("nan"))
            elif value is not None and key.endswith("_MB"):
                value *= _BYTES.get(units[i], float("nan"))
            rec[key] = value
        # "selected" is the issuing warp's own cycle, not a stall.
        stalls = [(m.group(1), _number(raw[i])) for name, i in col.items()
                  if (m := _STALL.match(name)) and m.group(1) != "selected"]
        rec["stalls"] = sorted(((r, v) for r, v in stalls if v is not None), key=lambda rv: -rv[1])[:2]
        out.append(rec)
    return out


def _short(kernel: str, width: int = 48) -> str:
    name = re.sub(r"^(void )?", "", kernel).split("(")[0]
    return name if len(name) <= width else name[: width - 3] + "..."


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(records: list[dict]) -> str:
    lines = ["| kernel | µs | DRAM MB r/w | DRAM % | occ % (theory) | regs | grid x block | top stalls |",
             "|---|---|---|---|---|---|---|---|"]
    for r in records:
        stalls = ", ".join(f"{name} {v:.1f}" for name, v in r["stalls"]) or "-"
        lines.append(
            f"| {_short(r['kernel'])} | {_fmt(r['us'], '.1f')} | {_fmt(r['dram_read_MB'], '.1f')} / "
            f"{_fmt(r['dram_write_MB'], '.1f')} | {_fmt(r['dram_pct'], '.0f')} | {_fmt(r['occ_pct'], '.0f')} "
            f"({_fmt(r['occ_theory_pct'], '.0f')}) | {_fmt(r['regs'], '.0f')} | {_fmt(r['grid'], '.0f')} x "
            f"{_fmt(r['block'], '.0f')} | {stalls} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    records = rows(args.csv)
    print(table(records))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(records, fh, indent=1)
    return 0 if records else 1


if __name__ == "__main__":
    sys.exit(main())
