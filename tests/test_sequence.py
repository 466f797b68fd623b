"""PoolingMode.NONE (sequence embeddings, kernels/sequence.py and the nobag backward): one output row per
lookup, FBGEMM's [N, D] layout, each row's gradient to the row it came from, one optimizer step per
table row. Oracles: FBGEMM's CPU TBE (SGD, Adagrad, row-wise Adagrad; fp32 / fp16) and the reference
(bf16, the other optimizers)."""

import pytest
import torch

from tbe_cases import EmbOptimType, PoolingMode, SparseType, assert_close, make_pair, skewed_batch
from test_backward import train_and_compare
from torchrec_triton_tbe.config import KnobTable, load_named
from torchrec_triton_tbe.module import TritonTBE

SPECS = [(40, 8), (30, 8), (25, 8)]  # one D: FBGEMM's sequence kernels require it
FTM = [0, 1, 1, 2]
NONE = PoolingMode.NONE

CASES = [
    (EmbOptimType.EXACT_SGD, SparseType.FP32, torch.int64, True),
    (EmbOptimType.EXACT_ROWWISE_ADAGRAD, SparseType.FP16, torch.int32, True),
    (EmbOptimType.EXACT_ADAGRAD, SparseType.FP32, torch.int32, True),
    (EmbOptimType.EXACT_ROWWISE_ADAGRAD, SparseType.BF16, torch.int64, False),
    (EmbOptimType.ADAM, SparseType.FP16, torch.int64, False),
    (EmbOptimType.PARTIAL_ROWWISE_LAMB, SparseType.FP32, torch.int32, False),
]


@pytest.mark.parametrize("optimizer,weights,index_dtype,fbgemm_cpu", CASES,
                         ids=[f"{o.name}-{w.name}-{str(i)[6:]}" for o, w, i, _ in CASES])
def test_training_matches_oracle(optimizer, weights, index_dtype, fbgemm_cpu):
    ours, oracle = train_and_compare(SPECS, FTM, NONE, False, weights, optimizer, index_dtype, fbgemm_cpu=fbgemm_cpu)
    assert ours.spec.nobag and (oracle == "fbgemm") == (fbgemm_cpu and weights != SparseType.BF16)


def test_output_layout_and_lookups_outside_every_bag():
    """[N, D], row p the row lookup p names; lookups before offsets[0] / after offsets[-1] are zeros
    (bounds check NONE: WARNING / IGNORE would set offsets[-1] = N, as FBGEMM does)."""
    from torchrec_triton_tbe._fbgemm import BoundsCheckMode

    ours, ref = make_pair(SPECS, FTM, oracle="reference", pooling_mode=NONE, bounds_check_mode=BoundsCheckMode.NONE)
    indices = torch.tensor([7, 3, 3, 1, 0, 29, 5, 2, 24, 9])
    offsets = torch.tensor([1, 2, 2, 4, 6, 7, 8, 9, 9])  # B=2; positions 0 and 9 in no bag
    out = ours.forward(indices, offsets)
    assert out.shape == (10, 8)
    expected = ref.forward(indices, offsets).float()
    assert_close(out, expected, "sequence output", atol=0, rtol=0)
    assert torch.equal(out[0], torch.zeros(8)) and torch.equal(out[9], torch.zeros(8))
    w = ours.split_embedding_weights()
    assert torch.equal(out[4], w[1][0]) and torch.equal(out[8], w[2][24])


@pytest.mark.parametrize("features", [1, 2, 3])
def test_few_features_and_lookups_outside_every_bag(features):
    """One to three features, the feature search's two steps (kernels/sequence.py: a lookup is live while it lies
    before the last feature's end, offsets[T*B]); lookups before offsets[0] and past offsets[-1] are zeros."""
    from torchrec_triton_tbe._fbgemm import BoundsCheckMode

    specs, ftm = [(30, 8)] * features, list(range(features))
    ours, ref = make_pair(specs, ftm, oracle="reference", pooling_mode=NONE, bounds_check_mode=BoundsCheckMode.NONE)
    B = 2
    lengths = torch.tensor([1, 2, 0, 3, 2, 1])[: features * B]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]) + 1  # position 0 in no bag
    n = int(offsets[-1]) + 2  # the last two in no bag
    indices = torch.arange(n) * 7 % 30
    out = ours.forward(indices, offsets)
    assert out.shape == (n, 8)
    assert_close(out, ref.forward(indices, offsets).float(), f"sequence output, {features} features", atol=0, rtol=0)
    assert not out[0].any() and not out[-2:].any() and out[1:-2].abs().sum(1).gt(0).all()


def test_gradient_reaches_exactly_its_row():
    ours, _ = make_pair([(6, 4)], oracle="reference", optimizer=EmbOptimType.EXACT_SGD, learning_rate=1.0,
                        pooling_mode=NONE)
    before = ours.split_embedding_weights()[0].clone()
    indices, offsets = torch.tensor([2, 5, 2]), torch.tensor([0, 1, 3])
    grad = torch.arange(12, dtype=torch.float32).view(3, 4)
    ours(indices, offsets).backward(grad)
    after = ours.split_embedding_weights()[0]
    assert_close(before - after, torch.stack([torch.zeros(4), torch.zeros(4), grad[0] + grad[2], torch.zeros(4),
                                              torch.zeros(4), grad[1]]), "row updates", atol=1e-6, rtol=0)


def test_routing_knobs_change_nothing():
    base = load_named("interpreter")
    results = []
    for cfg in (base.replace_backward(short_threshold=10**9),
                base.replace_backward(short_threshold=1, long_chunk=2, tile=KnobTable(8), programs=3),
                base.replace_forward(sequence_block=8).replace_backward(long_path="fused", short_threshold=3)):
        ours, _ = make_pair(SPECS, FTM, oracle="reference", seed=2, kernel_config=cfg, pooling_mode=NONE,
                            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.3)
        g = torch.Generator().manual_seed(3)
        for _ in range(2):
            batch = skewed_batch([r for r, _ in SPECS], FTM, B=4, max_L=6, generator=g, hot_fraction=0.5)
            out = ours(batch.indices, batch.offsets)
            out.backward(torch.randn(out.shape, generator=g))
        results.append([w.clone() for w in ours.split_embedding_weights()] + [ours.momentum1.clone()])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert_close(a, b, "routing", atol=2e-6, rtol=2e-6)


def test_hoisted_transpose_and_fused_bounds_check_change_nothing():
    results = []
    for hoist, fused in [(False, False), (True, True)]:
        ours, _ = make_pair(SPECS, FTM, oracle="reference", seed=5, pooling_mode=NONE, hoist_transpose=hoist,
                            fused_bounds_check=fused, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
        g = torch.Generator().manual_seed(6)
        batch = skewed_batch([r for r, _ in SPECS], FTM, B=4, max_L=6, generator=g)
        out = ours(batch.indices, batch.offsets)
        out.backward(torch.randn(out.shape, generator=g))
        results.append([w.clone() for w in ours.split_embedding_weights()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_bounds_check_repairs_sequence_ids_like_fbgemm():
    from torchrec_triton_tbe._fbgemm import BoundsCheckMode

    ours, fb = make_pair(SPECS, FTM, oracle="fbgemm", pooling_mode=NONE, bounds_check_mode=BoundsCheckMode.WARNING)
    indices = torch.tensor([1, 45, 2, 99, 3, 4, 30, 5])  # not -1: FBGEMM passes -1 through as "pruned"
    offsets = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8])
    assert_close(ours(indices.clone(), offsets.clone()), fb(indices.clone(), offsets.clone()), "repaired", 0, 0)
    assert int(ours.bounds_check_warning) == 3


@pytest.mark.parametrize(
    "kwargs,call,match",
    [
        (dict(), dict(per_sample_weights=torch.ones(2)), "per_sample_weights"),
    ],
)
def test_bad_sequence_input(kwargs, call, match):
    m = TritonTBE(SPECS, feature_table_map=FTM, device="cpu", pooling_mode=NONE, **kwargs)
    before = m.weights.clone()
    with pytest.raises(ValueError, match=match):
        m(torch.tensor([1, 2]), torch.tensor([0, 1, 1, 2, 2]), **call)
    assert torch.equal(m.weights, before)


def test_mixed_dims_are_refused_like_fbgemm():
    with pytest.raises(ValueError, match="one embedding dim"):
        TritonTBE([(10, 8), (10, 16)], device="cpu", pooling_mode=NONE)
