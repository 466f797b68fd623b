"""Every kernel specialization (tools/sanitize_cases.py) under compute-sanitizer's four tools; any
report fails. Run on the device machine: python -m pytest -q tests/gpu/test_gpu_sanitizer.py.

The cases run once without a sanitizer first, so Triton's compile cache is warm and the sanitized runs
only execute. Each tool's full output goes to $SANITIZER_LOG_DIR (default: the pytest tmp dir), and a
one-line summary per tool is appended to summary.txt there (docs/reliability.md quotes it)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tools" / "sanitize_cases.py"
SANITIZER = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
# initcheck: torch's caching allocator hands out blocks some of whose bytes no kernel ever writes (the
# rounding of each allocation); --track-unused-memory reports those as "unused", not as bad reads, so
# it stays off: reads of uninitialised memory are still errors.
TOOLS = {
    "memcheck": ["--leak-check", "no"],
    "racecheck": ["--racecheck-report", "all"],
    "synccheck": [],
    "initcheck": ["--track-unused-memory", "no"],
}


def _log_dir(tmp_path_factory) -> Path:
    d = os.environ.get("SANITIZER_LOG_DIR")
    path = Path(d) if d else tmp_path_factory.mktemp("sanitizer")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    if not Path(SANITIZER).exists():
        pytest.skip("compute-sanitizer not found")
    path = _log_dir(tmp_path_factory)
    warm = subprocess.run([sys.executable, str(DRIVER)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    (path / "plain.txt").write_text(warm.stdout + warm.stderr)
    assert warm.returncode == 0, warm.stdout[-2000:] + warm.stderr[-4000:]
    return path


@pytest.mark.parametrize("tool", list(TOOLS))
def test_no_sanitizer_reports(tool, log_dir):
    cmd = [SANITIZER, "--tool", tool, *TOOLS[tool], "--error-exitcode", "99", "--print-limit", "50",
           sys.executable, str(DRIVER)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    out = proc.stdout + proc.stderr
    (log_dir / f"{tool}.txt").write_text(out)
    summary = re.findall(r"=+ (?:ERROR|RACECHECK) SUMMARY: .*", out)
    cases = re.search(r"sanitize_cases: (\d+) cases done", out)
    with open(log_dir / "summary.txt", "a") as f:
        f.write(f"{tool}: rc={proc.returncode} cases={cases.group(1) if cases else '?'} "
                f"{'; '.join(s.strip('= ') for s in summary) or 'no summary line'}\n")
    assert cases, f"{tool}: the driver did not finish\n{out[-4000:]}"
    counts = [int(n) for line in summary for n in re.findall(r"(\d+) (?:errors?|hazards?|warnings?)", line)]
    assert proc.returncode == 0 and summary and counts and not any(counts), out[-6000:]
