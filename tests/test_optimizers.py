"""Every fused optimizer (kernels/optim.py) against an oracle, its FBGEMM state API, and which
optimizer keywords are accepted, implemented or rejected (compat.py).

Oracles: FBGEMM's CPU TBE where it implements the configuration (EXACT_SGD, EXACT_ADAGRAD,
EXACT_ROWWISE_ADAGRAD, gradient clipping); else the pure-PyTorch reference
(torchrec_triton_tbe/reference.py, which follows FBGEMM's update rules line by line and is itself
checked against FBGEMM's CPU TBE below where both exist). fbgemm-gpu-cpu 1.9.0's row-wise Adagrad
applies neither weight decay mode (measured: with DECOUPLE its rows come out exactly 1 - lr * wd
times ours, i.e. undecayed, and with L2 its state lacks the wd * w term, although the CPU template
in FBGEMM's source has both) and its CPU update has no max_norm, so those are checked against the
reference here and against FBGEMM's CUDA TBE in tests/gpu. Each test trains several steps on
skewed batches (repeated rows, both backward paths) and compares weights and every state tensor.
"""

import pytest
import torch

from tbe_cases import (
    EmbOptimType,
    PoolingMode,
    SparseType,
    assert_close,
    make_pair,
    oracle_step,
    skewed_batch,
)
from test_backward import SPECS, FTM, assert_same_state, train_and_compare
from torchrec_triton_tbe._fbgemm import (
    CounterBasedRegularizationDefinition,
    CowClipDefinition,
    GlobalWeightDecayDefinition,
    UserEnabledConfigDefinition,
    WeightDecayMode,
)
from torchrec_triton_tbe.module import TritonTBE
from torchrec_triton_tbe.ops.spec import HYPER_FIELDS
from torchrec_triton_tbe.kernels import optim as optim_kernels

RWA = EmbOptimType.EXACT_ROWWISE_ADAGRAD
BF16_STATE = {"momentum1": SparseType.BF16, "momentum2": SparseType.BF16}

# name -> (optimizer, extra keywords, FBGEMM's CPU TBE implements it)
VARIANTS = {
    "adagrad": (EmbOptimType.EXACT_ADAGRAD, {}, True),
    "rowwise-l2": (RWA, dict(weight_decay=0.05, weight_decay_mode=WeightDecayMode.L2), False),
    "rowwise-decouple": (RWA, dict(weight_decay=0.05, weight_decay_mode=WeightDecayMode.DECOUPLE), False),
    "rowwise-max-norm": (RWA, dict(max_norm=0.6), False),
    "rowwise-clipped": (RWA, dict(gradient_clipping=True, max_gradient=0.3), True),
    "sgd-clipped": (EmbOptimType.EXACT_SGD, dict(gradient_clipping=True, max_gradient=0.3), True),
    "adam": (EmbOptimType.ADAM, dict(weight_decay=0.01, beta1=0.8, beta2=0.95), False),
    "adam-rowwise-bias": (
        EmbOptimType.ADAM, dict(extra_optimizer_config=UserEnabledConfigDefinition(use_rowwise_bias_correction=True)),
        False,
    ),
    "partial-rowwise-adam": (EmbOptimType.PARTIAL_ROWWISE_ADAM, dict(weight_decay=0.01), False),
    "partial-rowwise-adam-bf16": (EmbOptimType.PARTIAL_ROWWISE_ADAM, dict(optimizer_state_dtypes=BF16_STATE), False),
    "lamb": (EmbOptimType.LAMB, dict(weight_decay=0.01), False),
    "partial-rowwise-lamb": (EmbOptimType.PARTIAL_ROWWISE_LAMB, dict(beta1=0.85, weight_decay=0.02), False),
    "lars-sgd": (EmbOptimType.LARS_SGD, dict(weight_decay=0.01, eta=0.05, momentum=0.8), False),
}
# (pooling, weighted, weights, ids): each variant trains two of these, rotating, so that every variant
# meets fp32 and a 2-byte precision, SUM and MEAN, weighted and not, int32 and int64.
COMBOS = [
    (PoolingMode.SUM, False, SparseType.FP32, torch.int64),
    (PoolingMode.MEAN, True, SparseType.FP16, torch.int32),
    (PoolingMode.SUM, True, SparseType.BF16, torch.int64),
    (PoolingMode.MEAN, False, SparseType.FP32, torch.int32),
]
CASES = [(name, COMBOS[(2 * i + j) % len(COMBOS)]) for i, name in enumerate(VARIANTS) for j in range(2)]


def _case_id(case):
    name, (pm, weighted, wp, it) = case
    return f"{name}-{pm.name}-{'weighted' if weighted else 'plain'}-{wp.name}-{str(it)[6:]}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_training_matches_oracle(case):
    name, (pooling, weighted, weights, index_dtype) = case
    optimizer, extra, fbgemm_cpu = VARIANTS[name]
    train_and_compare(SPECS, FTM, pooling, weighted, weights, optimizer, index_dtype, fbgemm_cpu=fbgemm_cpu,
                      **extra)


@pytest.mark.parametrize("name", [n for n, (_, _, cpu) in VARIANTS.items() if cpu])
def test_reference_matches_fbgemm_cpu(name):
    """The reference is the oracle of the optimizers FBGEMM's CPU TBE lacks: where both exist they agree."""
    optimizer, extra, _ = VARIANTS[name]
    kwargs = dict(optimizer=optimizer, learning_rate=0.2, eps=0.1, stochastic_rounding=False, **extra)
    _, fbgemm = make_pair(SPECS, FTM, oracle="fbgemm", seed=3, **kwargs)
    _, reference = make_pair(SPECS, FTM, oracle="reference", seed=3, **kwargs)
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        batch = skewed_batch([r for r, _ in SPECS], FTM, B=5, max_L=6, generator=g, weighted=True)
        grad = torch.randn(5, sum(SPECS[k][1] for k in FTM), generator=g)
        oracle_step(fbgemm, batch, grad)
        oracle_step(reference, batch, grad)
    assert_same_state(fbgemm, reference, "fbgemm vs reference", "after 3 steps", torch.float32, torch.float32)


def test_max_norm_bounds_every_updated_row():
    ours, _ = make_pair([(12, 8)], oracle="reference", optimizer=RWA, learning_rate=2.0, max_norm=0.5)
    before = ours.split_embedding_weights()[0].clone()
    indices = torch.tensor([0, 0, 0, 3, 5, 5])
    ours(indices, torch.tensor([0, 3, 6])).backward(torch.randn(2, 8) * 10)
    after = ours.split_embedding_weights()[0]
    norms = after.norm(dim=1)
    assert (norms[[0, 3, 5]] <= 0.5 * (1 + 1e-6)).all()
    untouched = [r for r in range(12) if r not in (0, 3, 5)]
    assert (before[untouched].norm(dim=1) > 0.5).any(), "the test needs rows max_norm would have rescaled"
    assert torch.equal(after[untouched], before[untouched]), "rows not looked up keep their weights"


@pytest.mark.parametrize("name", ["adam", "partial-rowwise-lamb", "lars-sgd", "rowwise-l2"])
def test_hyper_parameter_updates_reach_the_next_step(name):
    """update_hyper_parameters (FBGEMM's keys) and set_optimizer_step change the next update: the new
    values (as FBGEMM's), and bias correction from step + 1 (as FBGEMM's on a fresh module; after a
    forward FBGEMM 1.9's updates ignore set_optimizer_step, docs/design.md "Optimizers")."""
    optimizer, extra, _ = VARIANTS[name]
    ours, ref = make_pair(SPECS, FTM, oracle="reference", optimizer=optimizer, learning_rate=0.1, eps=0.1,
                          stochastic_rounding=False, **extra)
    g = torch.Generator().manual_seed(9)
    for step in range(2):
        if step == 1:
            new = {"beta1": 0.5, "beta2": 0.9, "eps": 0.02, "weight_decay": 0.03, "lr": 0.05}
            ours.update_hyper_parameters(new)
            ours.set_optimizer_step(7)
            ref.beta1, ref.beta2, ref.eps, ref.weight_decay, ref.lr = (new[k] for k in ("beta1", "beta2", "eps",
                                                                                         "weight_decay", "lr"))
            ref.step_count = 7
        batch = skewed_batch([r for r, _ in SPECS], FTM, B=4, max_L=5, generator=g)
        out = ours(batch.indices, batch.offsets)
        grad = torch.randn(out.shape, generator=g)
        oracle_step(ref, batch, grad)
        out.backward(grad)
    assert int(ours.iter) == (7 if name == "lars-sgd" else 8)  # LARS's forward, as FBGEMM's, counts nothing
    assert_same_state(ours, ref, "reference", f"{name} after hyper-parameter updates", torch.float32, torch.float32)


@pytest.mark.parametrize(
    "name,keys,shapes",
    [
        ("adagrad", ["sum"], ["rows, dim"]),
        ("adam", ["exp_avg", "exp_avg_sq"], ["rows, dim", "rows, dim"]),
        ("adam-rowwise-bias", ["exp_avg", "exp_avg_sq", "row_counter"], ["rows, dim", "rows, dim", "rows"]),
        ("partial-rowwise-adam", ["exp_avg", "exp_avg_sq"], ["rows, dim", "rows"]),
        ("lamb", ["exp_avg", "exp_avg_sq"], ["rows, dim", "rows, dim"]),
        ("partial-rowwise-lamb", ["exp_avg", "exp_avg_sq"], ["rows, dim", "rows"]),
        ("lars-sgd", ["momentum_buffer"], ["rows, dim"]),
        ("rowwise-l2", ["sum"], ["rows"]),
    ],
)
def test_state_layout_is_fbgemms(name, keys, shapes):
    """FBGEMM's split_optimizer_states / get_optimizer_state layout per optimizer (its docstring and
    get_optimizer_state; FBGEMM raises for LARS_SGD, here its momentum is named as torch's SGD names it)."""
    optimizer, extra, _ = VARIANTS[name]
    m = TritonTBE(SPECS, device="cpu", optimizer=optimizer, **extra)
    for k, (rows, dim) in enumerate(SPECS):
        expected = [(rows, dim) if s == "rows, dim" else (rows,) for s in shapes]
        assert [tuple(t.shape) for t in m.split_optimizer_states()[k]] == expected
        assert list(m.get_optimizer_state()[k]) == keys
        assert [tuple(t.shape) for t in m.get_optimizer_state()[k].values()] == expected
    # Views: writing the state through the getter changes the module's state.
    m.split_optimizer_states()[1][0].fill_(0.25)
    assert float(m.get_optimizer_state()[1][keys[0]].sum()) == pytest.approx(0.25 * m.split_optimizer_states()[1][0].numel())


@pytest.mark.parametrize("optimizer", [EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ADAGRAD, RWA])
def test_state_getters_match_fbgemm_cpu(optimizer):
    ours, fb = make_pair(SPECS, FTM, oracle="fbgemm", optimizer=optimizer)
    assert [[tuple(s.shape) for s in t] for t in ours.split_optimizer_states()] == [
        [tuple(s.shape) for s in t] for t in fb.split_optimizer_states()]
    assert [{k: tuple(v.shape) for k, v in d.items()} for d in ours.get_optimizer_state()] == [
        {k: tuple(v.shape) for k, v in d.items()} for d in fb.get_optimizer_state()]


def test_bf16_state_is_stored_in_bf16():
    m = TritonTBE(SPECS, device="cpu", optimizer=EmbOptimType.PARTIAL_ROWWISE_ADAM, optimizer_state_dtypes=BF16_STATE)
    assert m.momentum1.dtype == m.momentum2.dtype == torch.bfloat16
    assert m.momentum1.numel() == sum(r * d for r, d in SPECS) and m.momentum2.numel() == sum(r for r, _ in SPECS)


def test_hyper_parameter_layout_matches_the_kernels():
    for i, name in enumerate(HYPER_FIELDS):
        assert getattr(optim_kernels, "H_" + name.upper()).value == i


def test_rows_not_looked_up_keep_weights_and_state():
    """Adam with weight decay would move every row if it updated densely; only looked-up rows change."""
    ours, _ = make_pair([(10, 4)], oracle="reference", optimizer=EmbOptimType.ADAM, weight_decay=0.5)
    before = ours.split_embedding_weights()[0].clone()
    ours(torch.tensor([2, 7, 7]), torch.tensor([0, 3])).backward(torch.ones(1, 4))
    after = ours.split_embedding_weights()[0]
    changed = (after != before).any(1)
    assert changed.tolist() == [i in (2, 7) for i in range(10)]
    assert (ours.split_optimizer_states()[0][0].abs().sum(1) > 0).tolist() == changed.tolist()


# ---------------------------------------------------------------------------------------------- keywords
# FBGEMM 1.6.0's SplitTableBatchedEmbeddingBagsCodegen.__init__ keywords (its source at tag v1.6.0; the
# CPU test environment has 1.9.0, whose keywords are read from the installed class).
FBGEMM_1_6_KEYWORDS = (
    "embedding_specs feature_table_map cache_algorithm cache_load_factor cache_sets cache_reserved_memory "
    "cache_precision weights_precision output_dtype enforce_hbm optimizer record_cache_metrics "
    "gather_uvm_cache_stats stochastic_rounding gradient_clipping max_gradient max_norm learning_rate eps momentum "
    "weight_decay weight_decay_mode eta beta1 beta2 ensemble_mode emainplace_mode counter_based_regularization "
    "cowclip_regularization pooling_mode device bounds_check_mode uvm_non_rowwise_momentum use_experimental_tbe "
    "prefetch_pipeline stats_reporter_config table_names optimizer_state_dtypes multipass_prefetch_config "
    "global_weight_decay uvm_host_mapped extra_optimizer_config tbe_input_multiplexer_config "
    "embedding_table_index_type embedding_table_offset_type embedding_shard_info enable_raw_embedding_streaming "
    "res_params"
).split()


def test_every_fbgemm_keyword_has_exactly_one_policy():
    """Each keyword of FBGEMM 1.6.0's and 1.9.0's constructor is accepted by TritonTBE and is, in compat.py,
    used, an optimizer keyword, ignored (changes nothing here) or rejected when not at its default."""
    import inspect

    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen
    from torchrec_triton_tbe import compat

    v19 = [n for n in inspect.signature(SplitTableBatchedEmbeddingBagsCodegen.__init__).parameters if n != "self"]
    ours = inspect.signature(TritonTBE.__init__).parameters
    groups = [compat.USED, compat.OPTIMIZER_KEYWORDS, compat.IGNORED, list(compat.UNSUPPORTED)]
    for name in sorted(set(v19) | set(FBGEMM_1_6_KEYWORDS)):
        assert name in ours, name
        assert sum(name in g for g in groups) == 1, (name, [name in g for g in groups])
    assert set(FBGEMM_1_6_KEYWORDS) <= set(v19)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(extra_optimizer_config=UserEnabledConfigDefinition()),  # every feature off, as FBGEMM's code passes it
        dict(global_weight_decay=GlobalWeightDecayDefinition()),  # read only with DECOUPLE_GLOBAL
        dict(optimizer=EmbOptimType.PARTIAL_ROWWISE_ADAM, optimizer_state_dtypes={"momentum1": SparseType.FP32}),
        dict(optimizer=EmbOptimType.EXACT_SGD, weight_decay=0.1, max_norm=1.0),  # FBGEMM's SGD reads neither
        dict(optimizer=EmbOptimType.ADAM, max_norm=1.0, weight_decay_mode=WeightDecayMode.L2),  # nor does Adam
        dict(optimizer=RWA, weight_decay=0.1),  # weight_decay_mode NONE: FBGEMM applies no decay
        dict(res_params=None, is_qr_tbe=True, ensemble_mode=None, ar_alpha=0.5),
    ],
)
def test_keywords_that_change_nothing_are_accepted(kwargs):
    """Each of these gives the results of the same module without it, and FBGEMM's CPU TBE given it
    agrees (the reference where FBGEMM's CPU TBE lacks the optimizer: Adam)."""
    base = {k: v for k, v in kwargs.items() if k == "optimizer"}
    fbgemm_cpu = kwargs.get("optimizer", EmbOptimType.EXACT_SGD) in (EmbOptimType.EXACT_SGD, RWA)
    a, other = make_pair(SPECS, FTM, oracle="fbgemm" if fbgemm_cpu else "reference", seed=1, learning_rate=0.3,
                         **kwargs)
    b, _ = make_pair(SPECS, FTM, oracle="reference", seed=1, learning_rate=0.3, **base)
    g = torch.Generator().manual_seed(2)
    batch = skewed_batch([r for r, _ in SPECS], FTM, B=4, max_L=4, generator=g)
    grad = torch.randn(4, sum(SPECS[k][1] for k in FTM), generator=g)
    for m in (a, b):
        m(batch.indices, batch.offsets).backward(grad)
    oracle_step(other, batch, grad)
    expected = other.split_embedding_weights() if fbgemm_cpu else other.tables
    for t, (x, y, e) in enumerate(zip(a.split_embedding_weights(), b.split_embedding_weights(), expected)):
        assert torch.equal(x, y), f"table {t}: the keywords changed the result"
        assert_close(x, e, f"table {t} vs {'FBGEMM' if fbgemm_cpu else 'the reference'}", atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(optimizer=EmbOptimType.ENSEMBLE_ROWWISE_ADAGRAD), NotImplementedError, "ENSEMBLE_ROWWISE_ADAGRAD"),
        (dict(optimizer=EmbOptimType.SGD), NotImplementedError, "optimizer=SGD"),
        (dict(optimizer=RWA, weight_decay_mode=WeightDecayMode.COUNTER,
              counter_based_regularization=CounterBasedRegularizationDefinition()), NotImplementedError, "COUNTER"),
        (dict(optimizer=RWA, weight_decay_mode=WeightDecayMode.COWCLIP, cowclip_regularization=CowClipDefinition()),
         NotImplementedError, "COWCLIP"),
        (dict(optimizer=RWA, weight_decay_mode=WeightDecayMode.DECOUPLE_GLOBAL,
              global_weight_decay=GlobalWeightDecayDefinition()), NotImplementedError, "DECOUPLE_GLOBAL"),
        (dict(optimizer=RWA, weight_decay_mode=WeightDecayMode.COUNTER), ValueError, "counter_based_regularization"),
        (dict(weight_decay_mode=WeightDecayMode.DECOUPLE_GLOBAL), ValueError, "DECOUPLE_GLOBAL"),
        (dict(optimizer=EmbOptimType.EXACT_SGD,
              extra_optimizer_config=UserEnabledConfigDefinition(use_writeback_bwd_prehook=True)),
         NotImplementedError, "use_writeback_bwd_prehook"),
        (dict(optimizer=RWA, extra_optimizer_config=UserEnabledConfigDefinition(use_rowwise_bias_correction=True)),
         ValueError, "use_rowwise_bias_correction"),
        # FBGEMM asserts optimizer_state_dtypes is None for every optimizer but PARTIAL_ROWWISE_ADAM (and ensemble).
        (dict(optimizer=EmbOptimType.ADAM, optimizer_state_dtypes={"momentum1": SparseType.BF16}),
         ValueError, "optimizer_state_dtypes with optimizer=ADAM"),
        (dict(optimizer_state_dtypes={"momentum1": SparseType.FP32}), ValueError, "only with PARTIAL_ROWWISE_ADAM"),
        (dict(optimizer=RWA, optimizer_state_dtypes={}), ValueError, "optimizer=EXACT_ROWWISE_ADAGRAD"),
        (dict(optimizer=EmbOptimType.PARTIAL_ROWWISE_ADAM, optimizer_state_dtypes={"momentum2": SparseType.FP16}),
         NotImplementedError, "momentum2=FP16"),
    ],
)
def test_unsupported_optimizer_configurations_raise_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        TritonTBE(SPECS, device="cpu", **kwargs)


def test_gradient_clipping_clamps_the_per_sample_weight_gradient_too():
    """FBGEMM clamps the output gradient before anything reads it, the per-sample-weight gradient included."""
    ours, _ = make_pair(SPECS, FTM, oracle="reference", optimizer=EmbOptimType.EXACT_SGD, gradient_clipping=True,
                        max_gradient=0.2)
    _, plain = make_pair(SPECS, FTM, oracle="reference", optimizer=EmbOptimType.EXACT_SGD)  # same initial weights
    g = torch.Generator().manual_seed(5)
    batch = skewed_batch([r for r, _ in SPECS], FTM, B=4, max_L=4, generator=g, weighted=True)
    psw = batch.per_sample_weights.clone().requires_grad_(True)
    out = ours(batch.indices, batch.offsets, psw)
    grad = torch.randn(out.shape, generator=g)
    clipped = plain.psw_grad(batch.indices, batch.offsets, batch.per_sample_weights, grad.clamp(-0.2, 0.2))
    assert not torch.allclose(clipped, plain.psw_grad(batch.indices, batch.offsets, batch.per_sample_weights, grad))
    out.backward(grad)
    assert_close(psw.grad, clipped, "psw grad with clipping", atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("output", [SparseType.FP16, SparseType.BF16])
def test_low_precision_outputs_with_adam(output):
    train_and_compare(SPECS, FTM, PoolingMode.SUM, False, SparseType.FP16, EmbOptimType.ADAM, torch.int64,
                      output=output, fbgemm_cpu=False)
