"""The module-level demo (python -m torchrec_triton_tbe.demo) runs on the CPU and its table shows
TritonTBE and FBGEMM's CPU TBE agreeing, with both backward paths used."""

import re

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
