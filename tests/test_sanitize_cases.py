"""tools/sanitize_cases.py, the driver tests/gpu/test_gpu_sanitizer.py runs under compute-sanitizer:
its case list covers what docs/reliability.md says it covers, and two of its cases run here under
Triton's interpreter (the whole list runs on the GPU)."""

import importlib.util
import sys
from pathlib import Path

from torchrec_triton_tbe._fbgemm import PoolingMode

_spec = importlib.util.spec_from_file_location("sanitize_cases", Path(__file__).parents[1] / "tools" / "sanitize_cases.py")
sanitize_cases = importlib.util.module_from_spec(_spec)
sys.modules["sanitize_cases"] = sanitize_cases  # its dataclass looks its module up there
_spec.loader.exec_module(sanitize_cases)


def test_case_list_covers_every_specialization_family():
    cases = sanitize_cases._cases()
    assert len({c.name for c in cases}) == len(cases)
    assert {c.optimizer for c in cases} == set(sanitize_cases.OPTIMIZERS)
    assert {c.pooling for c in cases} == {PoolingMode.SUM, PoolingMode.MEAN, PoolingMode.NONE}
    assert {c.long_path for c in cases} == {None, "split", "fused"}
    for flag in ("weighted", "psw_grad", "fused_bounds_check", "hoist_transpose", "bad_ids", "graphs", "streams", "split_paths", "split_heaviest", "vbe",
                 "empty_tables"):
        assert any(getattr(c, flag) for c in cases), flag


def test_two_cases_run_on_the_interpreter(capsys):
    assert sanitize_cases.main(["--only", "fused-bounds-warning-bad-ids,bounds-fatal-bad-ids"]) == 0
    out = capsys.readouterr().out
    assert "fused-bounds-warning-bad-ids: ok warnings=" in out and "warnings=0" not in out
    assert "bounds-fatal-bad-ids: rejected (FATAL), nothing written" in out


def test_the_empty_table_cases_run_on_the_interpreter(capsys):
    """Tables of 0 rows read by features with ids (all out of range there): repaired, counted, and the
    zero row past the tables never written (the run asserts it)."""
    assert sanitize_cases.main(["--only", "empty-tables-bounds-warning,empty-tables-sequence-fused-warning,"
                                          "empty-tables-fused-ignore-weighted"]) == 0
    lines = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines() if ": " in line)
    for name in ("empty-tables-bounds-warning", "empty-tables-sequence-fused-warning"):  # WARNING counts them
        assert lines[name].startswith("ok warnings=") and lines[name] != "ok warnings=0", lines[name]
    assert lines["empty-tables-fused-ignore-weighted"] == "ok warnings=0"  # IGNORE does not
