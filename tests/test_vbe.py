"""Variable batch size per feature (FBGEMM's VBE, ops/vbe.py): ``batch_size_per_feature_per_rank``, the
1-D rank-major output, ``vbe_output`` / ``vbe_output_offsets`` (TorchRec's merged output), forward and
backward with every pooling and per-sample weights, and bad input refused with nothing changed.
Oracles: FBGEMM's CPU TBE (which implements VBE for EXACT_SGD and row-wise Adagrad) and the reference's
vbe_lookup (the other optimizers, bf16, weighted MEAN)."""

import pytest
import torch

from tbe_cases import (
    DTYPE,
    EmbOptimType,
    PoolingMode,
    SparseType,
    assert_close,
    fbgemm_supports,
    make_pair,
    tolerance,
)
from test_backward import assert_same_state
from torchrec_triton_tbe._fbgemm import BoundsCheckMode
from torchrec_triton_tbe.module import TritonTBE

SPECS = [(40, 8), (30, 12), (25, 16)]
FTM = [0, 1, 1, 2]
# Features x ranks: uneven, an empty rank, a feature with no bags at all on one rank.
SIZES = [[3, 1], [2, 4], [0, 3], [5, 0]]


def vbe_batch(sizes, generator, weighted=False, index_dtype=torch.int64, hot=0.3, specs=SPECS, ftm=FTM):
    """Skewed ids for a variable batch: offsets feature-major, each feature's bags rank by rank."""
    counts = [sum(row) for row in sizes]
    lengths = torch.randint(0, 6, (sum(counts),), generator=generator)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    ids, begin = [], 0
    for t, k in enumerate(ftm):
        n = int(lengths[begin : begin + counts[t]].sum())
        begin += counts[t]
        tail = (specs[k][0] * torch.rand(n, generator=generator) ** 3).long()
        ids.append(torch.where(torch.rand(n, generator=generator) < hot, torch.zeros_like(tail), tail))
    idx = torch.cat(ids)
    psw = torch.rand(idx.numel(), generator=generator) + 0.5 if weighted else None
    return idx.to(index_dtype), offsets.to(index_dtype), psw


def out_size(sizes):
    return sum(sizes[t][r] * SPECS[FTM[t]][1] for t in range(len(FTM)) for r in range(len(sizes[0])))


CASES = [
    (PoolingMode.SUM, False, SparseType.FP32, EmbOptimType.EXACT_ROWWISE_ADAGRAD, torch.int64),
    (PoolingMode.MEAN, False, SparseType.FP16, EmbOptimType.EXACT_SGD, torch.int32),
    (PoolingMode.SUM, True, SparseType.FP32, EmbOptimType.EXACT_SGD, torch.int64),
    (PoolingMode.MEAN, True, SparseType.FP32, EmbOptimType.EXACT_ROWWISE_ADAGRAD, torch.int64),
    (PoolingMode.SUM, True, SparseType.BF16, EmbOptimType.ADAM, torch.int32),
    (PoolingMode.MEAN, False, SparseType.FP32, EmbOptimType.PARTIAL_ROWWISE_LAMB, torch.int64),
]


@pytest.mark.parametrize("pooling,weighted,weights,optimizer,index_dtype", CASES,
                         ids=[f"{p.name}-{'w' if w else 'p'}-{wp.name}-{o.name}-{str(i)[6:]}" for p, w, wp, o, i in CASES])
def test_training_matches_oracle(pooling, weighted, weights, optimizer, index_dtype):
    fb_ok = (optimizer in (EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ROWWISE_ADAGRAD)
             and fbgemm_supports(weights, SparseType.FP32, pooling, weighted, FTM))
    oracle = "fbgemm" if fb_ok else "reference"
    # fbgemm-gpu-cpu 1.9.0's VBE forward corrupts the heap with int32 ids ("free(): invalid next size"):
    # FBGEMM gets them as int64.
    int64 = dict(embedding_table_index_type=torch.int64, embedding_table_offset_type=torch.int64)
    ours, other = make_pair(SPECS, FTM, oracle=oracle, pooling_mode=pooling, weights_precision=weights,
                            optimizer=optimizer, learning_rate=0.2, eps=0.1, stochastic_rounding=False,
                            embedding_table_index_type=index_dtype, embedding_table_offset_type=index_dtype,
                            fbgemm_overrides=int64)
    ours.collect_backward_stats = True
    g = torch.Generator().manual_seed(1)
    wdt = DTYPE[weights]
    for step, sizes in enumerate([SIZES, [[1, 1], [4, 2], [3, 3], [0, 2]], SIZES]):
        idx, off, psw = vbe_batch(sizes, g, weighted, index_dtype, hot=0.5)
        out = ours(idx, off, psw, batch_size_per_feature_per_rank=sizes)
        assert out.shape == (out_size(sizes),)
        grad = torch.randn(out.shape, generator=g)
        if oracle == "fbgemm":
            ref = other(idx.long(), off.long(), psw, batch_size_per_feature_per_rank=sizes)
            ref.backward(grad)
        else:
            ref64 = other.forward(idx, off, psw, batch_size_per_feature_per_rank=sizes)
            ref64.backward(grad.double())
            other.step()
            ref = other.output(ref64)
        assert_close(out, ref, f"[{oracle}] VBE forward step {step}", **tolerance(wdt))
        out.backward(grad)
    stats = ours.backward_stats()
    assert stats["short_runs"] > 0 and stats["long_runs"] > 0, stats
    assert_same_state(ours, other, oracle, "after 3 VBE steps", wdt, torch.float32)


def test_more_features_than_one_grid_holds_take_more_launches(monkeypatch):
    """The layout pass launches once per slice of at most 65,535 features (CUDA's grid dimension 1),
    each slice's programs knowing the whole feature count (the padded offsets' last entry): with the
    limit shrunk to 3, four features take two launches, and training matches the oracle as with one."""
    from torchrec_triton_tbe.kernels.vbe import _vbe_layout_kernel
    from torchrec_triton_tbe.ops import launch as launch_ops
    from torchrec_triton_tbe.ops import vbe as vbe_ops

    grids = []
    real_launch = vbe_ops.launch
    monkeypatch.setattr(vbe_ops, "launch", lambda k, grid, *a, **kw: (
        grids.append(grid) if k is _vbe_layout_kernel else None, real_launch(k, grid, *a, **kw))[1])
    ours, _ = make_pair(SPECS, FTM, oracle="reference")
    idx, off, _ = vbe_batch(SIZES, torch.Generator().manual_seed(2))
    sizes = vbe_ops.check_batch_sizes(ours.spec, SIZES)
    whole = vbe_ops.vbe_layout(ours.spec, off, sizes)
    monkeypatch.setattr(launch_ops, "MAX_GRID_Y", 3)
    sliced = vbe_ops.vbe_layout(ours.spec, off, sizes)
    # The padded offsets (their last entry too, written by one program of the first slice) and the
    # per-bag table, entry for entry.
    assert torch.equal(sliced.offsets, whole.offsets) and torch.equal(sliced.out_map, whole.out_map)
    assert int(sliced.offsets[-1]) == idx.numel()
    grids.clear()
    test_training_matches_oracle(*CASES[0])
    assert grids and {grid[1] for grid in grids} == {3, 1} and len(grids) % 2 == 0


def test_per_sample_weight_gradient_with_vbe():
    ours, ref = make_pair(SPECS, FTM, oracle="reference", optimizer=EmbOptimType.EXACT_SGD)
    g = torch.Generator().manual_seed(2)
    idx, off, psw = vbe_batch(SIZES, g, weighted=True)
    w = psw.clone().requires_grad_(True)
    out = ours(idx, off, w, batch_size_per_feature_per_rank=SIZES)
    grad = torch.randn(out.shape, generator=g)
    p64 = psw.double().requires_grad_(True)
    ref_out = ref.forward(idx, off, p64, batch_size_per_feature_per_rank=SIZES)
    (expected,) = torch.autograd.grad(ref_out, p64, grad.double())
    out.backward(grad)
    assert_close(w.grad, expected, "VBE psw grad", atol=1e-5, rtol=1e-5)


def test_merged_output_is_written_in_place_at_the_given_offsets():
    """TorchRec's merged VBE: the kernel writes its [B_tr, D_t] blocks into the caller's buffer at
    vbe_output_offsets[r][t], returns that buffer, and the gradient reaches its rows through it."""
    ours, _ = make_pair(SPECS, FTM, oracle="reference", optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.5)
    plain, _ = make_pair(SPECS, FTM, oracle="reference", optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.5)
    g = torch.Generator().manual_seed(3)
    idx, off, _ = vbe_batch(SIZES, g)
    own = out_size(SIZES)
    # Our blocks placed after a 5-element gap, in reversed block order, inside a larger buffer.
    T, R = len(FTM), 2
    blocks = [(r, t) for r in range(R) for t in range(T)]
    offsets_table, pos = torch.zeros(R, T, dtype=torch.int64), 5
    for r, t in reversed(blocks):
        offsets_table[r, t] = pos
        pos += SIZES[t][r] * SPECS[FTM[t]][1]
    buffer = torch.full((pos + 7,), -3.0)
    result = ours(idx, off, batch_size_per_feature_per_rank=SIZES, vbe_output=buffer, vbe_output_offsets=offsets_table)
    assert result.data_ptr() == buffer.data_ptr()
    expected = plain(idx.clone(), off.clone(), batch_size_per_feature_per_rank=SIZES).detach()
    start = 0
    for r, t in blocks:
        n = SIZES[t][r] * SPECS[FTM[t]][1]
        assert_close(buffer[offsets_table[r, t] : offsets_table[r, t] + n], expected[start : start + n],
                     f"block rank {r} feature {t}", atol=0, rtol=0)
        start += n
    assert torch.equal(buffer[:5], torch.full((5,), -3.0)) and torch.equal(buffer[pos:], torch.full((7,), -3.0))
    grad = torch.randn(buffer.shape, generator=g)
    result.backward(grad)
    # Same update as the unmerged module given the same gradient, re-laid out.
    flat = torch.cat([grad[offsets_table[r, t] : offsets_table[r, t] + SIZES[t][r] * SPECS[FTM[t]][1]]
                      for r, t in blocks])
    out2 = plain(idx.clone(), off.clone(), batch_size_per_feature_per_rank=SIZES)
    out2.backward(flat)
    for a, b in zip(ours.split_embedding_weights(), plain.split_embedding_weights()):
        assert_close(a, b, "merged vs plain VBE update", atol=1e-6, rtol=1e-6)
    assert own == start


def test_bounds_check_repairs_like_fbgemm_with_vbe():
    ours, fb = make_pair(SPECS, FTM, oracle="fbgemm", bounds_check_mode=BoundsCheckMode.WARNING)
    g = torch.Generator().manual_seed(4)
    idx, off, _ = vbe_batch(SIZES, g)
    idx[3] = 1000  # out of range for every table
    o1 = ours(idx.clone(), off.clone(), batch_size_per_feature_per_rank=SIZES)
    o2 = fb(idx.clone(), off.clone(), batch_size_per_feature_per_rank=SIZES)
    assert_close(o1, o2, "VBE WARNING repair", atol=1e-6, rtol=1e-6)
    assert int(ours.bounds_check_warning) == 1


@pytest.mark.parametrize("mode", [BoundsCheckMode.WARNING, BoundsCheckMode.IGNORE])
@pytest.mark.parametrize(
    "bad",
    [
        [0, 1, 3, 2, 5, 6, 7, 8, 8],  # a bag that ends before it starts
        [0, 1, 2, 3, 4, 5, 6, 7, 7],  # last offset short: the repair must close the last real bag
        [-1, 2, 2, 3, 4, 5, 6, 7, 9],  # a negative start and a last offset past the end
        [0, 2, 2, 9, 5, 6, 7, 8, 8],  # a bag past the end, then one ending before it starts
    ],
)
def test_bad_offsets_are_repaired_like_fbgemm_with_vbe(mode, bad):
    """The caller's offsets are repaired in place before the module pads them per feature (a repaired
    last offset padded first would close a padding bag and drop the last real bag's ids): the same
    repaired offsets, output and SGD step as FBGEMM's CPU TBE."""
    specs, ftm, sizes = [(10, 4), (6, 8)], [0, 1, 1], [[1, 2], [2, 1], [1, 1]]
    ours, fb = make_pair(specs, ftm, oracle="fbgemm", bounds_check_mode=mode)
    idx = torch.tensor([1, 2, 3, 4, 5, 0, 1, 2])
    our_off, fb_off = torch.tensor(bad), torch.tensor(bad)
    out = ours(idx.clone(), our_off, batch_size_per_feature_per_rank=sizes)
    ref = fb(idx.clone(), fb_off, batch_size_per_feature_per_rank=sizes)
    assert our_off.tolist() == fb_off.tolist() != bad
    assert_close(out, ref, "VBE forward on repaired offsets", atol=1e-6, rtol=1e-6)
    N = idx.numel()
    start, end = our_off.new_tensor(bad[:-1]), our_off.new_tensor(bad[1:])
    bad_bags = int(((start < 0) | (start > end) | (end > N)).sum()) + int(bad[-1] != N)
    assert int(ours.bounds_check_warning) == (bad_bags if mode == BoundsCheckMode.WARNING else 0)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    out.backward(grad)
    ref.backward(grad)
    for a, b in zip(ours.split_embedding_weights(), fb.split_embedding_weights()):
        assert_close(a, b, "VBE step on repaired offsets", atol=1e-6, rtol=1e-6)


def test_knobs_and_hoist_change_nothing_with_vbe():
    from torchrec_triton_tbe.config import KnobTable, load_named

    base = load_named("interpreter")
    results = []
    for cfg, hoist in [(base, False), (base.replace_backward(short_threshold=1, long_chunk=2, tile=KnobTable(8)), True),
                       (base.replace_forward(bag_lanes=KnobTable(1)).replace_backward(long_path="fused"), False)]:
        ours, _ = make_pair(SPECS, FTM, oracle="reference", seed=5, kernel_config=cfg, hoist_transpose=hoist,
                            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, pooling_mode=PoolingMode.MEAN)
        g = torch.Generator().manual_seed(6)
        idx, off, psw = vbe_batch(SIZES, g, weighted=True)
        out = ours(idx, off, psw, batch_size_per_feature_per_rank=SIZES)
        out.backward(torch.randn(out.shape, generator=g))
        results.append([out.detach()] + [w.clone() for w in ours.split_embedding_weights()] + [ours.momentum1.clone()])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert_close(a, b, "VBE knobs", atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (dict(batch_size_per_feature_per_rank=[[1], [1], [1]]), ValueError, "one list per feature"),
        (dict(batch_size_per_feature_per_rank=[[1, 1], [1], [1, 1], [1, 1]]), ValueError, r"\[1\] has 1 ranks"),
        (dict(batch_size_per_feature_per_rank=[[1, -1], [1, 1], [1, 1], [1, 1]]), ValueError, r"\[0\]\[1\] = -1"),
        (dict(batch_size_per_feature_per_rank=[[2, 1], [1, 1], [1, 1], [1, 1]]), ValueError, "sums to 9 bags"),
        (dict(vbe_output=torch.zeros(3)), ValueError, "need batch_size_per_feature_per_rank"),
        (dict(batch_size_per_feature_per_rank=[[1, 1]] * 4, vbe_output=torch.zeros(80)), ValueError,
         "given together"),
        (dict(batch_size_per_feature_per_rank=[[1, 1]] * 4, vbe_output=torch.zeros(80),
              vbe_output_offsets=torch.zeros(4, 2, dtype=torch.int64)), ValueError, r"\[ranks, features\]"),
        (dict(batch_size_per_feature_per_rank=[[1, 1]] * 4, vbe_output=torch.zeros(80, dtype=torch.float16),
              vbe_output_offsets=torch.zeros(2, 4, dtype=torch.int64)), ValueError, "output dtype"),
    ],
)
def test_bad_vbe_input_raises_and_changes_nothing(call, error, match):
    m = TritonTBE(SPECS, feature_table_map=FTM, device="cpu", optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    state = [m.weights.clone(), m.momentum1.clone(), m.iter.clone()]
    idx = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
    off = torch.arange(9)
    with pytest.raises(error, match=match):
        m(idx, off, **call)
    for a, b in zip(state, [m.weights, m.momentum1, m.iter]):
        assert torch.equal(a, b)


def test_a_refused_merged_output_leaves_bad_offsets_and_the_count_alone():
    """The merged output is checked before WARNING's repair writes the caller's offsets: a call refused for
    its vbe_output changes nothing, bad offsets and the warning count included."""
    m = TritonTBE(SPECS, feature_table_map=FTM, device="cpu", bounds_check_mode=BoundsCheckMode.WARNING)
    idx = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
    off = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 7])  # last offset short: WARNING would repair it
    sizes = [[1, 1]] * 4
    table = torch.zeros(2, 4, dtype=torch.int64)
    for call in (dict(vbe_output=torch.zeros(80, dtype=torch.float16), vbe_output_offsets=table),
                 dict(vbe_output_offsets=table)):
        with pytest.raises(ValueError, match="output dtype|given together"):
            m(idx, off, batch_size_per_feature_per_rank=sizes, **call)
        assert off.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 7] and int(m.bounds_check_warning) == 0


def test_vbe_with_sequence_pooling_is_refused_like_fbgemm():
    m = TritonTBE([(10, 8)] * 3, device="cpu", pooling_mode=PoolingMode.NONE)
    with pytest.raises(ValueError, match="pooling_mode=NONE"):
        m(torch.tensor([1, 2]), torch.tensor([0, 1, 2, 2]), batch_size_per_feature_per_rank=[[1], [1], [1]])


def test_fatal_bounds_check_names_the_feature_and_sample():
    m = TritonTBE(SPECS, feature_table_map=FTM, device="cpu", bounds_check_mode=BoundsCheckMode.FATAL)
    before = m.weights.clone()
    # Feature 2 (table 1, 30 rows), its second bag (sample 1 of feature 2, rank 1): id 99.
    sizes = [[1, 0], [1, 0], [1, 1], [1, 0]]
    idx = torch.tensor([1, 2, 3, 99, 4])
    off = torch.tensor([0, 1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match=r"indices\[3\] = 99 .* feature 2 .* sample 1"):
        m(idx, off, batch_size_per_feature_per_rank=sizes)
    assert torch.equal(m.weights, before)


def test_fatal_names_a_bad_bag_by_the_callers_position():
    """The check runs on the padded offsets, but its message quotes the caller's bag and offsets."""
    m = TritonTBE(SPECS, feature_table_map=FTM, device="cpu", bounds_check_mode=BoundsCheckMode.FATAL)
    sizes = [[1, 0], [1, 0], [1, 1], [1, 0]]  # the caller's bags 0-4; feature 2's second is bag 3
    off = torch.tensor([0, 1, 2, 3, 2, 5])  # bag 3 = [3, 2): ends before it starts
    with pytest.raises(ValueError, match=r"bag 3 \(feature 2, .*sample 1\) spans offsets\[3:5\] = \[3, 2\)"):
        m(torch.tensor([1, 2, 3, 4, 5]), off, batch_size_per_feature_per_rank=sizes)


def test_fatal_refuses_ids_of_a_batch_with_no_bag():
    """Every batch size 0 (offsets [0]) with ids given: offsets[-1] != len(indices), refused as with B > 0
    (FBGEMM's check too: num_indices == offsets[total_B])."""
    m = TritonTBE(SPECS, feature_table_map=FTM, device="cpu", bounds_check_mode=BoundsCheckMode.FATAL)
    before = m.weights.clone()
    with pytest.raises(ValueError, match=r"offsets\[-1\] = 0 but indices has 3 elements"):
        m(torch.tensor([1, 2, 3]), torch.tensor([0]), batch_size_per_feature_per_rank=[[0, 0]] * 4)
    assert torch.equal(m.weights, before)
