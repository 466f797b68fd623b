"""Sequence lookups (PoolingMode.NONE) and variable batch per feature (VBE) on the GPU against FBGEMM's
CUDA TBE: outputs, weights and optimizer state after several steps on skewed batches (short and long
runs), fp32 / fp16 weights, int32 / int64 ids, merged VBE output; sync-free steps."""

import logging

import pytest
import torch
from gpu_cases import DEV, FTM, SPECS, TOL, pair

from torchrec_triton_tbe._fbgemm import EmbOptimType, PoolingMode, SparseType
from torchrec_triton_tbe.module import TritonTBE

logging.getLogger("fbgemm_gpu").setLevel(logging.ERROR)
RWA, SGD = EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.EXACT_SGD


def skewed(rows_per_feature, bags_per_feature, seed, L=12):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.cat([torch.randint(0, 2 * L, (n,), generator=g) for n in bags_per_feature])
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    ids, begin = [], 0
    for rows, n in zip(rows_per_feature, bags_per_feature):
        k = int(lengths[begin : begin + n].sum())
        begin += n
        ids.append((rows * torch.rand(k, generator=g) ** 4).long())  # heavy head: long runs
    return torch.cat(ids).to(DEV), offsets.to(DEV)


def compare(ours, fb, weights, what):
    for t, (a, b) in enumerate(zip(ours.split_embedding_weights(), fb.split_embedding_weights())):
        torch.testing.assert_close(a.float(), b.float(), **TOL[weights], msg=lambda m: f"{what} table {t}: {m}")
    for a, b in zip(ours.split_optimizer_states(), fb.split_optimizer_states()):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-3)


SEQ_SPECS = [(20_000, 128), (5_000, 128), (300, 128)]
SEQ_FTM = [0, 1, 1, 2]


@pytest.mark.parametrize("optimizer,weights,index_dtype", [
    (RWA, SparseType.FP16, torch.int64), (SGD, SparseType.FP32, torch.int32), (EmbOptimType.ADAM, SparseType.FP32,
                                                                               torch.int64),
])
def test_sequence_matches_fbgemm_cuda(optimizer, weights, index_dtype):
    ours, fb = pair(SEQ_SPECS, SEQ_FTM, pooling_mode=PoolingMode.NONE, weights_precision=weights, optimizer=optimizer,
                    learning_rate=0.05, eps=0.1, stochastic_rounding=False, embedding_table_index_type=index_dtype)
    ours.collect_backward_stats = True
    B = 512
    for step in range(3):
        idx, off = skewed([SEQ_SPECS[k][0] for k in SEQ_FTM], [B] * len(SEQ_FTM), step)
        idx, off = idx.to(index_dtype), off.to(index_dtype)
        o1, o2 = ours(idx.clone(), off.clone()), fb(idx.clone(), off.clone())
        assert o1.shape == o2.shape == (idx.numel(), 128)
        torch.testing.assert_close(o1, o2, **TOL[weights])
        grad = torch.randn_like(o1)
        o1.backward(grad)
        o2.backward(grad)
    stats = ours.backward_stats()
    assert stats["short_runs"] > 0 and stats["long_runs"] > 0, stats
    compare(ours, fb, weights, f"sequence {optimizer.name}")


@pytest.mark.parametrize("features", [1, 2, 3, 5])
@pytest.mark.parametrize("dim", [252, 128])  # FBGEMM's CUDA TBE takes multiples of 4 only
def test_sequence_forward_compiles_and_matches_for_few_features(features, dim):
    """Feature counts for the feature search's step counts (2 and 3 steps), an odd and an even D: the
    sequence forward with one to three features failed to compile on Triton 3.6 (FBGEMM's own
    backward_optimizers test found it: T=2, D=250, int64 ids), and kernels/sequence.py now avoids the pattern.
    At 9a3632c on an H100: D=128 passed for every count; D=250 was refused by FBGEMM's CUDA TBE (not a multiple of
    4), hence 252 (not yet run)."""
    specs, ftm = [(500, dim)] * features, list(range(features))
    ours, fb = pair(specs, ftm, pooling_mode=PoolingMode.NONE, weights_precision=SparseType.FP32, optimizer=SGD,
                    learning_rate=0.05, embedding_table_index_type=torch.int64)
    idx, off = skewed([500] * features, [43] * features, features)
    o1, o2 = ours(idx.clone(), off.clone()), fb(idx.clone(), off.clone())
    torch.testing.assert_close(o1, o2, **TOL[SparseType.FP32])
    grad = torch.randn_like(o1)
    o1.backward(grad)
    o2.backward(grad)
    compare(ours, fb, SparseType.FP32, f"sequence T={features} D={dim}")


VBE_SPECS, VBE_FTM = SPECS, FTM
SIZES = [[700, 300], [64, 900], [512, 0], [3, 1000], [256, 256]]


@pytest.mark.parametrize("pooling,weighted,weights,optimizer", [
    (PoolingMode.SUM, False, SparseType.FP16, RWA), (PoolingMode.MEAN, True, SparseType.FP32, SGD),
    (PoolingMode.SUM, True, SparseType.FP32, EmbOptimType.ADAM),
])
def test_vbe_matches_fbgemm_cuda(pooling, weighted, weights, optimizer):
    ours, fb = pair(VBE_SPECS, VBE_FTM, pooling_mode=pooling, weights_precision=weights, optimizer=optimizer,
                    learning_rate=0.05, eps=0.1, stochastic_rounding=False)
    ours.collect_backward_stats = True
    for step in range(3):
        idx, off = skewed([VBE_SPECS[k][0] for k in VBE_FTM], [sum(r) for r in SIZES], 10 + step)
        psw = torch.rand(idx.numel(), device=DEV) if weighted else None
        o1 = ours(idx.clone(), off.clone(), psw, batch_size_per_feature_per_rank=SIZES)
        o2 = fb(idx.clone(), off.clone(), psw, batch_size_per_feature_per_rank=SIZES)
        assert o1.shape == o2.shape and o1.dim() == 1
        torch.testing.assert_close(o1, o2, **TOL[weights])
        grad = torch.randn_like(o1)
        o1.backward(grad)
        o2.backward(grad)
    stats = ours.backward_stats()
    assert stats["short_runs"] > 0 and stats["long_runs"] > 0, stats
    compare(ours, fb, weights, f"VBE {pooling.name} {optimizer.name}")


def test_merged_vbe_output_matches_fbgemm_cuda():
    """TorchRec's merged output: both write their blocks into a shared buffer at the given offsets."""
    ours, fb = pair(VBE_SPECS, VBE_FTM, optimizer=RWA, learning_rate=0.05, eps=0.1, stochastic_rounding=False)
    idx, off = skewed([VBE_SPECS[k][0] for k in VBE_FTM], [sum(r) for r in SIZES], 20)
    T, R = len(VBE_FTM), 2
    dims = [VBE_SPECS[k][1] for k in VBE_FTM]
    table, pos = torch.zeros(R, T, dtype=torch.int64), 16  # another kernel's 16 elements first
    for r in range(R):
        for t in range(T):
            table[r, t] = pos
            pos += SIZES[t][r] * dims[t]
    outs = []
    for m in (ours, fb):
        buf = torch.zeros(pos, device=DEV)
        out = m(idx.clone(), off.clone(), batch_size_per_feature_per_rank=SIZES, vbe_output=buf,
                vbe_output_offsets=table.to(DEV))
        assert out.data_ptr() == buf.data_ptr()
        out.backward(torch.ones_like(out))
        outs.append(out.detach())
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
    compare(ours, fb, SparseType.FP32, "merged VBE")


@pytest.mark.parametrize("mode", ["WARNING", "IGNORE"])
def test_vbe_offsets_repair_matches_fbgemm_cuda(mode):
    """A short last offset with a variable batch (a repair FBGEMM's CUDA bounds check defines as its CPU op
    does, test_gpu_reliability._bad_id_batches): the caller's offsets repaired in place as FBGEMM's CUDA TBE
    repairs them, the last real bag closed (not a padding one), the same forward and step."""
    from torchrec_triton_tbe._fbgemm import BoundsCheckMode

    idx, off = skewed([VBE_SPECS[k][0] for k in VBE_FTM], [sum(r) for r in SIZES], 30)
    N = idx.numel()
    short = off.clone()
    short[-1] = N - 3  # the last bag of the last feature (rank 1) loses its last three ids
    assert short[-1] >= short[-2], "the last bag must hold at least three ids"
    for name, bad in (("a short last offset", short),):
        ours, fb = pair(VBE_SPECS, VBE_FTM, optimizer=RWA, learning_rate=0.05, eps=0.1,
                        bounds_check_mode=getattr(BoundsCheckMode, mode))
        ours_off, fb_off = bad.clone(), bad.clone()
        o1 = ours(idx.clone(), ours_off, batch_size_per_feature_per_rank=SIZES)
        o2 = fb(idx.clone(), fb_off, batch_size_per_feature_per_rank=SIZES)
        assert torch.equal(ours_off, fb_off), f"{name}: offsets repaired unlike FBGEMM CUDA"
        assert not torch.equal(ours_off, bad), f"{name}: nothing repaired"
        torch.testing.assert_close(o1, o2, **TOL[SparseType.FP32])
        grad = torch.randn(o1.shape, generator=torch.Generator().manual_seed(3)).to(DEV)
        o1.backward(grad)
        o2.backward(grad)
        compare(ours, fb, SparseType.FP32, f"VBE {mode} repair: {name}")
        if mode == "WARNING":
            assert int(ours.bounds_check_warning) > 0 and int(fb.bounds_check_warning) > 0, name


def test_sequence_and_vbe_steps_are_sync_free():
    seq = TritonTBE(SEQ_SPECS, feature_table_map=SEQ_FTM, device=DEV, pooling_mode=PoolingMode.NONE, optimizer=RWA)
    vbe = TritonTBE(VBE_SPECS, feature_table_map=VBE_FTM, device=DEV, optimizer=RWA)
    s_batch = skewed([SEQ_SPECS[k][0] for k in SEQ_FTM], [256] * len(SEQ_FTM), 1)
    v_batch = skewed([VBE_SPECS[k][0] for k in VBE_FTM], [sum(r) for r in SIZES], 2)
    def step():
        out = seq(*s_batch)
        out.backward(torch.ones_like(out))
        out = vbe(*v_batch, batch_size_per_feature_per_rank=SIZES)
        out.backward(torch.ones_like(out))

    step()  # compiles, fills the caching allocator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
