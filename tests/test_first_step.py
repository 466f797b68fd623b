"""tools/first_step.py (where a cold first step's compile time goes) on a small suite shape: it records
one training step's kernel specializations on CPU tensors and compiles each for sm_90, serially and in
worker processes, and the report accounts for every one of them."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_first_step_records_and_compiles_the_steps_specializations(tmp_path):
    report = tmp_path / "first_step.json"
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "first_step.py"), "--shape", "dlrm_t26_l1", "--rows-scale", "0.001",
         "--workers", "1,2", "--json", str(report)],
        env=env, capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(report.read_text())
    n = data["specializations"]
    kernels = set(data["passes"][0]["by_kernel"])
    # A pooled forward, the backward's short path and its run metadata, at least.
    assert {"_pooled_forward_kernel", "_backward_short_kernel", "_linearize_kernel", "_run_flags_kernel"} <= kernels
    assert [p["workers"] for p in data["passes"]] == [1, 2]
    for p in data["passes"]:
        assert sum(v["specializations"] for v in p["by_kernel"].values()) == n
        assert p["wall_seconds"] > 0 and p["sum_of_compiles_seconds"] > 0
    assert data["step"]["lookups"] == 26 * 65536  # one id per bag
    assert f"{n} specializations for sm_90" in proc.stdout


def test_first_step_refuses_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "first_step.py")], env=env, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "TRITON_INTERPRET=0" in proc.stderr
