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
    for flag in ("weighted", "psw_grad", "fused_bounds_check", "hoist_transpose", "bad_ids", "graphs", "streams", "split_paths", "split_heaviest", "vbe"):
        assert any(getattr(c, flag) for c in cases), flag


def test_two_cases_run_on_the_interpreter(capsys):
    assert sanitize_cases.main(["--only", "fused-bounds-warning-bad-ids,bounds-fatal-bad-ids"]) == 0
    out = capsys.readouterr().out
    assert "fused-bounds-warning-bad-ids: ok warnings=" in out and "warnings=0" not in out
    assert "bounds-fatal-bad-ids: rejected (FATAL), nothing written" in out
