"""Determinism and extremes on the GPU (docs/reliability.md). Run on the device machine:
python -m pytest -q tests/gpu/test_gpu_reliability.py.

Determinism: weights and every state tensor bitwise identical across repeated runs and across the
schedule knobs that keep the summation order (hoisted transpose, CUDA graphs, fused / split long path,
D-bucket streams, torch.use_deterministic_algorithms); the knobs that change it (short threshold, long
chunk) move results by fp32 rounding only. Extremes: a table over 2**31 elements with int32 and int64
ids, one row hit by every lookup of a 262,144-bag batch, D up to 4096, 500 tables, B = 1, all-empty."""

import contextlib
import itertools

import pytest
import torch

from gpu_cases import DEV, FTM, SPECS, TOL, batch, pair
from tbe_cases import checked_optimizer_spec

from torchrec_triton_tbe._fbgemm import BoundsCheckMode, EmbOptimType, PoolingMode, SparseType
from torchrec_triton_tbe.config import load_config
from torchrec_triton_tbe.module import TritonTBE
from torchrec_triton_tbe.reference import ReferenceTBE

RWA, SGD, ADAGRAD, ADAM = (EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ADAGRAD,
                           EmbOptimType.ADAM)


def everything(m: TritonTBE) -> list[torch.Tensor]:
    return [w.clone() for w in m.split_embedding_weights()] + [s.clone() for t in m.split_optimizer_states() for s in t]


def train(cfg, optimizer, steps=4, hoist=False, weighted=True, deterministic=False, seed=0, replays=None):
    """The weights, states and psw gradients after ``steps`` steps; ``replays`` (a list): gets the number
    of backward graph replays appended."""
    m = TritonTBE(SPECS, feature_table_map=FTM, device=DEV, optimizer=optimizer, kernel_config=cfg,
                  hoist_transpose=hoist, learning_rate=0.05, eps=0.01, weights_precision=SparseType.FP32)
    torch.manual_seed(seed)
    m.init_embedding_weights_uniform(-0.5, 0.5)
    grads = []
    with _deterministic() if deterministic else contextlib.nullcontext():
        for step in range(steps):
            # Step 0 weighted (with the psw gradient); the later steps repeat one unweighted batch shape,
            # so a graph-enabled config captures and replays their backward.
            w = weighted and step == 0
            idx, off, psw = batch(min(step, 1), weighted=w, psw_grad=w)
            out = m(idx, off, psw)
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(step)).to(DEV))
            if psw is not None:
                grads.append(psw.grad.clone())
    torch.cuda.synchronize()
    if replays is not None:
        replays.append(m._backward_graphs.replays)
    return everything(m) + grads


@contextlib.contextmanager
def _deterministic():
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def _configs():
    # One backward stream in the base (configs/sm90.yaml ships 4): the bwd_streams variants differ from it.
    base = load_config(DEV).replace_backward(short_threshold=16, long_chunk=8, long_path="split", bucket_streams=1)
    return base, {
        "again": (base, {}),
        "hoist": (base, dict(hoist=True)),
        "graphs_off": (base.replace_backward(graph_max_lookups=0), {}),
        "long_fused": (base.replace_backward(long_path="fused"), {}),
        "streams_4": (base.replace_forward(bucket_streams=4, bucket_streams_min_lookups=0), {}),
        # backward.bucket_streams: the buckets' update kernels on four streams, captured and eager
        "bwd_streams_4": (base.replace_backward(bucket_streams=4, bucket_streams_min_lookups=0), {}),
        "bwd_streams_4_eager": (base.replace_backward(bucket_streams=4, bucket_streams_min_lookups=0,
                                                      graph_max_lookups=0), {}),
        "bwd_streams_4_long_fused": (base.replace_backward(bucket_streams=4, bucket_streams_min_lookups=0,
                                                           long_path="fused"), {}),
        # backward.split_paths: each bucket's short kernel and long path on streams of their own
        # (eight streams: the test tables' three buckets, two lanes each)
        "bwd_split_paths": (base.replace_backward(bucket_streams=8, bucket_streams_min_lookups=0,
                                                  split_paths=True, split_paths_min_lookups=0), {}),
        "bwd_split_paths_eager": (base.replace_backward(bucket_streams=8, bucket_streams_min_lookups=0,
                                                        split_paths=True, split_paths_min_lookups=0,
                                                        graph_max_lookups=0), {}),
        # backward.split_heaviest: three buckets on four streams, the heaviest's paths on two of them
        "bwd_split_heaviest": (base.replace_backward(bucket_streams=4, bucket_streams_min_lookups=0,
                                                     split_heaviest=True, split_paths_min_lookups=0), {}),
        "bwd_split_heaviest_eager": (base.replace_backward(bucket_streams=4, bucket_streams_min_lookups=0,
                                                           split_heaviest=True, split_paths_min_lookups=0,
                                                           graph_max_lookups=0), {}),
        "deterministic_algorithms": (base, dict(deterministic=True)),
    }


@pytest.mark.parametrize("optimizer", [RWA, ADAM])
def test_bitwise_identical_across_runs_and_schedules(optimizer):
    base, variants = _configs()
    replays = []
    expected = train(base, optimizer, replays=replays)
    # Steps 1-3 repeat one batch shape: step 2 captures and replays, step 3 replays. Without replays
    # here, graphs_off would compare eager with eager.
    assert replays == [2], replays
    for name, (cfg, kw) in variants.items():
        replays = []
        got = train(cfg, optimizer, replays=replays, **kw)
        if cfg.backward.graph_max_lookups == 0:
            assert replays == [0], (name, replays)
        for i, (a, b) in enumerate(zip(expected, got)):
            assert torch.equal(a, b), f"{name}: tensor {i} differs (max |diff| {(a - b).abs().max().item():.3e})"


@pytest.mark.parametrize("threshold,chunk", [(4, 4), (64, 32), (1 << 20, 64)])
def test_summation_order_knobs_move_results_by_rounding_only(threshold, chunk):
    base, _ = _configs()
    expected = train(base, RWA)
    got = train(base.replace_backward(short_threshold=threshold, long_chunk=chunk), RWA)
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


def test_deterministic_algorithms_allow_every_path():
    """Nothing the module runs is refused under torch.use_deterministic_algorithms(True) (no atomically
    accumulated values anywhere: the sort is stable, the runs are reduced in a fixed order): sequence,
    VBE and the psw gradient included; results equal those without the flag."""
    for pooling in (PoolingMode.NONE, PoolingMode.SUM):
        specs = [(r, 64) for r, _ in SPECS] if pooling == PoolingMode.NONE else SPECS
        results = []
        for deterministic in (False, True):
            m = TritonTBE(specs, feature_table_map=FTM, device=DEV, optimizer=RWA, pooling_mode=pooling)
            torch.manual_seed(0)
            m.init_embedding_weights_uniform(-0.5, 0.5)
            with _deterministic() if deterministic else contextlib.nullcontext():
                idx, off, _ = batch(0)
                out = m(idx, off)
                out.backward(torch.ones_like(out))
                if pooling == PoolingMode.SUM:  # VBE too
                    n = off.numel() - 1
                    sizes = [[n // len(FTM)] for _ in FTM]
                    out = m(idx, off, batch_size_per_feature_per_rank=sizes)
                    out.backward(torch.ones_like(out))
            torch.cuda.synchronize()
            results.append(everything(m))
        for a, b in zip(*results):
            assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------- extremes
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("optimizer", [SGD, ADAGRAD])
def test_tables_past_2_31_elements(index_dtype, optimizer):
    """Table 0 has 2**24 + 8 rows of 128 (just over 2**31 elements); table 1 starts past element 2**31
    of the flat weights (and, for Adagrad, of the flat state). Lookups hit both ends of each table."""
    rows0 = (1 << 24) + 8
    specs = [(rows0, 128), (1000, 64)]
    lr, eps = 0.05, 0.01
    m = TritonTBE(specs, device=DEV, optimizer=optimizer, learning_rate=lr, eps=eps,
                  weights_precision=SparseType.FP16)
    torch.manual_seed(0)
    m.init_embedding_weights_uniform(-0.5, 0.5)
    nb = 1024
    g = torch.Generator().manual_seed(1)
    ids0 = torch.cat([torch.arange(rows0 - 40, rows0), torch.arange(0, 8), torch.randint(0, rows0, (nb * 3 - 48,),
                                                                                          generator=g)])
    ids1 = torch.cat([torch.arange(1000 - 8, 1000), torch.randint(0, 1000, (nb * 3 - 8,), generator=g)])
    idx = torch.cat([ids0, ids1])
    off = torch.arange(0, 2 * nb + 1) * 3
    idx_d, off_d = idx.to(DEV, index_dtype), off.to(DEV, index_dtype)
    before = [w.clone() for w in m.split_embedding_weights()]  # fp16: 4.3 GB for table 0
    out = m(idx_d, off_d)
    expected = torch.cat([before[t][ids.to(DEV)].float().reshape(nb, 3, -1).sum(1)
                          for t, ids in enumerate((ids0, ids1))], 1)
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
    grad = torch.randn(out.shape, generator=g).to(DEV)
    out.backward(grad)
    torch.cuda.synchronize()
    after = m.split_embedding_weights()
    states = m.split_optimizer_states()
    col = 0
    for t, ids in enumerate((ids0, ids1)):
        D = specs[t][1]
        touched, inverse = torch.unique(ids.to(DEV), return_inverse=True)
        gt = torch.zeros(touched.numel(), D, device=DEV)
        gt.index_add_(0, inverse, grad[:, col:col + D].repeat_interleave(3, 0))
        col += D
        w0 = before[t][touched].float()
        if optimizer == SGD:
            want = w0 - lr * gt
        else:
            state = gt * gt
            want = w0 - lr * gt / (state.sqrt() + eps)
            torch.testing.assert_close(states[t][0][touched], state, atol=1e-5, rtol=1e-4)
        # fp16 storage with stochastic rounding (FBGEMM's default): within an ulp or so
        torch.testing.assert_close(after[t][touched].float(), want, atol=2e-3, rtol=2e-3)
        before[t][touched] = after[t][touched]
        assert torch.equal(after[t], before[t]), "rows no lookup touched changed"


def test_one_row_hit_by_every_lookup_of_262144_bags():
    nb = 262_144
    ours, fb = pair(specs=[(1000, 128)], ftm=[0], optimizer=RWA, learning_rate=0.05, eps=0.01,
                    weights_precision=SparseType.FP32)
    idx = torch.full((nb,), 3, dtype=torch.int64, device=DEV)
    off = torch.arange(nb + 1, device=DEV)
    grad = torch.randn(nb, 128, generator=torch.Generator().manual_seed(0)).to(DEV)
    ours.collect_backward_stats = True
    for m in (ours, fb):
        out = m(idx.clone(), off.clone())
        out.backward(grad)
    stats = ours.backward_stats()
    assert stats["long_runs"] == 1 and stats["runs"] == 1 and stats["max_run"] == nb, stats
    torch.testing.assert_close(ours.split_embedding_weights()[0], fb.split_embedding_weights()[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ours.split_optimizer_states()[0][0], fb.split_optimizer_states()[0][0],
                               atol=1e-3, rtol=1e-4)


def _reference_check(m: TritonTBE, ref: ReferenceTBE, steps: int, nb: int, max_len: int, tol: dict, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = len(m.feature_table_map)
    rows = [w.shape[0] for w in m.split_embedding_weights()]
    for step in range(steps):
        lengths = torch.randint(0, max_len + 1, (T * nb,), generator=g)
        off = torch.zeros(T * nb + 1, dtype=torch.int64)
        off[1:] = lengths.cumsum(0)
        idx = torch.cat([torch.randint(0, rows[k], (int(lengths[t * nb:(t + 1) * nb].sum()),), generator=g)
                         for t, k in enumerate(m.feature_table_map)])
        out = m(idx.to(DEV), off.to(DEV))
        out64 = ref.forward(idx, off)
        torch.testing.assert_close(out.cpu().double(), out64.detach(), **tol)
        grad = torch.randn(out.shape, generator=g)
        out.backward(grad.to(DEV))
        ref.backward(out64, grad)
        ref.step()
    for a, b in zip(m.split_embedding_weights(), ref.tables):
        torch.testing.assert_close(a.cpu().float(), b.float(), **tol)


@pytest.mark.parametrize("D", [1024, 2048, 2050, 4096])
@pytest.mark.parametrize("optimizer", [RWA, ADAM])
def test_wide_rows_match_the_reference(D, optimizer):
    specs = [(300, D), (50, 64)]
    m = TritonTBE(specs, feature_table_map=[0, 1, 0], device=DEV, optimizer=optimizer, learning_rate=0.05, eps=0.01,
                  weights_precision=SparseType.FP32)
    torch.manual_seed(0)
    m.init_embedding_weights_uniform(-0.5, 0.5)
    ref = ReferenceTBE([w.cpu() for w in m.split_embedding_weights()], m.feature_table_map, mean=False,
                       optimizer=checked_optimizer_spec(m, optimizer=optimizer), learning_rate=0.05, eps=0.01)
    _reference_check(m, ref, steps=2, nb=32, max_len=6, tol=dict(atol=1e-4, rtol=1e-4))


def test_500_tables_match_fbgemm_cuda():
    dims = [8, 16, 24, 32, 64, 96, 128, 256]
    specs = [(50 + 7 * t, dims[t % len(dims)]) for t in range(500)]
    ours, fb = pair(specs=specs, ftm=list(range(500)), optimizer=RWA, learning_rate=0.05, eps=0.01,
                    weights_precision=SparseType.FP16, stochastic_rounding=False)
    g = torch.Generator().manual_seed(0)
    nb = 16
    for step in range(2):
        lengths = torch.randint(0, 5, (500 * nb,), generator=g)
        off = torch.zeros(500 * nb + 1, dtype=torch.int64)
        off[1:] = lengths.cumsum(0)
        idx = torch.cat([torch.randint(0, specs[t][0], (int(lengths[t * nb:(t + 1) * nb].sum()),), generator=g)
                         for t in range(500)])
        o1, o2 = ours(idx.to(DEV), off.to(DEV)), fb(idx.to(DEV), off.to(DEV))
        torch.testing.assert_close(o1, o2, **TOL[SparseType.FP16])
        grad = torch.randn(o1.shape, generator=g).to(DEV)
        o1.backward(grad)
        o2.backward(grad)
    for a, b in zip(ours.split_embedding_weights(), fb.split_embedding_weights()):
        torch.testing.assert_close(a.float(), b.float(), **TOL[SparseType.FP16])


@pytest.mark.parametrize("optimizer", [SGD, RWA])
def test_more_features_in_one_bucket_than_a_grid_holds_match_fbgemm_cuda(optimizer):
    """CUDA's grid dimension 1 holds 65,535 features; past it the forward, the per-sample weights' gradient
    and the sort keys launch in slices (ops/launch.grid_y_slices), which the CPU tests check only with the
    limit patched down. Here for real: 100,000 features read two 16-wide tables and a 4-wide one, 70,000
    of them in the BLOCK_D 16 bucket; weighted (the psw gradient too), then unweighted, against FBGEMM's
    CUDA TBE: outputs, gradients, weights and optimizer state. (The small-table groups, sliced by table,
    are not reached: a small table has one reader, and 65,536 of them are beyond this test.)"""
    T, nb = 100_000, 2
    specs = [(1_000, 16), (40, 16), (300, 4)]
    ftm = [0 if t % 10 < 4 else 1 if t % 10 < 7 else 2 for t in range(T)]
    ours, fb = pair(specs=specs, ftm=ftm, optimizer=optimizer, learning_rate=0.05, eps=0.01,
                    weights_precision=SparseType.FP32)
    assert max(len(b.features) for b in ours.spec.plan.buckets) == 70_000
    g = torch.Generator().manual_seed(11)
    rows = torch.tensor([specs[k][0] for k in ftm]).repeat_interleave(nb)
    for step, weighted in enumerate([True, False]):
        lengths = torch.randint(0, 4, (T * nb,), generator=g)
        off = torch.zeros(T * nb + 1, dtype=torch.int64)
        off[1:] = lengths.cumsum(0)
        idx = (torch.rand(int(off[-1]), generator=g) * rows.repeat_interleave(lengths)).long()
        grad = torch.randn(nb, sum(specs[k][1] for k in ftm), generator=g).to(DEV)
        weights = torch.rand(idx.numel(), generator=torch.Generator().manual_seed(step)).to(DEV) if weighted else None
        psws, outs = [], []
        for m in (ours, fb):
            psw = weights.clone().requires_grad_(True) if weighted else None
            out = m(idx.to(DEV), off.to(DEV), psw)
            out.backward(grad)
            psws.append(psw)
            outs.append(out.detach())
        torch.testing.assert_close(outs[0], outs[1], **TOL[SparseType.FP32])
        if weighted:
            torch.testing.assert_close(psws[0].grad, psws[1].grad, **TOL[SparseType.FP32])
        for a, b in zip(ours.split_embedding_weights(), fb.split_embedding_weights()):
            torch.testing.assert_close(a, b, **TOL[SparseType.FP32])
        if optimizer == RWA:
            for a, b in zip(ours.split_optimizer_states(), fb.split_optimizer_states()):
                torch.testing.assert_close(a[0], b[0], **TOL[SparseType.FP32])


def test_to_empty_onto_the_gpu_zeroes_the_warning_count_and_a_move_keeps_it():
    """A module on the CPU (built on the GPU and moved there: a CPU module cannot be built on a GPU host,
    whose Triton does not interpret; ``model.cpu()`` works): ``.to`` the GPU carries its WARNING count
    over; ``to_empty`` onto the GPU (directly, through a parent, or from meta) leaves nothing to keep, so
    the count is zero, not the new buffer's garbage, and a bad batch afterwards counts from zero."""
    for how in ("move", "to_empty", "parent", "meta"):
        m = TritonTBE([(8, 4)], device=DEV, bounds_check_mode=BoundsCheckMode.WARNING)
        m.bounds_check_warning.fill_(3)
        m.cpu()
        assert m.bounds_check_warning.device.type == "cpu" and int(m.bounds_check_warning) == 3
        if how == "move":
            m.to(DEV)
        elif how == "to_empty":
            m.to_empty(device=DEV)
        elif how == "parent":
            torch.nn.ModuleDict({"tbe": m}).to_empty(device=DEV)
        else:
            m.to("meta").to_empty(device=DEV)
        assert m.bounds_check_warning.device.type == "cuda"
        assert int(m.bounds_check_warning) == (3 if how == "move" else 0), how
        m(torch.tensor([1, 9], device=DEV), torch.tensor([0, 1, 2], device=DEV))  # id 9 of 8 rows
        assert int(m.bounds_check_warning) == (4 if how == "move" else 1), how


@pytest.mark.parametrize("pooling,optimizer", list(itertools.product([PoolingMode.SUM, PoolingMode.MEAN], [SGD, RWA])))
def test_batch_of_one_and_all_empty_batches(pooling, optimizer):
    ours, fb = pair(optimizer=optimizer, pooling_mode=pooling, learning_rate=0.05, eps=0.01,
                    weights_precision=SparseType.FP32)
    T = len(FTM)
    idx, off, _ = batch(3, nb=1)
    for m in (ours, fb):
        out = m(idx.clone(), off.clone())
        out.backward(torch.ones_like(out))
    for a, b in zip(ours.split_embedding_weights(), fb.split_embedding_weights()):
        torch.testing.assert_close(a, b, **TOL[SparseType.FP32])
    before = everything(ours)
    for nb in (1, 4096):
        empty_off = torch.zeros(T * nb + 1, dtype=torch.int64, device=DEV)
        empty_idx = torch.zeros(0, dtype=torch.int64, device=DEV)
        out = ours(empty_idx, empty_off)
        assert out.shape == (nb, sum(SPECS[k][1] for k in FTM)) and not out.any()
        out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    for a, b in zip(before, everything(ours)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_the_offsets_checks_last_program_repairs_after_every_program_counted(index_dtype):
    """WARNING's offsets check and repair are one launch (kernels/bounds.py): the program taking the
    last ticket repairs, so on the GPU it must see every other program's count (a race would leave a
    batch unrepaired, or repaired and not counted). Bad bags near the first, a middle and the last of
    ~1,600 programs, 20 batches in a row on one stream; oracle: ops/bounds.py's PyTorch repair
    (cummax of the clamped offsets, FBGEMM's result) and the count of bad bags + the wrong last offset."""
    from torchrec_triton_tbe._fbgemm import BoundsCheckMode
    from torchrec_triton_tbe.ops.bounds import _invalid_bags, _repaired_offsets

    T, B, L = 4, 400_000, 2
    m = TritonTBE([(1000, 8)] * T, device=DEV, bounds_check_mode=BoundsCheckMode.WARNING)
    N = T * B * L
    indices = torch.randint(0, 1000, (N,), device=DEV, dtype=index_dtype)
    expected_count = 0
    for trial in range(20):
        offsets = torch.arange(0, N + 1, L, device=DEV, dtype=index_dtype)
        if trial % 2:  # every other batch valid: the scratch must come back to zero in between
            for pos in (3, 1024 * 700 + 5, T * B - 2):
                offsets[pos] = N + 7 + trial
            offsets[-1] = N - 1
        want = _repaired_offsets(offsets, N).to(index_dtype)
        bad = int(_invalid_bags(offsets, N).sum()) + int(offsets[-1] != N)
        expected_count += bad
        m(indices, offsets)
        torch.cuda.synchronize()
        assert torch.equal(offsets, want), f"batch {trial}: offsets not repaired as FBGEMM's"
        assert int(m.bounds_check_warning) == expected_count, f"batch {trial}"
        assert m._bounds_scratch.tolist() == [0, 0], f"batch {trial}: scratch left non-zero"


def _bad_id_batches(index_dtype, mode):
    """(name, ids, offsets) of bad batches whose repair FBGEMM's CUDA bounds_check_indices (V1, what its
    TBE runs by default) defines the same way as its CPU op: ids out of range with valid offsets; under
    WARNING, one bag whose start is moved up to the next bag's end (the only bad bag); a short last offset
    still at or after the last bag's start. Its per-bag offsets repair does not cascade and races between
    neighbouring bad bags; under IGNORE every bag writes its own offsets back, so even a lone bad bag's
    repair races with its valid neighbour's write of their shared offset (docs/reliability.md §1)."""
    idx, off, _ = batch(7, index_dtype=index_dtype)
    N = idx.numel()
    ids = idx.clone()
    for pos, value in ((0, -3), (N // 3, 20_000), (N // 2, 5_000 + 1), (N - 1, 10**6)):
        ids[pos] = value
    yield "bad ids", ids, off.clone()
    # The bag's start moves up to the next bag's end: only this bag is bad, and the repair (its end
    # raised to its start) leaves the next bag valid whichever offset it read.
    bag = next(b for b in range(len(off) // 2, len(off) - 2) if off[b + 1] < off[b + 2])
    dec = off.clone()
    dec[bag] = off[bag + 2]
    if mode == "WARNING":
        yield "a bag whose start passes its end", idx.clone(), dec
    last = len(off) - 2
    short = off.clone()
    short[-1] = max(int(off[last]), N - 3)  # the batch's last bag is not empty (asserted)
    assert short[-1] < N
    yield "a short last offset", idx.clone(), short


@pytest.mark.parametrize("mode", ["WARNING", "IGNORE"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_repair_matches_fbgemm_cuda_where_its_repair_is_defined(mode, index_dtype):
    """The CPU tests hold the repair to FBGEMM's CPU bounds_check_indices; a TorchRec user on the GPU
    compares with FBGEMM's CUDA TBE. Both modules in the same mode get each bad batch of
    _bad_id_batches: ids and offsets repaired bitwise alike, forwards and the weights after the backward
    of the repaired batch close, and under WARNING both counters nonzero."""
    from torchrec_triton_tbe._fbgemm import BoundsCheckMode

    bcm = getattr(BoundsCheckMode, mode)
    for name, ids, off in _bad_id_batches(index_dtype, mode):
        ours, fb = pair(optimizer=RWA, learning_rate=0.05, eps=0.01, weights_precision=SparseType.FP32,
                        bounds_check_mode=bcm)
        ours_ids, ours_off, fb_ids, fb_off = ids.clone(), off.clone(), ids.clone(), off.clone()
        o1, o2 = ours(ours_ids, ours_off), fb(fb_ids, fb_off)
        torch.cuda.synchronize()
        assert torch.equal(ours_ids, fb_ids), f"{name}: ids repaired unlike FBGEMM CUDA"
        assert torch.equal(ours_off, fb_off), f"{name}: offsets repaired unlike FBGEMM CUDA"
        assert not torch.equal(ours_ids, ids) or not torch.equal(ours_off, off), f"{name}: nothing to repair"
        torch.testing.assert_close(o1, o2, **TOL[SparseType.FP32])
        grad = torch.randn(o1.shape, generator=torch.Generator().manual_seed(3)).to(DEV)
        o1.backward(grad)
        o2.backward(grad)
        for a, b in zip(ours.split_embedding_weights(), fb.split_embedding_weights()):
            torch.testing.assert_close(a, b, **TOL[SparseType.FP32])
        if mode == "WARNING":
            assert int(ours.bounds_check_warning) > 0 and int(fb.bounds_check_warning) > 0, name
        else:
            assert int(ours.bounds_check_warning) == 0, name
