"""tools/forward_grouped.py (the one-launch forward against the bucket launches and FBGEMM) as a dry run
on the CPU: every variant is checked against FBGEMM's output before it is timed, and the row says how
many bucket launches the one launch stands for."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_forward_grouped_checks_and_times_every_variant(tmp_path):
    report = tmp_path / "grouped.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "forward_grouped.py"), "--suite", "smoke", "--config", "interpreter",
         "--device", "cpu", "--iters", "1", "--runs", "mixed_weighted_int32:6", "--widths", "16,32",
         "--json", str(report)],
        env=env, capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads(report.read_text())["runs"]
    variants = {"per_bucket", "one_launch_w16", "one_launch_w32"}
    assert set(row["check"]) == variants and all(c["ok"] for c in row["check"].values()), row["check"]
    assert set(row["ms"]) == variants | {"fbgemm_first", "fbgemm_last"}
    assert all(ms > 0 for ms in row["ms"].values())
    assert row["batch"] == 6 and row["buckets"] == 2
    assert "| mixed_weighted_int32 | 6 |" in proc.stdout and "| ok |" in proc.stdout
