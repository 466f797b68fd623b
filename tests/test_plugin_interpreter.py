"""Import order on a machine without CUDA: ``import torchrec`` before the plugin imports Triton before
TRITON_INTERPRET=1 is set; the plugin must say so at import instead of failing at the first launch."""

import os
import subprocess
import sys

import torch


def test_triton_imported_first_core_module():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", "import triton; import torchrec_triton_tbe"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    if torch.cuda.is_available():
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode != 0 and "ImportError" in proc.stderr and "before torchrec" in proc.stderr


def test_torchrec_imported_first():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", "import torchrec; import torchrec_triton_tbe.plugin"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    if torch.cuda.is_available():
        assert proc.returncode == 0, proc.stderr  # compiled kernels: any order works
    else:
        assert proc.returncode != 0
        assert "ImportError" in proc.stderr and "before torchrec" in proc.stderr, proc.stderr[-2000:]
