"""tools/compile_specs.py --resources (torchrec_triton_tbe/_resources.py): cuobjdump's resource line is parsed, a stack frame or local memory
counts as a spill, and the report names each spilling specialization and the most registers per kernel."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import compile_specs  # noqa: E402

from torchrec_triton_tbe import _resources  # noqa: E402

LINE = ("Resource usage:\n Common:\n  GLOBAL:0\n Function _backward_short_kernel:\n"
        "  REG:{reg} STACK:{stack} SHARED:1024 LOCAL:{local} CONSTANT[0]:720 TEXTURE:0 SURFACE:0 SAMPLER:0\n")


def _row(kernel, reg, stack=0, local=0, **key):
    usage = _resources.parse(LINE.format(reg=reg, stack=stack, local=local))
    return {"kernel": kernel, "target": 90, "num_warps": 1, "key": key, "usage": usage}


def test_parses_the_resource_line():
    assert _resources.parse(LINE.format(reg=147, stack=0, local=0)) == {
        "registers": 147, "stack": 0, "shared": 1024, "local": 0}
    with pytest.raises(ValueError, match="no resource line"):
        _resources.parse("cuobjdump info    : File 'x.cubin' does not contain device code")


def test_report_names_spills_and_the_most_registers_per_kernel():
    rows = [_row("_backward_short_kernel", 255, stack=72, BLOCK_D=32, TILE=16),
            _row("_backward_short_kernel", 147, BLOCK_D=128, TILE=8),
            _row("_linearize_kernel", 40, local=16),
            _row("_run_flags_kernel", 32)]
    assert [_resources.spills(r["usage"]) for r in rows] == [True, False, True, False]
    text = compile_specs.report(rows)
    assert ("SPILL sm_90 _backward_short_kernel {'BLOCK_D': 32, 'TILE': 16} warps=1: 255 registers, stack 72 B, "
            "local 0 B") in text
    assert "| _backward_short_kernel | 2 | 255 | 1 |" in text
    assert "| _run_flags_kernel | 1 | 32 | 0 |" in text
    assert text.endswith("2 of 4 specializations spill")
