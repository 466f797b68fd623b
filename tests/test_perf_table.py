"""tools/perf_table.py, the markdown summary of a GPU benchmark JSON: it refuses what it cannot summarise
(a CPU run, a run without FBGEMM) with a message, and a pass FBGEMM could not run shows as skipped,
outside the geo-means."""

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("perf_table", Path(__file__).parents[1] / "tools" / "perf_table.py")
perf_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(perf_table)


def _timing(ms: float) -> dict:
    return {"median_ms": ms, "gbps": 100.0}


def _record(vbe_skipped: bool) -> dict:
    def shape(name, fbgemm_bwd):
        bwd = {"triton": _timing(2.0), "fbgemm": fbgemm_bwd}
        if "median_ms" in fbgemm_bwd:
            bwd["speedup"] = fbgemm_bwd["median_ms"] / 2.0
        return {"name": name, "options": {"weights_precision": "fp16"}, "generator": {"unique_rows": 10},
                "Ds": [64], "lookups": 1000, "results": {
                    "fwd": {"triton": _timing(1.0), "fbgemm": _timing(1.5), "speedup": 1.5},
                    "bwd_exact_rowwise_adagrad": bwd}}
    skipped = {"skipped": "optimizer x with a variable batch"} if vbe_skipped else _timing(3.0)
    return {"timing_meaningful": True, "copy_bandwidth": {"gbps": 4000.0}, "compare": "fbgemm",
            "environment": {"gpu": {"name": "NVIDIA H200"}, "versions": {"fbgemm_gpu": {"version": "1.6.0"}},
                            "date": "2026-12-05T00:00:00", "git_commit": "abc"},
            "shapes": [shape("a", _timing(4.0)), shape("vbe", skipped)]}


def test_a_pass_fbgemm_skipped_shows_as_skipped_outside_the_geo_means(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_record(vbe_skipped=True)))
    perf_table.main(str(path))
    out = capsys.readouterr().out
    assert "backward (row-wise Adagrad) geo-mean 2.00×" in out  # shape a alone
    assert "| vbe | 0.00M | 1.000 | 1.500 | 1.50× | 100 | — | — | — | 2.000 | skipped | — | — | — |" in out


@pytest.mark.parametrize("change,match", [
    ({"timing_meaningful": False, "copy_bandwidth": None}, "not a GPU run"),
    ("no-fbgemm", "FBGEMM was not compared"),
])
def test_what_it_cannot_summarise_is_refused_with_a_message(tmp_path, change, match):
    record = _record(vbe_skipped=False)
    if change == "no-fbgemm":
        for s in record["shapes"]:
            for e in s["results"].values():
                e.pop("fbgemm"), e.pop("speedup")
    else:
        record.update(change)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(record))
    with pytest.raises(SystemExit, match=match):
        perf_table.main(str(path))
