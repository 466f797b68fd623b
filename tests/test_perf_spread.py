"""tools/perf_spread.py: runs of one setting group by file name, and the spread is their min / median /
max per shape and pass (ours and FBGEMM's)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import perf_spread  # noqa: E402


def _bench_json(path: Path, ours: float, fbgemm: float) -> str:
    shape = {"name": "mixed", "results": {"fwd": {"triton": {"median_ms": ours}, "fbgemm": {"median_ms": fbgemm}}}}
    path.write_text(json.dumps({"shapes": [shape, {"name": "broken", "error": "out of memory"}]}))
    return str(path)


def test_groups_runs_by_setting_and_reports_their_spread(tmp_path, capsys):
    files = [_bench_json(tmp_path / f"st{n}_{i}.json", ours, 0.318)
             for n, i, ours in ((1, 1, 0.308), (1, 2, 0.307), (4, 1, 0.282), (4, 2, 0.477), (4, 3, 0.277))]
    rows = perf_spread.spread(files)
    assert set(rows) == {("st1", "mixed", "fwd"), ("st4", "mixed", "fwd")}
    assert sorted(rows[("st4", "mixed", "fwd")]["triton"]) == [0.277, 0.282, 0.477]
    perf_spread.main(files)
    out = capsys.readouterr().out
    assert "| st4 | mixed | fwd | 3 | 0.277 / 0.282 / 0.477 | 0.318 / 0.318 / 0.318 |" in out
    assert "| st1 | mixed | fwd | 2 | 0.307 / 0.307 / 0.308 |" in out
