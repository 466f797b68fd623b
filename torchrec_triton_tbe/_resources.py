"""Registers, stack frame and local memory of a compiled kernel, read from its cubin with the cuobjdump
that Triton's wheel carries: no GPU and no torch needed (tools/compile_specs.py imports this module under
another Triton without the package's __init__). A stack frame or local memory is taken for spilled
registers (ptxas's usual reason for either; a call stack is the other), a speed hazard otherwise seen only on
the GPU."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

_USAGE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def parse(cuobjdump_output: str) -> dict:
    """{registers, stack, shared, local} of the one kernel in `cuobjdump --dump-resource-usage` output."""
    m = _USAGE.search(cuobjdump_output)
    if m is None:
        raise ValueError(f"no resource line in cuobjdump output: {cuobjdump_output[-300:]!r}")
    reg, stack, shared, local = (int(x) for x in m.groups())
    return {"registers": reg, "stack": stack, "shared": shared, "local": local}


def spills(usage: dict) -> bool:
    return usage["stack"] > 0 or usage["local"] > 0


def cubin_usage(cubin: bytes) -> dict:
    """``parse`` of the cubin's resource usage (cuobjdump from the installed Triton's NVIDIA backend)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.isfile(tool):
        raise FileNotFoundError(f"no cuobjdump at {tool}: this Triton's NVIDIA backend does not carry one")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        out = subprocess.run([tool, "--dump-resource-usage", fh.name], capture_output=True, text=True,
                             check=True).stdout
    return parse(out)
