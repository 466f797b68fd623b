"""The module-level demo (python -m torchrec_triton_tbe.demo) runs on the CPU and its table shows
TritonTBE and FBGEMM's CPU TBE agreeing, with both backward paths used."""

import math
import re

import torch

from torchrec_triton_tbe import demo


def test_demo_runs_and_agrees(capsys):
    assert demo.main(["--steps", "2", "--batch-size", "6", "--num-embeddings", "40", "--embedding-dim", "8"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+\d+\s+\d+\s", line)]
    assert len(rows) == 2
    for row in rows:
        d_out, d_w, d_state = (float(x) for x in row[2:5])
        assert d_out < 1e-5 and d_w < 1e-5 and d_state < 1e-3
        short, long_runs = int(row[6]), int(row[7])
        assert short > 0 and long_runs > 0


def test_a_difference_gone_nan_prints_nan_in_any_argument_order():
    """Python's max() keeps or drops a NaN by argument order; the demo's columns must show it."""
    nan, one = torch.tensor([float("nan"), 1.0]), torch.tensor([0.5, 1.0])
    for pairs in ([(one, one), (nan, one)], [(nan, one), (one, one)], [(one, nan)]):
        assert math.isnan(demo._max_abs_diff(pairs))
    assert demo._max_abs_diff([(one, one + 0.25)]) == 0.25
    assert demo._max_abs_diff([]) == 0.0
