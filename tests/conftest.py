import os

import torch

import torchrec_triton_tbe  # noqa: F401  (sets TRITON_INTERPRET=1 on CPU-only machines first)

# GPU test scripts (tests/gpu) run on the device machine: `python -m pytest tests/gpu`.
collect_ignore_glob = [] if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else ["gpu/*"]
