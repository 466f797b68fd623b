"""tools/ncu_table.py: an Nsight Compute raw CSV (header row, units row, one row per launch) becomes one
line per launch, with durations in µs and DRAM bytes in MB from the units row, and the two largest
stall reasons."""

import csv
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import ncu_table  # noqa: E402

HEADER = ["ID", "Kernel Name", "gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
          "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", "sm__warps_active.avg.pct_of_peak_sustained_active",
          "launch__registers_per_thread", "launch__grid_size", "launch__block_size",
          "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
          "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
          "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
          "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio"]
UNITS = ["", "", "us", "Gbyte", "Mbyte", "%", "%", "register/thread", "", "", "inst", "inst", "inst", "inst"]


def _write(path: Path, rows) -> str:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(HEADER)
        w.writerow(UNITS)
        w.writerows(rows)
    return str(path)


def test_converts_units_and_ranks_stalls(tmp_path, capsys):
    path = _write(tmp_path / "r.csv", [
        ["0", "_backward_long_partials_kernel", "212.5", "0.69", "5.5", "61.2", "48.0", "64", "4224", "32",
         "12.5", "0.1", "2.0", "1.0"],
        ["1", "void split_embedding_backward_codegen_rowwise_adagrad_unweighted_kernel_cta_per_row_1<c10::Half>(x)",
         "1,262.0", "1.1", "300", "70", "30", "128", "2048", "256", "8.0", "9.0", "n/a", "1.0"],
    ])
    recs = ncu_table.rows(path)
    assert recs[0]["us"] == pytest.approx(212.5) and recs[1]["us"] == pytest.approx(1262.0)
    assert ncu_table._TIME["nsecond"] == ncu_table._TIME["ns"] == 1e-3  # both spellings of the units row
    assert recs[0]["dram_read_MB"] == pytest.approx(690.0) and recs[0]["dram_write_MB"] == pytest.approx(5.5)
    assert recs[0]["stalls"] == [("long_scoreboard", 12.5), ("wait", 2.0)]  # "selected" (1.0) is no stall
    assert recs[1]["stalls"] == [("barrier", 9.0), ("long_scoreboard", 8.0)]  # "n/a" is skipped
    assert ncu_table.main([path]) == 0
    out = capsys.readouterr().out
    assert "| _backward_long_partials_kernel | 212.5 | 690.0 / 5.5 | 61 | 48 (-) | 64 | 4224 x 32 |" in out
    # Long names lose their "void ", their argument list, and what passes 48 characters.
    assert "| " + "split_embedding_backward_codegen_rowwise_adagrad_unweighted"[:45] + "... | 1262.0 |" in out


def test_rejects_a_csv_without_kernel_names(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("a,b\nx,y\n1,2\n")
    with pytest.raises(ValueError, match="Kernel Name"):
        ncu_table.rows(str(path))
