"""The small-table path (kernels/small_table.py) on the GPU: compiled by Triton it trains as FBGEMM's
CUDA TBE does, its backward issues no host sync, and replays of its captured backward are bit-identical
to the eager one. Both passes switched on for every table and batch here; then the shipped choice
(configs/sm90.yaml: the backward only, per feature and call from its bags' mean length, decided on the
device), on a batch where some small tables take the path and others do not. Passed on the H200 with
the one-hot histograms (7 passed, 2026-12-02) and with the shipped choice (8 passed, dd488e4)."""

import pytest
import torch
from gpu_cases import DEV, TOL, no_host_sync, pair

from torchrec_triton_tbe._fbgemm import EmbOptimType, PoolingMode, SparseType
from torchrec_triton_tbe.config import load_config
from torchrec_triton_tbe.module import TritonTBE

# Tables 0-2 are small (8, 40 and 64 rows), table 3 is not; bags of up to 150 ids.
SPECS = [(8, 128), (40, 64), (64, 96), (5_000, 128)]
FTM = [0, 1, 2, 3]
SMALL = load_config(DEV).replace_small_table(max_rows=64, forward=1, backward=1, backward_min_bag=0,
                                             backward_min_batch=0)


def small_batch(seed, nb=512, weighted=False, max_L=150):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_L, (len(FTM) * nb,), generator=g)
    offsets = torch.zeros(len(FTM) * nb + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    ids = [torch.randint(0, SPECS[k][0], (int(lengths[t * nb:(t + 1) * nb].sum()),), generator=g)
           for t, k in enumerate(FTM)]
    idx = torch.cat(ids).to(DEV)
    psw = torch.rand(idx.numel(), generator=g).to(DEV) if weighted else None
    return idx, offsets.to(DEV), psw


@pytest.mark.parametrize("optimizer", [EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ROWWISE_ADAGRAD])
@pytest.mark.parametrize("weights,pooling,weighted", [
    (SparseType.FP32, PoolingMode.SUM, False), (SparseType.FP16, PoolingMode.MEAN, False),
    (SparseType.FP32, PoolingMode.SUM, True)])
def test_small_path_matches_fbgemm_cuda(optimizer, weights, pooling, weighted):
    ours, fb = pair(SPECS, FTM, kernel_config=SMALL, optimizer=optimizer, weights_precision=weights,
                    pooling_mode=pooling, learning_rate=0.05, eps=0.1, stochastic_rounding=False)
    assert ours.spec.plan.small_tables == {0, 1, 2}
    for step in range(3):
        idx, off, psw = small_batch(step, weighted=weighted)
        out, ref = ours(idx, off, psw), fb(idx, off, psw)
        torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)  # sums of up to 150 rows
        grad = torch.randn(out.shape, device=DEV, generator=torch.Generator(DEV).manual_seed(step))
        with no_host_sync(step > 0):
            out.backward(grad)
        ref.backward(grad)
    for a, b in zip(ours.split_embedding_weights(), fb.split_embedding_weights()):
        torch.testing.assert_close(a.float(), b.float(), **TOL[weights])


def test_small_path_replays_match_the_eager_backward_bitwise():
    kw = dict(feature_table_map=FTM, device=DEV, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
              weights_precision=SparseType.FP16, stochastic_rounding=True, learning_rate=0.05, eps=0.1)
    graphed = TritonTBE(SPECS, kernel_config=SMALL, **kw)
    eager = TritonTBE(SPECS, kernel_config=SMALL.replace_backward(graph_max_lookups=0), **kw)
    torch.manual_seed(0)
    graphed.init_embedding_weights_uniform(-0.5, 0.5)
    eager.weights.copy_(graphed.weights)
    for step, seed in enumerate([0, 1, 0, 1, 0, 1]):
        idx, off, _ = small_batch(seed, nb=256)
        for m in (graphed, eager):
            out = m(idx, off)
            out.backward(torch.randn(out.shape, device=DEV, generator=torch.Generator(DEV).manual_seed(step)))
    torch.cuda.synchronize()
    assert graphed._backward_graphs.replays >= 2
    assert torch.equal(graphed.weights, eager.weights) and torch.equal(graphed.momentum1, eager.momentum1)


def test_shipped_backward_choice_matches_fbgemm_cuda():
    shipped = load_config(DEV)
    st = shipped.small_table
    if not (st.max_rows and st.backward):
        pytest.skip(f"the small-table path is off in the {shipped.target} config")
    nb = max(st.backward_min_batch, 512)
    # Per feature, bag lengths in [lo, hi]: tables 0 and 2 average above backward_min_bag (the path),
    # table 1 below it (the generic kernels); table 3 is no small table.
    least = st.backward_min_bag
    spans = [(least, 3 * least), (0, 4), (least + 8, 2 * least + 8), (1, 20)]
    ours, fb = pair(SPECS, FTM, kernel_config=shipped, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                    weights_precision=SparseType.FP32, learning_rate=0.05, eps=0.1, stochastic_rounding=False)
    assert ours.spec.plan.small_tables == {0, 1, 2} and not any(b.small for b in ours.spec.plan.buckets)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        lengths = torch.cat([torch.randint(lo, hi + 1, (nb,), generator=g) for lo, hi in spans])
        off = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(DEV)
        idx = torch.cat([torch.randint(0, SPECS[k][0], (int(lengths[t * nb:(t + 1) * nb].sum()),), generator=g)
                         for t, k in enumerate(FTM)]).to(DEV)
        out, ref = ours(idx, off), fb(idx, off)
        torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
        grad = torch.randn(out.shape, device=DEV, generator=torch.Generator(DEV).manual_seed(step))
        with no_host_sync(step > 0):
            out.backward(grad)
        ref.backward(grad)
    for a, b in zip(ours.split_embedding_weights(), fb.split_embedding_weights()):
        torch.testing.assert_close(a.float(), b.float(), **TOL[SparseType.FP32])
