"""Import order on a machine without CUDA: ``import torchrec`` before the plugin imports Triton before
TRITON_INTERPRET=1 is set; the plugin must say so at import instead of failing at the first launch."""

import os
import subprocess
import sys

import pytest
import torch


@pytest.mark.parametrize(
    "imports", ["import triton; import torchrec_triton_tbe", "import torchrec; import torchrec_triton_tbe.plugin"]
)
def test_triton_imported_first(imports):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", imports], env=env, capture_output=True, text=True, timeout=300)
    if torch.cuda.is_available():
        assert proc.returncode == 0, proc.stderr  # compiled kernels: any order works
    else:
        assert proc.returncode != 0
        assert "ImportError" in proc.stderr and "before torchrec" in proc.stderr, proc.stderr[-2000:]
