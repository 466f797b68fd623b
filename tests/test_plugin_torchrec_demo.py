"""The README's A/B job (torchrec_triton_tbe.torchrec_demo) on a tiny size: it runs, prints one row per
step with both losses, and reports a match."""

import re

import plugin_cases  # noqa: F401  (imports the plugin before torchrec)
from torchrec_triton_tbe import torchrec_demo


def test_demo_ab_matches(capsys):
    rc = torchrec_demo.main(["--steps", "2", "--batch-size", "4", "--num-tables", "2", "--num-embeddings", "40",
                             "--sharding", "row_wise", "--index-dtype", "int32", "--hoist-transpose"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s+\d+\s", line)]
    assert [r[0] for r in rows] == ["0", "1"], out
    for _, loss_fused, loss_triton, *_ in rows:
        assert abs(float(loss_fused) - float(loss_triton)) < 1e-5, out
    assert "MATCH" in out and "MISMATCH" not in out


def test_demo_sequence_and_vbe_modes_match(capsys):
    """--sequence (an EmbeddingCollection beside the bags) and --vbe (variable batch per feature) together."""
    rc = torchrec_demo.main(["--steps", "2", "--batch-size", "4", "--num-tables", "2", "--num-embeddings", "40",
                             "--sequence", "--vbe"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "sequence_tables=1" in out and "vbe=" in out
    assert "MATCH" in out and "MISMATCH" not in out
