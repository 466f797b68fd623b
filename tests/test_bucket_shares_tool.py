"""tools/bucket_shares.py: the D-bucket shares of a suite shape, from its table list."""

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("bucket_shares", Path(__file__).parents[1] / "tools" / "bucket_shares.py")
bucket_shares = importlib.util.module_from_spec(_spec)
sys.modules["bucket_shares"] = bucket_shares
_spec.loader.exec_module(bucket_shares)


def test_production_shape_shares_add_up_and_follow_round_robin():
    r = bucket_shares.shares("prod_t40_b16k", "sm90")
    B, rows, dims, bags = bucket_shares.shape_tables("prod_t40_b16k")
    assert r["lookups"] == B * sum(bags) == 15_220_736  # the suite JSON's lookup count
    assert [b["block_d"] for b in r["buckets"]] == [4, 8, 16, 32, 64, 128, 256]
    assert sum(b["lookups"] for b in r["buckets"]) == r["lookups"]
    assert sum(b["lookup_share"] for b in r["buckets"]) == pytest.approx(1.0)
    assert sum(b["grad_byte_share"] for b in r["buckets"]) == pytest.approx(1.0)
    assert [b["stream"] for b in r["buckets"]] == [0, 1, 2, 3, 0, 1, 2]  # sm90: 4 backward streams
    # the update cannot beat its heaviest bucket: the busiest stream carries at least that
    assert r["busiest_stream_share"] >= r["heaviest_bucket_share"] > 0.4
    assert not r["grouped_applies"] and 0.5 < r["slice_column_use"] < 1.0


def test_one_bucket_shape_and_the_small_batch_forward():
    r = bucket_shares.shares("dlrm_t26_l1", "sm90")
    assert len(r["buckets"]) == 1 and r["busiest_stream_share"] == pytest.approx(1.0)
    assert r["slice_column_use"] == pytest.approx(1.0)  # D = 128: two full 64-wide slices
    r = bucket_shares.shares("prod_t100_b2k", "sm90")
    assert r["grouped_applies"]
    # narrow features on 16- and 32-wide tiles (forward.grouped_narrow) fill more columns than 64-wide slices
    B, _, dims, bags = bucket_shares.shape_tables("prod_t100_b2k")
    sliced = sum(b * d for b, d in zip(bags, dims)) / sum(b * -(-d // 64) * 64 for b, d in zip(bags, dims))
    assert sliced < 0.7 < r["slice_column_use"] < 1.0


def test_cli_prints_a_table_and_refuses_vbe(capsys, tmp_path):
    assert bucket_shares.main(["--shape", "prod_t40_b4k", "--json", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    assert "| 128 | 10 |" in out and "busiest stream" in out and (tmp_path / "s.json").exists()
    with pytest.raises(ValueError, match="variable batch"):
        bucket_shares.shares("vbe_t16_b1k_64k")
    with pytest.raises(ValueError, match="no shape"):
        bucket_shares.shares("no_such_shape")
