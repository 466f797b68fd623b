"""tools/perf_spread.py: runs of one setting group by file name, and the spread is their min / median /
max per shape and pass (ours and FBGEMM's)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import perf_spread  # noqa: E402


def _bench_json(path: Path, ours: float, fbgemm: float, host: dict | None = None) -> str:
    x = {"triton": {"median_ms": ours}, "fbgemm": {"median_ms": fbgemm}}
    for who, ms in (host or {}).items():
        x[who]["host_median_ms"] = ms
    shape = {"name": "mixed", "results": {"fwd": x}}
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


def test_reports_the_median_host_issue_time_where_recorded(tmp_path, capsys):
    files = [_bench_json(tmp_path / f"st4_{i}.json", 0.3, 0.32, {"triton": h, "fbgemm": 0.2})
             for i, h in ((1, 0.25), (2, 0.21), (3, 0.29))]
    files.append(_bench_json(tmp_path / "st1_1.json", 0.31, 0.32))  # written before host_median_ms
    rows = perf_spread.spread(files)
    assert rows[("st4", "mixed", "fwd")]["triton_host"] == [0.25, 0.21, 0.29]
    perf_spread.main(files)
    out = capsys.readouterr().out
    assert "| st4 | mixed | fwd | 3 | 0.300 / 0.300 / 0.300 | 0.320 / 0.320 / 0.320 | 0.250 / 0.200 |" in out
    assert "| st1 | mixed | fwd | 1 | 0.310 / 0.310 / 0.310 | 0.320 / 0.320 / 0.320 | — / — |" in out
