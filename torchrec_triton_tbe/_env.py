"""Where the kernels run: compiled on a CUDA GPU, or under Triton's CPU interpreter.

Triton decides at ``@triton.jit`` decoration time whether a kernel is compiled or interpreted, from
``TRITON_INTERPRET``. This module is imported before any kernel is defined; on a machine without a
CUDA device it sets ``TRITON_INTERPRET=1`` so the package works on CPU tensors with no set-up. An
explicit ``TRITON_INTERPRET`` (``0`` or ``1``) is always respected, e.g. ``TRITON_INTERPRET=0`` to
compile kernels ahead of time for a GPU from a CPU machine (``python -m torchrec_triton_tbe.aot``).
"""

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


# Set by the ahead-of-time gate (aot.py) while it drives the module on CPU tensors with kernel
# launches replaced by a recorder: nothing executes, so compiled kernels and CPU tensors may meet.
RECORD_LAUNCHES = False


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(device: torch.device) -> None:
    """Kernels follow the mode chosen at import: CUDA tensors need compiled kernels, CPU tensors the
    interpreter. Mixing them would fail deep inside Triton; fail here with the fix instead."""
    if device.type == "cuda" and interpreting():
        raise RuntimeError(
            "torchrec_triton_tbe: CUDA tensors given while TRITON_INTERPRET=1; unset it to compile kernels"
        )
    if device.type == "cpu" and not interpreting() and not RECORD_LAUNCHES:
        raise RuntimeError(
            "torchrec_triton_tbe: CPU tensors need Triton's interpreter; set TRITON_INTERPRET=1 before "
            "importing torchrec_triton_tbe (it is set automatically when no CUDA device is present)"
        )
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"torchrec_triton_tbe: unsupported device {device}; use cuda (or cpu under the interpreter)")
