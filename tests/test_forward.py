"""Pooled forward against FBGEMM's CPU TBE (and the pure-PyTorch reference where FBGEMM's CPU TBE
lacks the combination): SUM/MEAN x weighted x weights dtype x output dtype x index dtype, mixed D,
shared tables, empty bags."""

import itertools

import pytest
import torch

from tbe_cases import (
    DTYPE,
    PoolingMode,
    SparseType,
    assert_close,
    fbgemm_supports,
    make_pair,
    oracle_step,
    skewed_batch,
    tolerance,
)

SPECS = [(40, 8), (30, 12), (25, 16), (9, 4)]  # BLOCK_D buckets 4, 8 and 16; width 12 is not a power of 2
# (FBGEMM requires D % 4 == 0; other widths are checked against the reference in test_properties.py.)
FTM = [0, 1, 1, 2, 3]

CASES = list(
    itertools.product(
        [PoolingMode.SUM, PoolingMode.MEAN],
        [False, True],
        [SparseType.FP32, SparseType.FP16, SparseType.BF16],
        [SparseType.FP32, SparseType.FP16, SparseType.BF16],
        [torch.int64, torch.int32],
    )
)


@pytest.mark.parametrize(
    "pooling,weighted,weights,output,index_dtype",
    CASES,
    ids=[f"{p.name}-{'w' if w else 'u'}-{a.name}-{b.name}-{str(i)[6:]}" for p, w, a, b, i in CASES],
)
def test_forward_matches_oracle(pooling, weighted, weights, output, index_dtype):
    oracle = "fbgemm" if fbgemm_supports(weights, output, pooling, weighted, FTM) else "reference"
    ours, other = make_pair(
        SPECS, FTM, oracle=oracle, pooling_mode=pooling, weights_precision=weights, output_dtype=output,
        embedding_table_index_type=index_dtype, embedding_table_offset_type=index_dtype,
    )
    g = torch.Generator().manual_seed(7)
    batch = skewed_batch([r for r, _ in SPECS], FTM, B=4, max_L=5, generator=g, weighted=weighted,
                         index_dtype=index_dtype)
    with torch.no_grad():
        out = ours(batch.indices, batch.offsets, batch.per_sample_weights)
    assert out.dtype == DTYPE[output]
    assert out.shape == (4, sum(SPECS[k][1] for k in FTM))
    if oracle == "fbgemm":
        with torch.no_grad():
            expected = other(batch.indices.clone(), batch.offsets.clone(), batch.per_sample_weights)
    else:
        expected = other.output(other.forward(batch.indices, batch.offsets, batch.per_sample_weights)).detach()
    assert_close(out, expected, f"[{oracle}] forward", **tolerance(DTYPE[weights], DTYPE[output]))


@pytest.mark.parametrize("pooling", [PoolingMode.SUM, PoolingMode.MEAN])
def test_empty_bags_pool_to_zero(pooling):
    ours, _ = make_pair([(10, 6)], oracle="reference", pooling_mode=pooling)
    indices = torch.tensor([1, 2, 3])
    offsets = torch.tensor([0, 0, 3, 3])  # bags 0 and 2 are empty
    out = ours(indices, offsets)
    assert torch.equal(out[0], torch.zeros(6)) and torch.equal(out[2], torch.zeros(6))
    w = ours.split_embedding_weights()[0]
    expected = w[1:4].sum(0) / (3 if pooling == PoolingMode.MEAN else 1)
    assert_close(out[1], expected, "bag 1", atol=1e-6, rtol=1e-6)


def test_empty_batch_and_no_lookups():
    ours, _ = make_pair([(10, 8), (5, 4)], oracle="reference")
    out = ours(torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    assert out.shape == (0, 12)
    out = ours(torch.zeros(0, dtype=torch.int64), torch.zeros(7, dtype=torch.int64))  # B=3, all bags empty
    assert out.shape == (3, 12) and torch.equal(out, torch.zeros(3, 12))
    out.sum().backward()  # nothing to update, must not fail


def test_output_columns_follow_feature_order():
    # Feature t's columns are [D_offsets[t], D_offsets[t+1]) and features may share a table.
    ours, _ = make_pair([(6, 4), (6, 2)], [1, 0, 1], oracle="reference")
    w0, w1 = ours.split_embedding_weights()
    indices = torch.tensor([5, 0, 3])
    offsets = torch.tensor([0, 1, 2, 3])  # B=1
    out = ours(indices, offsets)[0]
    assert_close(out, torch.cat([w1[5], w0[0], w1[3]]), "columns", atol=0, rtol=0)


def test_forward_positional_order_is_fbgemms():
    ours, _ = make_pair([(10, 4)], oracle="reference")
    indices, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3])
    psw = torch.tensor([1.0, 2.0, 0.5])
    a = ours(indices, offsets, psw, None, None, None)
    b = ours(indices=indices, offsets=offsets, per_sample_weights=psw)
    assert torch.equal(a, b)
