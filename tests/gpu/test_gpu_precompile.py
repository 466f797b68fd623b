"""TritonTBE.precompile on the GPU (issue 14's time to first step): in fresh processes with empty Triton
caches, a production-shaped module's first training step plain and after precompile. The precompiled
step must compile nothing (every launch finds its kernel in launch's cache) and train bit for bit as
the plain one, and its worker processes must have compiled what the JIT then found in its cache. The
times are printed and, with $PRECOMPILE_LOG_DIR set, written there as JSON (for docs/performance.md);
they are measurements, not assertions."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _cold(mode: str, shape: str, tmp: Path) -> dict:
    out = tmp / f"{shape}_{mode}.json"
    env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix=f"cold_{mode}_", dir=tmp))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "first_step.py"), "--cold-step", mode, "--shape", shape,
         "--rows-scale", "0.1", "--workers", str(len(os.sched_getaffinity(0))), "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("shape", ["prod_t40_b16k", "dlrm_t26_l1"])
def test_precompiled_first_step_compiles_nothing_and_trains_alike(shape, tmp_path):
    plain = _cold("plain", shape, tmp_path)
    pre = _cold("precompiled", shape, tmp_path)
    print(json.dumps({"plain": plain, "precompiled": pre}))
    log_dir = os.environ.get("PRECOMPILE_LOG_DIR")
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        (Path(log_dir) / f"{shape}.json").write_text(json.dumps({"plain": plain, "precompiled": pre}, indent=1))
    assert plain["compiled_during_step"] > 0, "the plain cold step compiled nothing: the comparison shows nothing"
    assert pre["compiled_during_step"] == 0, pre
    assert pre["precompile"]["specializations"] > 0 and pre["precompile"]["compiled"]
    # The worker processes compiled exactly what the JIT then looked up: the load phase compiled
    # nothing itself (specializations Triton's JIT shares, under two of launch's finer keys, load once).
    assert pre["precompile"]["pool"] == "process" and pre["precompile"]["worker_errors"] == []
    report = pre["precompile"]
    assert report["load_compiles"] == 0 < report["cache_hits"], (report["load_compiled"], report["cache_hits"])
    assert plain["iter"] == pre["iter"] == pre["iter_expected"], (plain["iter"], pre["iter"])
    assert plain["weights_sum"] == pre["weights_sum"], (plain["weights_sum"], pre["weights_sum"])
