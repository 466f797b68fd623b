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
# Full reports (no print limit, no host backtraces): every hazard is parsed, not just counted.
COMMON = ["--print-limit", "0", "--show-backtrace", "no"]
TOOLS = {
    "memcheck": ["--leak-check", "no"],
    "racecheck": ["--racecheck-report", "all"],
    "synccheck": [],
    "initcheck": [],
}
# The one racecheck pattern allowed, each occurrence still listed in summary.txt: Triton's warp
# reductions end in a butterfly shuffle, so the lanes of one group hold sums taken in different orders
# (bits may differ in the last place) and all write the group's one shared-memory slot in the same
# store; racecheck reports a WAW hazard between lanes of one warp (triton-lang/triton#7264, open). Any
# of those values is a correctly rounded-order sum, and the kernel's result is bitwise repeatable
# (tests/gpu/test_gpu_reliability.py compares the per-sample-weight gradient across runs). Allowed
# only for this kernel and line, and only between two lanes of the same warp.
BENIGN = {("_psw_grad_kernel", "psw_grad.py:72")}
HAZARD = re.compile(r"Potential (\w+) hazard detected at __shared__ \S+ in block \S+ :\n"
                    r"=+\s+(\w+) Thread \((\d+),(\d+),(\d+)\) at (\w+)\+\S+ in (\S+)\n"
                    r"=+\s+(\w+) Thread \((\d+),(\d+),(\d+)\) at (\w+)\+\S+ in (\S+)")


# racecheck also reports each launch's hazards per pair of instructions ("Race reported between ...
# [n hazards]"), one error each; those carry no thread ids: allowed for the same kernel and line when
# every hazard behind them (listed one by one above them) is.
RACE = re.compile(r"Race reported between (\w+) access at (\w+)\+\S+ in (\S+)\n"
                  r"=+\s+and (\w+) access at (\w+)\+\S+ in (\S+)")


def classify_hazards(out: str) -> tuple[int, list[str]]:
    """(benign butterfly hazards, every other hazard as a one-line description)."""
    benign, other = 0, []
    for m in RACE.finditer(out):
        a1, kernel1, where1, a2, kernel2, where2 = m.groups()
        if a1 == a2 == "Write" and (kernel1, where1) == (kernel2, where2) and (kernel1, where1) in BENIGN:
            benign += 1
        else:
            other.append(f"{a1}/{a2} {kernel1} {where1} / {kernel2} {where2}")
    for m in HAZARD.finditer(out):
        kind, t1, kernel1, where1, t2, kernel2, where2 = (m.group(1), int(m.group(3)), m.group(6), m.group(7),
                                                          int(m.group(9)), m.group(12), m.group(13))
        same_warp = t1 // 32 == t2 // 32 and m.group(4) == m.group(10) and m.group(5) == m.group(11)
        if kind == "WAW" and same_warp and (kernel1, where1) == (kernel2, where2) and (kernel1, where1) in BENIGN:
            benign += 1
        else:
            other.append(f"{kind} {kernel1} {where1} thread {t1} / {kernel2} {where2} thread {t2}")
    return benign, other


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
    cmd = [SANITIZER, "--tool", tool, *TOOLS[tool], *COMMON, sys.executable, str(DRIVER)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    out = proc.stdout + proc.stderr
    (log_dir / f"{tool}.txt").write_text(out)
    summary = re.findall(r"=+ (?:ERROR|RACECHECK) SUMMARY: .*", out)
    cases = re.search(r"sanitize_cases: (\d+) cases done", out)
    benign, other = classify_hazards(out) if tool == "racecheck" else (0, [])
    with open(log_dir / "summary.txt", "a") as f:
        f.write(f"{tool}: rc={proc.returncode} cases={cases.group(1) if cases else '?'} "
                f"{'; '.join(s.strip('= ') for s in summary) or 'no summary line'}"
                + (f"; benign butterfly WAW (triton#7264): {benign}, other hazards: {len(other)}" if tool == "racecheck"
                   else "") + "\n")
        f.writelines(f"  {line}\n" for line in sorted(set(other))[:50])
    assert proc.returncode == 0 and cases, f"{tool}: the driver did not finish\n{out[-4000:]}"
    assert summary, f"{tool}: no summary line\n{out[-4000:]}"
    if tool == "racecheck":
        reported = sum(int(n) for line in summary for n in re.findall(r"\((\d+) errors?, (\d+) warnings?\)", line)[0])
        assert not other and benign == reported, (benign, reported, sorted(set(other))[:20])
    else:
        counts = [int(n) for line in summary for n in re.findall(r"(\d+) errors?", line)]
        assert counts and not any(counts), out[-6000:]
