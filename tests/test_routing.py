"""Knobs change speed, never results: the short/long threshold, the long-run chunk, the tile (the
long path's own tile and warps too, and its apply's), the persistent grid size and the forward's gather
width and bags per program all give the same weights (to fp32 rounding: split-K sums in another order);
repeated runs are bitwise identical."""

import pytest
import torch

from tbe_cases import EmbOptimType, PoolingMode, SparseType, assert_close, make_pair, skewed_batch
from torchrec_triton_tbe.config import KnobTable, load_named

SPECS = [(30, 8), (20, 12)]
FTM = [0, 1, 1]
BASE = load_named("interpreter")

ROUTINGS = {
    "all-short": BASE.replace_backward(short_threshold=10**9),
    "mixed": BASE.replace_backward(short_threshold=4, long_chunk=3),
    "all-long": BASE.replace_backward(short_threshold=1, long_chunk=4),
    "chunk-1": BASE.replace_backward(short_threshold=1, long_chunk=1),
    "wide-tile": BASE.replace_backward(short_threshold=6, long_chunk=5, tile=KnobTable(8), programs=3),
    "forward-knobs": BASE.replace_forward(bags_per_program=1, gather=KnobTable(1)),
    "mixed-fused-long": BASE.replace_backward(short_threshold=4, long_chunk=3, long_path="fused"),
    "all-long-fused": BASE.replace_backward(short_threshold=1, long_chunk=4, long_path="fused", programs=3),
    # The long path's own tile and warps (backward.long_tile / long_warps), on both schedules.
    "long-knobs": BASE.replace_backward(short_threshold=4, long_chunk=5, long_tile=KnobTable(8), long_warps=KnobTable(2)),
    "long-knobs-fused": BASE.replace_backward(short_threshold=4, long_chunk=5, long_path="fused",
                                              long_tile=KnobTable(1, ((16, 8),)), long_warps=KnobTable(2)),
    # The apply's own tile (8, the long path's being 4: the fused kernel must sum with it too) and its scan of
    # several chunks per step (backward.apply_*): one-lookup chunks, so a scanned block holds several runs'
    # first chunks and a run spans blocks of two programs. (Warps: the interpreter has none.)
    "apply-knobs": BASE.replace_backward(short_threshold=1, long_chunk=1, programs=2, apply_tile=KnobTable(8),
                                         apply_scan=4),
    "apply-knobs-fused": BASE.replace_backward(short_threshold=1, long_chunk=1, programs=2, long_path="fused",
                                               apply_tile=KnobTable(8), apply_scan=4),
}


def train(config, pooling, weighted, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, steps=3):
    ours, _ = make_pair(SPECS, FTM, oracle="reference", seed=11, kernel_config=config, pooling_mode=pooling,
                        optimizer=optimizer, learning_rate=0.3, eps=0.01, weight_decay=0.01)
    ours.collect_backward_stats = True
    g = torch.Generator().manual_seed(12)
    stats = []
    for _ in range(steps):
        batch = skewed_batch([r for r, _ in SPECS], FTM, B=5, max_L=6, generator=g, weighted=weighted, hot_fraction=0.4)
        out = ours(batch.indices, batch.offsets, batch.per_sample_weights)
        out.backward(torch.randn(out.shape, generator=g))
        stats.append(ours.backward_stats())
    return ours, stats


@pytest.mark.parametrize("pooling,weighted,optimizer", [
    (PoolingMode.SUM, False, EmbOptimType.EXACT_ROWWISE_ADAGRAD),
    (PoolingMode.MEAN, True, EmbOptimType.EXACT_ROWWISE_ADAGRAD),
    # Element-wise state and a trust ratio over the whole row: both paths must hand the update the same row.
    (PoolingMode.SUM, True, EmbOptimType.LAMB),
    (PoolingMode.MEAN, False, EmbOptimType.PARTIAL_ROWWISE_ADAM),
], ids=["sum-rowwise", "mean-weighted-rowwise", "sum-weighted-lamb", "mean-partial-rowwise-adam"])
def test_routing_sweep_gives_the_same_result(pooling, weighted, optimizer):
    results = {name: train(cfg, pooling, weighted, optimizer) for name, cfg in ROUTINGS.items()}
    ref, _ = results["all-short"]
    assert results["all-short"][1][-1]["long_runs"] == 0
    assert results["all-long"][1][-1]["short_runs"] == 0
    assert results["chunk-1"][1][-1]["long_chunks"] == results["chunk-1"][1][-1]["lookups"]
    mixed = results["mixed"][1][-1]
    assert mixed["short_runs"] > 0 and mixed["long_runs"] > 0
    for name, (m, _) in results.items():
        for t, (a, b) in enumerate(zip(m.split_embedding_weights(), ref.split_embedding_weights())):
            assert_close(a, b, f"{name}: table {t}", atol=2e-6, rtol=2e-6)
        for state in ("momentum1", "momentum2"):
            assert_close(getattr(m, state), getattr(ref, state), f"{name}: {state}", atol=1e-6, rtol=1e-5)
    # The fused long path reduces each run's partials in the same (chunk) order as the split one.
    for fused, split in [("mixed-fused-long", "mixed"), ("apply-knobs-fused", "apply-knobs")]:
        for a, b in zip(results[fused][0].split_embedding_weights(), results[split][0].split_embedding_weights()):
            assert torch.equal(a, b), fused
        for state in ("momentum1", "momentum2"):
            assert torch.equal(getattr(results[fused][0], state), getattr(results[split][0], state)), fused


@pytest.mark.parametrize("weights", [SparseType.FP32, SparseType.FP16])
def test_repeated_runs_are_bitwise_identical(weights):
    runs = []
    for _ in range(2):
        ours, _ = make_pair(SPECS, FTM, oracle="reference", seed=3, weights_precision=weights,
                            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, stochastic_rounding=True)
        g = torch.Generator().manual_seed(4)
        for _ in range(2):
            batch = skewed_batch([r for r, _ in SPECS], FTM, B=4, max_L=6, generator=g)
            out = ours(batch.indices, batch.offsets)
            out.backward(torch.randn(out.shape, generator=g))
        runs.append([w.clone() for w in ours.split_embedding_weights()] + [ours.momentum1.clone()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_hoisted_transpose_and_fused_bounds_check_change_nothing():
    results = []
    for hoist, fused in [(False, False), (True, False), (False, True), (True, True)]:
        ours, _ = make_pair(SPECS, FTM, oracle="reference", seed=5, hoist_transpose=hoist, fused_bounds_check=fused,
                            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
        g = torch.Generator().manual_seed(6)
        for _ in range(2):
            batch = skewed_batch([r for r, _ in SPECS], FTM, B=4, max_L=6, generator=g, weighted=True)
            out = ours(batch.indices, batch.offsets, batch.per_sample_weights)
            out.backward(torch.randn(out.shape, generator=g))
        results.append([w.clone() for w in ours.split_embedding_weights()] + [ours.momentum1.clone()])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
