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


def _check_import_order() -> None:
    """Triton fixes interpreted-or-compiled per function when it is decorated. If Triton was imported
    (``import torchrec`` does it) before TRITON_INTERPRET=1 was set, its own library (``tl.sum``, ...)
    stays compiled-mode and every kernel would fail at its first launch with "Cannot call @triton.jit'd
    outside of the scope of a kernel". Say so at import, with the fix."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(standard.sum, InterpretedFunction):
        raise ImportError(
            "torchrec_triton_tbe: Triton was imported (e.g. by `import torchrec`) before TRITON_INTERPRET=1 was "
            "set, so its kernels cannot run under Triton's interpreter on this machine without CUDA. Import "
            "torchrec_triton_tbe (or torchrec_triton_tbe.plugin) before torchrec, or export TRITON_INTERPRET=1."
        )


_check_import_order()


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
