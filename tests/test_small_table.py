"""The small-table path (kernels/small_table.py, ops/small_table.py): tables of a few rows pool through a
per-bag histogram times the table and sum their gradient per row the same way. Same results as the
generic path (to fp32 summation order) for every optimizer, pooling, per-sample weights and weights
dtype; the same as FBGEMM's CPU TBE; calls the path cannot take (VBE, the fused bounds check) run
those tables through the generic kernels."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tbe_cases import (
    EmbOptimType,
    PoolingMode,
    SparseType,
    assert_close,
    make_pair,
    oracle_state,
    oracle_step,
    skewed_batch,
    tolerance,
)
from torchrec_triton_tbe.config import load_named
from torchrec_triton_tbe.ops import small_table as small_ops
from torchrec_triton_tbe.ops import transpose as tr_ops
from torchrec_triton_tbe.plan import TablePlan

BASE = load_named("interpreter")
SMALL = BASE.replace_small_table(max_rows=64, bags=16, groups=2)
# Tables 0, 1 and 3 are small; table 2 is not (rows); table 4 is read by two features (generic).
SPECS = [(9, 8), (40, 12), (300, 16), (64, 4), (5, 8)]
FTM = [0, 1, 2, 3, 4, 4]


def _train(config, optimizer, pooling, weighted, weights=SparseType.FP32, steps=2, index_dtype=torch.int64, **kw):
    ours, _ = make_pair(SPECS, FTM, oracle="reference", seed=21, kernel_config=config, optimizer=optimizer,
                        pooling_mode=pooling, weights_precision=weights, learning_rate=0.2, eps=0.05,
                        weight_decay=0.01, **kw)
    g = torch.Generator().manual_seed(22)
    for _ in range(steps):
        # Bags of up to 48 ids over tables of 5 to 64 rows: small rows repeat within a bag.
        batch = skewed_batch([r for r, _ in SPECS], FTM, B=20, max_L=48, generator=g, weighted=weighted,
                             index_dtype=index_dtype)
        out = ours(batch.indices, batch.offsets, batch.per_sample_weights)
        out.backward(torch.randn(out.shape, generator=g))
    return ours


def test_plan_gives_small_tables_buckets_of_their_own():
    plan = TablePlan.build(SPECS, FTM, small_max_rows=64, small_max_dim=128)
    assert plan.small_tables == {0, 1, 3}
    small = [(b.block_d, b.tables) for b in plan.buckets if b.small]
    assert small == [(4, (3,)), (8, (0,)), (16, (1,))]
    assert [(b.block_d, b.tables) for b in plan.buckets if not b.small] == [(8, (4,)), (16, (2,))]
    keys = [(b.key_begin, b.key_end) for b in plan.buckets]
    assert keys[0][0] == 0 and all(a[1] == b[0] for a, b in zip(keys, keys[1:])) and keys[-1][1] == plan.total_rows
    # Off (the default of every shipped config): the buckets of the plain width grouping.
    off = TablePlan.build(SPECS, FTM)
    assert not off.small_tables and [(b.block_d, b.tables) for b in off.buckets] == [(4, (3,)), (8, (0, 4)), (16, (1, 2))]
    assert TablePlan.build(SPECS, FTM, small_max_rows=64, small_max_dim=8).small_tables == {0, 3}
    # The small groups are the small buckets' tables; without the split the buckets are the plain ones.
    assert [(g.block_d, g.tables, g.features) for g in plan.small_groups] == [(4, (3,), (3,)), (8, (0,), (0,)),
                                                                            (16, (1,), (1,))]
    unsplit = dataclasses.replace(plan, small_split=False)
    assert unsplit.buckets == off.buckets and unsplit.small_groups == plan.small_groups
    # Shipped: on for the H200's backward only (measured there), off elsewhere.
    for name in ("interpreter", "sm100"):
        assert load_named(name).small_table.max_rows == 0, name
    sm90 = load_named("sm90").small_table
    assert (sm90.max_rows, sm90.forward, sm90.backward) == (64, 0, 1) and sm90.backward_min_bag > 0


def test_small_groups_hold_at_most_one_grid_of_features(monkeypatch):
    """A small group's launches take one feature per grid-y entry (CUDA: at most 65,535): a width with
    more small tables splits into groups of that many. With the limit shrunk to 2, three 8-wide small
    tables make two groups, and a forward and a training step equal one group's."""
    from torchrec_triton_tbe.ops import launch as launch_ops

    specs, ftm = [(9, 8), (5, 8), (7, 8), (300, 8)], [0, 1, 2, 3]

    def step():
        ours, _ = make_pair(specs, ftm, oracle="reference", seed=3, kernel_config=SMALL, learning_rate=0.2,
                            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, eps=0.05)
        batch = skewed_batch([r for r, _ in specs], ftm, B=20, max_L=30, generator=torch.Generator().manual_seed(4))
        out = ours(batch.indices, batch.offsets)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(5)))
        return ours, [out, *ours.split_embedding_weights(), ours.momentum1]

    one, whole = step()
    assert [(g.block_d, g.tables) for g in one.spec.plan.small_groups] == [(8, (0, 1, 2))]
    monkeypatch.setattr(launch_ops, "MAX_GRID_Y", 2)
    ran = []
    for name in ("forward", "backward"):
        real = getattr(small_ops, name)
        monkeypatch.setattr(small_ops, name, lambda *a, _real=real, _name=name, **k: (ran.append((_name, a[1])),
                                                                                       _real(*a, **k))[1])
    two, sliced = step()
    assert ran == [("forward", 0), ("forward", 1), ("backward", 0), ("backward", 1)]
    assert [(g.block_d, g.tables, g.features) for g in two.spec.plan.small_groups] == [(8, (0, 1), (0, 1)),
                                                                                      (8, (2,), (2,))]
    names = ["output"] + [f"table {t}" for t in range(len(specs))] + ["momentum1"]
    assert len(whole) == len(sliced) == len(names)
    for what, a, b in zip(names, whole, sliced):
        # Each small table's sums are its own program's, wherever its group starts: equal bit for bit.
        assert torch.equal(a.detach(), b.detach()), what


@pytest.mark.parametrize("optimizer,pooling,weighted,weights", [
    (EmbOptimType.EXACT_ROWWISE_ADAGRAD, PoolingMode.SUM, False, SparseType.FP32),
    (EmbOptimType.EXACT_ROWWISE_ADAGRAD, PoolingMode.MEAN, True, SparseType.FP32),
    (EmbOptimType.EXACT_SGD, PoolingMode.SUM, True, SparseType.FP16),
    (EmbOptimType.ADAM, PoolingMode.MEAN, False, SparseType.FP32),
    (EmbOptimType.LAMB, PoolingMode.SUM, True, SparseType.FP32),
    (EmbOptimType.PARTIAL_ROWWISE_ADAM, PoolingMode.SUM, False, SparseType.BF16),
    (EmbOptimType.EXACT_ADAGRAD, PoolingMode.MEAN, False, SparseType.FP32),
    (EmbOptimType.LARS_SGD, PoolingMode.SUM, False, SparseType.FP32),
], ids=["rowwise", "rowwise-mean-weighted", "sgd-weighted-fp16", "adam-mean", "lamb-weighted",
        "partial-adam-bf16", "adagrad-mean", "lars"])
def test_small_path_trains_as_the_generic_path(optimizer, pooling, weighted, weights):
    generic = _train(BASE, optimizer, pooling, weighted, weights)
    small = _train(SMALL, optimizer, pooling, weighted, weights)
    assert any(b.small for b in small.spec.plan.buckets)
    # fp16 / bf16 rows: one rounding step of the stored weight where the fp32 sums differ in order.
    atol, rtol = (2e-6, 2e-6) if weights == SparseType.FP32 else (1e-2, 1e-2)
    for t, (a, b) in enumerate(zip(small.split_embedding_weights(), generic.split_embedding_weights())):
        assert_close(a.float(), b.float(), f"table {t}", atol=atol, rtol=rtol)
    for state in ("momentum1", "momentum2", "row_counter"):
        a, b = getattr(small, state), getattr(generic, state)
        if a.numel():
            assert_close(a.float(), b.float(), state, atol=max(atol, 1e-5), rtol=1e-5)


@pytest.mark.parametrize("optimizer", [EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.EXACT_SGD])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_small_path_matches_fbgemm(optimizer, index_dtype):
    specs, ftm = SPECS[:4], FTM[:4]  # FBGEMM's CPU backward needs a non-decreasing feature_table_map
    ours, fb = make_pair(specs, ftm, seed=5, kernel_config=SMALL, optimizer=optimizer, learning_rate=0.1, eps=0.1,
                         embedding_table_index_type=index_dtype, embedding_table_offset_type=index_dtype)
    assert ours.spec.plan.small_tables == {0, 1, 3}
    g = torch.Generator().manual_seed(6)
    tol = tolerance(torch.float32)
    for step in range(2):
        batch = skewed_batch([r for r, _ in specs], ftm, B=20, max_L=48, generator=g, index_dtype=index_dtype)
        out = ours(batch.indices, batch.offsets)
        grad = torch.randn(out.shape, generator=g)
        ref = oracle_step(fb, batch, grad)
        # After a step a small row holds the sum of ~100 gradient rows, and a bag pools ~50 such rows:
        # fp32 summation order (ours per bag chunk, FBGEMM's per row) moves outputs by ~1e-5 of themselves.
        assert_close(out, ref, f"step {step}: forward", atol=1e-4, rtol=1e-4)
        out.backward(grad)
    tables, states = oracle_state(fb)
    for t, (a, b) in enumerate(zip(ours.split_embedding_weights(), tables)):
        assert_close(a, b, f"table {t}", **tol)
    for t, (a, b) in enumerate(zip(ours.split_optimizer_states(), states)):
        for x, y in zip(a, b):
            assert_close(x, y, f"table {t}: state", atol=1e-4, rtol=1e-4)


def _refuse_small(*_args, **_kwargs):
    raise AssertionError("the small-table kernels ran")


def test_calls_the_path_cannot_take_run_the_generic_kernels(monkeypatch):
    # Where it applies, the small kernels do run ...
    monkeypatch.setattr(small_ops, "forward", _refuse_small)
    with pytest.raises(AssertionError, match="small-table kernels ran"):
        _train(SMALL, EmbOptimType.EXACT_SGD, PoolingMode.SUM, False, steps=1)
    # ... and with the fused bounds check they do not, forward or backward, and training is the generic one.
    monkeypatch.setattr(small_ops, "backward", _refuse_small)
    fused = _train(SMALL, EmbOptimType.EXACT_ROWWISE_ADAGRAD, PoolingMode.SUM, True, steps=2, fused_bounds_check=True)
    generic = _train(BASE, EmbOptimType.EXACT_ROWWISE_ADAGRAD, PoolingMode.SUM, True, steps=2, fused_bounds_check=True)
    for a, b in zip(fused.split_embedding_weights(), generic.split_embedding_weights()):
        assert torch.equal(a, b)
    # Variable batch per feature (VBE): the generic kernels too.
    ours, _ = make_pair(SPECS, FTM, oracle="reference", seed=1, kernel_config=SMALL)
    Bs = [3, 5, 2, 4, 1, 6]
    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(0, 9, (sum(Bs),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids, at = [], 0
    for t, b in enumerate(Bs):
        n = int(lengths[at:at + b].sum())
        ids.append(torch.randint(0, SPECS[FTM[t]][0], (n,), generator=g))
        at += b
    out = ours(torch.cat(ids), offsets, batch_size_per_feature_per_rank=[[b] for b in Bs])
    out.backward(torch.randn(out.shape, generator=g))


def test_each_pass_takes_the_path_on_its_own(monkeypatch):
    # small_table.forward: 0 (the shipped choice): the forward runs the small buckets through the generic
    # kernels, the backward still through the small-table kernels, and training is the generic one's.
    ran = []
    real = small_ops.backward
    monkeypatch.setattr(small_ops, "forward", _refuse_small)
    monkeypatch.setattr(small_ops, "backward", lambda *a, **k: (ran.append(a[1]), real(*a, **k)))
    bwd_only = SMALL.replace_small_table(forward=0)
    for weighted in (False, True):
        ran.clear()
        small = _train(bwd_only, EmbOptimType.EXACT_ROWWISE_ADAGRAD, PoolingMode.MEAN, weighted)
        generic = _train(BASE, EmbOptimType.EXACT_ROWWISE_ADAGRAD, PoolingMode.MEAN, weighted)
        # Without the forward's path the small tables keep the generic buckets (no bucket of their own).
        assert not any(b.small for b in small.spec.plan.buckets)
        assert sorted(set(ran)) == [g for g, grp in enumerate(small.spec.plan.small_groups) if grp.features]
        for t, (a, b) in enumerate(zip(small.split_embedding_weights(), generic.split_embedding_weights())):
            assert_close(a, b, f"table {t}", atol=2e-6, rtol=2e-6)
    # ... and backward: 0 leaves the backward to the generic kernels too.
    monkeypatch.setattr(small_ops, "backward", _refuse_small)
    neither = _train(SMALL.replace_small_table(forward=0, backward=0), EmbOptimType.EXACT_SGD, PoolingMode.SUM, False)
    generic = _train(BASE, EmbOptimType.EXACT_SGD, PoolingMode.SUM, False)
    for a, b in zip(neither.split_embedding_weights(), generic.split_embedding_weights()):
        assert torch.equal(a, b)


def _bags_of(lengths_per_feature, B, generator):
    """A fixed batch whose feature t's bags have lengths drawn from lengths_per_feature[t] (lo, hi)."""
    lengths = torch.cat([torch.randint(lo, hi + 1, (B,), generator=generator) for lo, hi in lengths_per_feature])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids = [torch.randint(0, SPECS[FTM[t]][0], (int(lengths[t * B:(t + 1) * B].sum()),), generator=generator)
           for t in range(len(FTM))]
    return torch.cat(ids), offsets


def test_backward_min_bag_picks_the_path_per_feature_and_call():
    # backward_min_bag 10: per call, a small table's feature whose bags average >= 10 ids takes the path
    # (feature 3: exactly 10 each), one with shorter bags keeps the generic kernels; the decision is the
    # device's (no sync), so the sort keys show it: the taken features' lookups keep the sentinel key.
    cfg = SMALL.replace_small_table(forward=0, backward_min_bag=10)
    B = 6
    batches = [((20, 30), (0, 3), (0, 5), (10, 10), (1, 4), (0, 2)),   # features 0 and 3 taken
               ((0, 3), (12, 20), (0, 5), (0, 4), (1, 4), (0, 2))]     # now feature 1 only
    taken = [{0, 3}, {1}]
    g = torch.Generator().manual_seed(5)
    data = [_bags_of(lengths, B, g) for lengths in batches]
    grads = [torch.randn(B, sum(d for _, d in (SPECS[k] for k in FTM)), generator=g) for _ in data]
    trained = []
    for config in (cfg, BASE):
        ours, _ = make_pair(SPECS, FTM, oracle="reference", seed=21, kernel_config=config,
                            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.2, eps=0.05)
        for (ids, offsets), grad, want in zip(data, grads, taken):
            if config is cfg:
                runs = tr_ops.build_runs(ours.spec, ids, offsets, B)
                lengths = offsets[1:] - offsets[:-1]
                sentinel = int((runs.sorted_keys == ours.spec.plan.sentinel_key).sum())
                assert sentinel == sum(int(lengths[t * B:(t + 1) * B].sum()) for t in want)
            ours(ids, offsets).backward(grad)
        trained.append(ours)
    small, generic = trained
    for t, (a, b) in enumerate(zip(small.split_embedding_weights(), generic.split_embedding_weights())):
        assert_close(a, b, f"table {t}", atol=2e-6, rtol=2e-6)
    assert_close(small.momentum1, generic.momentum1, "row-wise state", atol=1e-5, rtol=1e-5)


def test_backward_launches_nothing_where_no_feature_can_take_the_path(monkeypatch):
    # Host ints decide whether the path launches at all: a batch under backward_min_batch bags, or with
    # fewer lookups in all than one feature needs, gives every lookup its key and runs no small kernel.
    monkeypatch.setattr(small_ops, "backward", _refuse_small)
    g = torch.Generator().manual_seed(9)
    B = 6
    ids, offsets = _bags_of(((20, 30),) + ((0, 3),) * (len(FTM) - 1), B, g)
    for changes in (dict(backward_min_batch=B + 1), dict(backward_min_bag=ids.numel() // B + 1)):
        cfg = SMALL.replace_small_table(forward=0, **changes)
        ours, _ = make_pair(SPECS, FTM, oracle="reference", seed=21, kernel_config=cfg)
        assert not small_ops.backward_applies(ours.spec, None, B, ids.numel())
        runs = tr_ops.build_runs(ours.spec, ids, offsets, B)
        assert not bool((runs.sorted_keys == ours.spec.plan.sentinel_key).any())
        ours(ids, offsets).backward(torch.randn(B, ours.spec.plan.total_D, generator=g))
    # ... and where one can (feature 0's bags average 20-30 ids), it does.
    cfg = SMALL.replace_small_table(forward=0, backward_min_bag=20, backward_min_batch=B)
    ours, _ = make_pair(SPECS, FTM, oracle="reference", seed=21, kernel_config=cfg)
    assert small_ops.backward_applies(ours.spec, None, B, ids.numel())
    with pytest.raises(AssertionError, match="small-table kernels ran"):
        ours(ids, offsets).backward(torch.randn(B, ours.spec.plan.total_D, generator=g))


def test_switching_the_path_on_mid_training_keeps_training():
    generic = _train(BASE, EmbOptimType.ADAM, PoolingMode.SUM, False, steps=2)
    switched, _ = make_pair(SPECS, FTM, oracle="reference", seed=21, kernel_config=BASE, optimizer=EmbOptimType.ADAM,
                            pooling_mode=PoolingMode.SUM, learning_rate=0.2, eps=0.05, weight_decay=0.01)
    g = torch.Generator().manual_seed(22)
    for step in range(2):
        if step == 1:
            switched.set_kernel_config(SMALL)
            assert any(b.small for b in switched.spec.plan.buckets)
        batch = skewed_batch([r for r, _ in SPECS], FTM, B=20, max_L=48, generator=g)
        out = switched(batch.indices, batch.offsets)
        out.backward(torch.randn(out.shape, generator=g))
    for a, b in zip(switched.split_embedding_weights(), generic.split_embedding_weights()):
        assert_close(a, b, "weights", atol=2e-6, rtol=2e-6)
    switched.set_kernel_config(BASE)
    assert not any(b.small for b in switched.spec.plan.buckets)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(rows=st.lists(st.integers(1, 64), min_size=1, max_size=3), dim=st.sampled_from([3, 4, 12, 32]),
       max_L=st.integers(0, 40), B=st.integers(1, 24), mean=st.booleans(), weighted=st.booleans())
def test_small_forward_equals_generic_forward(rows, dim, max_L, B, mean, weighted):
    specs = [(r, dim) for r in rows]
    pooling = PoolingMode.MEAN if mean else PoolingMode.SUM
    a, _ = make_pair(specs, None, oracle="reference", seed=3, kernel_config=SMALL, pooling_mode=pooling)
    b, _ = make_pair(specs, None, oracle="reference", seed=3, kernel_config=BASE, pooling_mode=pooling)
    assert a.spec.plan.small_tables == set(range(len(rows)))
    batch = skewed_batch(rows, list(range(len(rows))), B=B, max_L=max_L, generator=torch.Generator().manual_seed(B),
                         weighted=weighted)
    assert_close(a(batch.indices, batch.offsets, batch.per_sample_weights),
                 b(batch.indices, batch.offsets, batch.per_sample_weights), "forward", atol=2e-6, rtol=2e-6)


def test_hoisted_transpose_changes_nothing_on_the_small_path():
    plain = _train(SMALL, EmbOptimType.EXACT_ROWWISE_ADAGRAD, PoolingMode.SUM, True, steps=1)
    hoisted = _train(SMALL, EmbOptimType.EXACT_ROWWISE_ADAGRAD, PoolingMode.SUM, True, steps=1, hoist_transpose=True)
    for a, b in zip(plain.split_embedding_weights(), hoisted.split_embedding_weights()):
        assert torch.equal(a, b)
    assert torch.equal(plain.momentum1, hoisted.momentum1)


def test_a_forward_of_small_tables_only_advances_its_count(monkeypatch):
    """Every table on the small-table path: the forward has no generic launch to carry the step count's
    advance (ops/forward.StepAdvance), and torch ops advance it instead, one per forward, with the copy
    its backward applies; the tables train as on the generic path."""
    kw = dict(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, weights_precision=SparseType.FP16,
              stochastic_rounding=True, learning_rate=0.2)
    specs = [(9, 8), (5, 4)]
    a, _ = make_pair(specs, None, oracle="reference", seed=3, kernel_config=SMALL, **kw)
    b, _ = make_pair(specs, None, oracle="reference", seed=3, kernel_config=BASE, **kw)
    assert a.spec.reads_step_count and all(bucket.small for bucket in a.spec.plan.buckets)
    from torchrec_triton_tbe.ops import forward as fwd_ops

    by_torch_ops = []
    real = fwd_ops.advance_by_torch_ops
    monkeypatch.setattr(fwd_ops, "advance_by_torch_ops", lambda advance: (by_torch_ops.append(advance), real(advance)))
    g = torch.Generator().manual_seed(4)
    for step in range(2):
        batch = skewed_batch([r for r, _ in specs], [0, 1], B=5, max_L=6, generator=g)
        grad = torch.randn(5, 12, generator=g)
        outs = [m(batch.indices, batch.offsets) for m in (a, b)]
        assert int(outs[0].grad_fn.step.saved) == int(a.iter) == step + 1
        for out in outs:
            out.backward(grad)
    assert int(a.iter) == int(b.iter) == 2
    # Only the small-table module's forwards took the torch ops (b's first launch advanced b's count).
    assert [advance.count is a.iter for advance in by_torch_ops] == [True, True]
    for x, y in zip(a.split_embedding_weights(), b.split_embedding_weights()):
        assert_close(x, y, "weights", atol=1e-3, rtol=1e-3)


def test_a_forward_with_some_small_tables_advances_its_count_once(monkeypatch):
    """Small tables beside generic ones: the small-table forward launches first, and the first generic
    launch carries the step count's advance; no torch op advances it. One advance per forward."""
    from torchrec_triton_tbe.ops import forward as fwd_ops
    from torchrec_triton_tbe.ops import launch as launch_ops

    monkeypatch.setattr(fwd_ops, "advance_by_torch_ops", lambda advance: pytest.fail("torch ops advanced the count"))
    m, _ = make_pair(SPECS, FTM, oracle="reference", seed=3, kernel_config=SMALL,
                     optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, weights_precision=SparseType.FP16,
                     stochastic_rounding=True)
    assert any(b.small for b in m.spec.plan.buckets) and any(not b.small for b in m.spec.plan.buckets)
    batch = skewed_batch([r for r, _ in SPECS], FTM, B=5, max_L=6, generator=torch.Generator().manual_seed(6))
    recorded: list = []
    with launch_ops.recording(recorded):
        m(batch.indices, batch.offsets)
    names = [r.kernel.__name__ for r in recorded]
    first = names.index("_pooled_forward_kernel")
    assert "_small_forward_kernel" in names[:first]
    assert [r.constexprs.get("ADVANCE", False) for r in recorded if r.kernel.__name__ == "_pooled_forward_kernel"][0]
    assert sum(bool(r.constexprs.get("ADVANCE")) for r in recorded) == 1 and int(m.iter) == 0
    for step in range(2):
        out = m(batch.indices, batch.offsets)
        out.backward(torch.ones_like(out))
    assert int(m.iter) == 2
