"""The FBGEMM-compatible surface of TritonTBE: constructor keywords, state getters with FBGEMM's
shapes and semantics (compared with FBGEMM's CPU TBE), learning-rate plumbing, clear errors."""

import inspect

import pytest
import torch

from tbe_cases import EmbOptimType, PoolingMode, SparseType, assert_close, make_pair
from torchrec_triton_tbe._fbgemm import ComputeDevice, EmbeddingLocation, WeightDecayMode
from torchrec_triton_tbe.module import TritonTBE

SPECS = [(10, 4), (6, 8)]


def test_constructor_accepts_every_fbgemm_keyword():
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    ours = inspect.signature(TritonTBE.__init__).parameters
    theirs = inspect.signature(SplitTableBatchedEmbeddingBagsCodegen.__init__).parameters
    missing = [name for name in theirs if name not in ours]
    assert not missing, f"FBGEMM keywords TritonTBE does not accept: {missing}"
    for name, p in theirs.items():
        if name == "self" or p.default is inspect.Parameter.empty:
            continue
        assert ours[name].default == p.default or (ours[name].default is None and p.default is None), name
    # FBGEMM's positional order up to the last keyword both versions share in the same place.
    assert list(ours)[: list(theirs).index("weight_decay_mode") + 1] == list(theirs)[: list(theirs).index("weight_decay_mode") + 1]


def test_forward_signature_is_fbgemms():
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    assert list(inspect.signature(TritonTBE.forward).parameters) == list(
        inspect.signature(SplitTableBatchedEmbeddingBagsCodegen.forward).parameters
    )


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(weights_precision=SparseType.INT8), "weights_precision"),
        (dict(output_dtype=SparseType.INT8), "output_dtype"),
        (dict(enable_raw_embedding_streaming=True), "enable_raw_embedding_streaming"),
        # FBGEMM would read and update the caller's buffers; silently using our own would lose both.
        (dict(preallocated_host_buffers={"weights_host": torch.full((40,), 0.5)}), "preallocated_host_buffers"),
    ],
)
def test_result_changing_unsupported_keywords_raise(kwargs, name):
    # The optimizer keywords have their own tests (tests/test_optimizers.py).
    with pytest.raises(NotImplementedError, match=name):
        TritonTBE(SPECS, device="cpu", **kwargs)


def test_ignored_keywords_are_accepted():
    """Keywords of FBGEMM's caching and placement (and optimizer keywords SGD does not read) change
    nothing: outputs and the SGD step equal those of a module built without them."""
    m = TritonTBE(SPECS, device="cpu", cache_load_factor=0.5, enforce_hbm=True, prefetch_pipeline=True, momentum=0.5,
                  beta1=0.8, uvm_non_rowwise_momentum=True, embedding_shard_info=[(10, 4, 0, 0), (6, 8, 0, 0)])
    plain = TritonTBE(SPECS, device="cpu")
    for w, v in zip(plain.split_embedding_weights(), m.split_embedding_weights()):
        v.copy_(w)
    indices, offsets = torch.tensor([1, 2, 1]), torch.tensor([0, 2, 3])
    outs = [module(indices, offsets) for module in (m, plain)]
    assert outs[0].shape == (1, 12) and torch.equal(outs[0], outs[1])
    for out in outs:
        out.backward(torch.ones_like(out))
    for w, v in zip(plain.split_embedding_weights(), m.split_embedding_weights()):
        assert torch.equal(v, w)
    assert not torch.equal(plain.split_embedding_weights()[0][1], torch.zeros(4))  # initialised and stepped


def test_four_tuple_specs_and_placement():
    specs4 = [(r, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for r, d in SPECS]
    m = TritonTBE(specs4)  # all CPU specs: the module lives on the CPU, as FBGEMM's would
    assert m.current_device == torch.device("cpu")
    assert [tuple(w.shape) for w in m.split_embedding_weights()] == [(10, 4), (6, 8)]


@pytest.mark.parametrize("optimizer", [EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ROWWISE_ADAGRAD])
def test_state_getters_match_fbgemm_shapes(optimizer):
    ours, fb = make_pair(SPECS, oracle="fbgemm", optimizer=optimizer)
    assert [w.shape for w in ours.split_embedding_weights()] == [w.shape for w in fb.split_embedding_weights()]
    ours_states, fb_states = ours.split_optimizer_states(), fb.split_optimizer_states()
    assert [[s.shape for s in t] for t in ours_states] == [[s.shape for s in t] for t in fb_states]
    ours_opt, fb_opt = ours.get_optimizer_state(), fb.get_optimizer_state()
    assert [{k: v.shape for k, v in d.items()} for d in ours_opt] == [
        {k: v.shape for k, v in d.items() if k == "sum"} for d in fb_opt
    ]
    if optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD:
        assert all(set(d) == {"sum"} for d in ours_opt)
    else:
        assert ours_opt == [] and ours_states == []


@pytest.mark.parametrize("output_dtype", [SparseType.FP32, SparseType.FP16])
def test_plain_attributes_have_fbgemms_types(output_dtype):
    """Attributes FBGEMM code reads off the module, in FBGEMM's form: output_dtype as SparseType.as_int()
    (SparseType.from_int reads it back), a uuid string per module (TorchRec's raw-id tracker keys on it)."""
    ours, fb = make_pair(SPECS, oracle="fbgemm", output_dtype=output_dtype)
    assert type(ours.output_dtype) is type(fb.output_dtype) is int
    assert ours.output_dtype == fb.output_dtype and SparseType.from_int(ours.output_dtype) == output_dtype
    for name in ("weights_precision", "pooling_mode", "optimizer", "stochastic_rounding", "bounds_check_mode_int",
                 "feature_table_map", "table_names", "total_D", "max_D", "current_device", "mixed_D", "is_nobag",
                 "total_hash_size"):
        assert getattr(ours, name) == getattr(fb, name), name
    assert list(ours.dims) == list(fb.dims)  # FBGEMM's is the tuple zip gives, annotated list[int]
    other = make_pair(SPECS, oracle="reference")[0]
    assert isinstance(ours.uuid, str) and isinstance(fb.uuid, str) and ours.uuid != other.uuid


def test_split_embedding_weights_are_writable_views():
    m = TritonTBE(SPECS, device="cpu")
    m.split_embedding_weights()[1][3].fill_(2.5)
    out = m(torch.tensor([0, 3]), torch.tensor([0, 1, 2]))
    assert torch.equal(out[0, 4:], torch.full((8,), 2.5))


def test_init_embedding_weights_uniform():
    m = TritonTBE(SPECS, device="cpu")
    m.init_embedding_weights_uniform(-0.25, 0.25)
    for w in m.split_embedding_weights():
        assert w.min() >= -0.25 and w.max() <= 0.25 and w.std() > 0


def _one_step_matches(ours, ref, what: str) -> None:
    """One training step of a one-table (8, 4) row-wise Adagrad module and its reference: equal weights and state."""
    indices, offsets = torch.tensor([1, 1, 5]), torch.tensor([0, 2, 3])
    grad = torch.randn(2, 4)
    ours(indices, offsets).backward(grad)
    ref.forward(indices, offsets).backward(grad.double())
    ref.step()
    assert_close(ours.split_embedding_weights()[0], ref.tables[0], what, atol=1e-6, rtol=1e-6)
    assert_close(ours.split_optimizer_states()[0][0], ref.momentum[0], f"state {what}", atol=1e-7, rtol=1e-6)


def test_learning_rate_and_hyper_parameters_reach_the_kernels():
    ours, ref = make_pair([(8, 4)], oracle="reference", optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                          learning_rate=0.1, eps=0.5)
    ours.set_learning_rate(0.7)
    ours.update_hyper_parameters({"eps": 0.05, "lr": 0.3})
    ref.lr, ref.eps = 0.3, 0.05
    assert ours.get_learning_rate() == pytest.approx(0.3)
    _one_step_matches(ours, ref, "after lr/eps change")
    with pytest.raises(NotImplementedError, match="momentum"):
        ours.update_hyper_parameters({"momentum": 0.1})  # FBGEMM takes lr, eps, beta1/2, weight_decay, lower_bound


@pytest.mark.parametrize(
    "optimizer,changes",
    [
        (EmbOptimType.EXACT_SGD, [{"lr": 0.0}, {"lr": 0.3}, {"lr": 0.3}]),
        (EmbOptimType.EXACT_ROWWISE_ADAGRAD, [{"lr": 0.05}, {"eps": 10.0}, {"lr": 0.2, "eps": 0.01}]),
        (EmbOptimType.EXACT_ADAGRAD, [{"eps": 2.0}, {"lr": 0.0}, {}]),
    ],
    ids=lambda x: getattr(x, "name", None),
)
def test_a_backward_applies_the_hyper_parameters_of_its_forward(optimizer, changes):
    """FBGEMM's forward clones its learning rate and takes eps etc. as arguments, so a change made
    between a forward and its backward (TorchRec's fused optimizer pushes a scheduler's rate in
    zero_grad(), which many loops call after the forward) applies from the next forward on. Oracle:
    FBGEMM's CPU TBE over three steps, each changed between forward and backward; the getters report
    the latest values throughout."""
    ours, fb = make_pair([(8, 4), (6, 8)], oracle="fbgemm", optimizer=optimizer, learning_rate=0.1, eps=0.5)
    g = torch.Generator().manual_seed(3)
    for step, change in enumerate(changes):
        indices, offsets = torch.tensor([1, 1, 5, 2, 0]), torch.tensor([0, 2, 3, 4, 5])
        grad = torch.randn(2, 12, generator=g)
        for m in (ours, fb):
            out = m(indices, offsets)
            m.update_hyper_parameters(change)
            out.backward(grad)
        assert ours.get_learning_rate() == fb.get_learning_rate()  # both the fp32-rounded value
        for a, b in zip(ours.split_embedding_weights(), fb.split_embedding_weights()):
            assert_close(a, b, f"{optimizer.name} step {step} after {change}", atol=1e-6, rtol=1e-5)


def test_two_forwards_around_a_change_each_apply_their_own_rate():
    """Two forwards, the rate changed between them, one backward through both (autograd runs the
    second's first): each applies its own forward's rate, as FBGEMM's clones do; a third forward runs
    under the new rate."""
    ours, fb = make_pair([(8, 4)], oracle="fbgemm", optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.5)
    ids1, off1 = torch.tensor([1, 2]), torch.tensor([0, 1, 2])
    ids2, off2 = torch.tensor([2, 3]), torch.tensor([0, 2, 2])
    for m in (ours, fb):
        first = m(ids1, off1)
        m.set_learning_rate(0.05)
        second = m(ids2, off2)
        (first.sum() + 2 * second.sum()).backward()
        m(ids1, off1).sum().backward()
    for a, b in zip(ours.split_embedding_weights(), fb.split_embedding_weights()):
        assert_close(a, b, "two forwards around an lr change", atol=1e-6, rtol=1e-6)
    assert float(ours.learning_rate_tensor) == pytest.approx(0.05)


@pytest.mark.parametrize("reload", ["checkpoint", "init"])
def test_to_empty_keeps_the_learning_rate_and_hyper_parameters(reload):
    """``to_empty`` (meta construction, then materialising) leaves every buffer uninitialised; weights,
    state and step come back from a checkpoint or an init, but nothing restores the learning rate and
    hyper-parameters (not checkpointed, as FBGEMM's), and an update to the same values would write nothing
    (the host's view says unchanged). The module writes them again from that view."""
    ours, ref = make_pair([(8, 4)], oracle="reference", optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                          learning_rate=0.1, eps=0.5)
    ours.update_hyper_parameters({"eps": 0.05, "lr": 0.3})
    ref.lr, ref.eps = 0.3, 0.05
    saved = ours.state_dict()
    ours.learning_rate_tensor.fill_(float("nan"))  # what uninitialised memory may hold
    ours.optimizer_hyper.fill_(float("nan"))
    ours.to_empty(device="cpu")
    if reload == "checkpoint":
        ours.load_state_dict(saved)
    else:
        ours.split_embedding_weights()[0].copy_(ref.tables[0])
        ours.momentum1.zero_()
        ours.iter.zero_()
    ours.set_learning_rate(0.3)  # unchanged: no device write
    _one_step_matches(ours, ref, "after to_empty")


def test_a_move_takes_the_tables_along_and_a_cast_leaves_the_module_state_alone():
    """``module.to`` / ``to_empty`` onto another device move the plan's tables with the buffers (the
    forward checks inputs against them, the kernels read them): to meta, a forward raises naming the
    device; back with ``to_empty`` and a checkpoint, training matches the reference, and the WARNING count
    (nothing to keep from meta) is zero. A cast or a move to the device the buffers are on returns them
    as they are: the offsets check's scratch is not written (a forward still running on another stream
    may hold tickets in it), nor the count."""
    ours, ref = make_pair([(8, 4)], oracle="reference", optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                          learning_rate=0.1, eps=0.5)
    saved = ours.state_dict()
    ours._bounds_scratch.fill_(7)  # as mid-check
    ours.bounds_check_warning.fill_(3)
    scratch = ours._bounds_scratch
    for cast in (lambda m: m.float(), lambda m: m.to("cpu"), lambda m: m.cpu(), lambda m: m.double().float()):
        cast(ours)
        assert ours._bounds_scratch is scratch and scratch.tolist() == [7, 7]
        assert int(ours.bounds_check_warning) == 3
    ours._bounds_scratch.zero_()
    with pytest.raises(FileNotFoundError):
        ours.set_kernel_config("no_such_config")  # refused, and not loaded again by the moves below
    graphs = ours._backward_graphs
    ours.to("meta")
    assert ours._backward_graphs is not graphs  # a graph cache (and its capture stream) per device
    assert ours.spec.device.type == "meta" and ours.spec.tensors.feature_dim.is_meta
    with pytest.raises(RuntimeError, match="unsupported device meta"):
        ours(torch.tensor([1], device="meta"), torch.tensor([0, 1], device="meta"))
    ours.to_empty(device="cpu")
    assert ours.spec.device == torch.device("cpu") and not ours.spec.tensors.feature_dim.is_meta
    assert ours._bounds_scratch.tolist() == [0, 0] and int(ours.bounds_check_warning) == 0
    ours.load_state_dict(saved)
    _one_step_matches(ours, ref, "after a move to meta and back")


def test_to_empty_zeroes_the_warning_count_also_through_a_parent_and_a_move_keeps_it():
    """``to_empty`` leaves every buffer uninitialised, so the WARNING count has nothing to keep: zero after
    it, also when a parent's ``to_empty`` runs (it reaches the module's ``_apply`` only, where the module
    recognises torch's to_empty function: also onto another device, tests/gpu/test_gpu_reliability.py),
    while a move or a clone of the buffers keeps the count."""
    from torchrec_triton_tbe import module as module_mod

    seen = []

    class Spy(torch.nn.Module):
        def _apply(self, fn, recurse=True):
            seen.append(fn)
            return self

    Spy().to_empty(device="cpu")
    Spy().to("cpu")
    assert module_mod._is_to_empty(seen[0]) and not module_mod._is_to_empty(seen[1])
    ours = TritonTBE([(8, 4)], device="cpu")
    parent = torch.nn.ModuleDict({"tbe": ours})
    ours.bounds_check_warning.fill_(3)
    parent._apply(lambda t: t.clone())  # same device, new buffers: a copy keeps the count
    assert int(ours.bounds_check_warning) == 3
    parent.to_empty(device="cpu")
    assert int(ours.bounds_check_warning) == 0


@pytest.mark.parametrize("optimizer,precision", [
    (EmbOptimType.EXACT_ROWWISE_ADAGRAD, SparseType.FP32),
    (EmbOptimType.EXACT_ADAGRAD, SparseType.FP16),
    (EmbOptimType.EXACT_SGD, SparseType.FP32),
], ids=["rowwise", "adagrad-fp16", "sgd"])
def test_a_bare_fbgemm_modules_checkpoint_loads(optimizer, precision):
    """FBGEMM's state dict (weights and state by placement, with offsets, metadata and cache buffers) loads
    into TritonTBE of the same tables, strictly, also as a submodule; training then goes on as FBGEMM's."""
    specs, ftm = [(10, 4), (7, 8)], [0, 1, 1]
    ours, fbgemm = make_pair(specs, ftm, optimizer=optimizer, weights_precision=precision, learning_rate=0.1)
    indices, offsets = torch.tensor([1, 2, 3, 4, 5, 6, 0, 1]), torch.tensor([0, 2, 3, 5, 6, 7, 8])
    out = fbgemm(indices, offsets)
    out.backward(torch.randn(out.shape))
    fresh = torch.nn.ModuleDict({"tbe": TritonTBE(specs, feature_table_map=ftm, optimizer=optimizer,
                                                  weights_precision=precision, learning_rate=0.1, device="cpu")})
    assert "weights_placements" in fbgemm.state_dict()
    fresh.load_state_dict({f"tbe.{k}": v for k, v in fbgemm.state_dict().items()})  # strict
    ours = fresh["tbe"]
    for a, b in zip(ours.split_embedding_weights(), fbgemm.split_embedding_weights()):
        assert torch.equal(a, b)
    for mine, theirs in zip(ours.split_optimizer_states(), fbgemm.split_optimizer_states()):
        for a, b in zip(mine, theirs):
            assert torch.equal(a.reshape(b.shape), b)
    grad = torch.randn(out.shape)
    ours(indices, offsets).backward(grad)
    fbgemm(indices, offsets).backward(grad)
    tol = 1e-6 if precision == SparseType.FP32 else 2e-3
    for k, (a, b) in enumerate(zip(ours.split_embedding_weights(), fbgemm.split_embedding_weights())):
        assert_close(a, b, f"table {k} a step after loading", atol=tol, rtol=tol)


def test_a_fbgemm_checkpoint_of_other_tables_is_refused():
    """Rows or dims per feature, which features share a table, a state kept per row on one side and per
    element on the other, an unknown placement: each raises naming it, before anything is loaded."""
    fbgemm = make_pair([(10, 4), (7, 8)], [0, 1, 1])[1]
    ours = TritonTBE([(10, 4), (9, 8)], feature_table_map=[0, 1, 1], device="cpu")
    with pytest.raises(ValueError, match=r"rows_per_table \[10, 7, 7\] per feature, this module has \[10, 9, 9\]"):
        ours.load_state_dict(fbgemm.state_dict())
    bad = {**fbgemm.state_dict(), "weights_placements": torch.tensor([3, 9, 9], dtype=torch.int32)}
    bad.pop("rows_per_table")
    with pytest.raises(ValueError, match=r"weights_placements\[1\] = 9 is not a placement"):
        TritonTBE([(10, 4), (7, 8)], feature_table_map=[0, 1, 1], device="cpu").load_state_dict(bad)
    # Same rows and dims per feature, another sharing: two tables there, one shared table here.
    two = make_pair([(6, 4), (6, 4)], [0, 1])[1]
    with pytest.raises(ValueError, match="feature 1 reads another table there than here"):
        TritonTBE([(6, 4)], feature_table_map=[0, 0], device="cpu").load_state_dict(two.state_dict())
    # Adagrad's state per element there, row-wise Adagrad's per row here.
    adagrad = make_pair([(6, 4), (3, 8)], optimizer=EmbOptimType.EXACT_ADAGRAD)[1]
    rowwise = TritonTBE([(6, 4), (3, 8)], device="cpu", optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    with pytest.raises(ValueError, match=r"momentum1_host holds 48 values, this module's tables there take 9 "
                                         r"\(one per row\)"):
        rowwise.load_state_dict(adagrad.state_dict())


def test_a_fbgemm_checkpoint_without_a_state_loads_non_strictly():
    """An SGD checkpoint (no optimizer state) into a row-wise Adagrad module: strict, the state is reported
    missing; non-strict, the weights load and the module keeps its state."""
    sgd = make_pair([(6, 4)], optimizer=EmbOptimType.EXACT_SGD)[1]
    ours = TritonTBE([(6, 4)], device="cpu", optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    ours.momentum1.fill_(0.5)
    with pytest.raises(RuntimeError, match="Missing key.*momentum1"):
        ours.load_state_dict(sgd.state_dict())
    assert ours.load_state_dict(sgd.state_dict(), strict=False).missing_keys == ["momentum1"]
    assert torch.equal(ours.split_embedding_weights()[0], sgd.split_embedding_weights()[0])
    assert ours.momentum1.tolist() == [0.5] * 6


def test_a_checkpoint_from_before_the_empty_tables_zero_row_loads():
    """A module with a table of 0 rows keeps a zero row past its tables (TablePlan.empty_row_offset); its
    checkpoints from before that hold the tables alone, and still load."""
    a = TritonTBE([(4, 4), (0, 4), (3, 4)], device="cpu")
    old = {**a.state_dict(), "weights": torch.arange(28, dtype=torch.float32)}
    b = TritonTBE([(4, 4), (0, 4), (3, 4)], device="cpu")
    b.load_state_dict(old)
    assert torch.equal(torch.cat([w.reshape(-1) for w in b.split_embedding_weights()]), torch.arange(28.0))
    assert b.weights.numel() == 32 + 4 and not b.weights[28:].any()


def test_the_learning_rate_is_not_checkpointed():
    """As FBGEMM, whose learning_rate_tensor is a plain attribute: a state dict holds weights, state and
    step, and loading one keeps the module's rate, which get_learning_rate reports and the kernels apply.
    A state dict written while it was saved (this module before 2026-12-04) still loads."""
    a = TritonTBE(SPECS, device="cpu", optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.01)
    assert "learning_rate_tensor" not in a.state_dict()
    b = TritonTBE(SPECS, device="cpu", optimizer=EmbOptimType.EXACT_SGD, learning_rate=1.0)
    legacy = {**a.state_dict(), "learning_rate_tensor": torch.tensor([0.01])}
    b.load_state_dict(legacy)
    before = b.split_embedding_weights()[0][1].clone()
    b(torch.tensor([1]), torch.tensor([0, 1, 1])).sum().backward()
    assert b.get_learning_rate() == 1.0
    assert torch.allclose(before - b.split_embedding_weights()[0][1], torch.ones(4))


def test_bounds_check_modes_read_as_fbgemm_reads_them(monkeypatch):
    """FBGEMM's V2_* modes run as IGNORE / WARNING / FATAL and FBGEMM_TBE_BOUNDS_CHECK_MODE overrides the
    keyword, as in FBGEMM's TBE (checked against it on this machine)."""
    from torchrec_triton_tbe._fbgemm import BoundsCheckMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    def both(mode):
        fb = SplitTableBatchedEmbeddingBagsCodegen([(10, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)],
                                                   bounds_check_mode=mode)
        return TritonTBE(SPECS, device="cpu", bounds_check_mode=mode).bounds_check_mode_int, fb.bounds_check_mode_int

    for mode in BoundsCheckMode:
        ours, fbgemm = both(mode)
        assert ours == fbgemm, mode
    monkeypatch.setenv("FBGEMM_TBE_BOUNDS_CHECK_MODE", str(BoundsCheckMode.FATAL.value))
    assert both(BoundsCheckMode.NONE) == (BoundsCheckMode.FATAL.value,) * 2


def test_parameters_are_fbgemms_placeholder():
    """FBGEMM's TBE on the GPU has one Parameter, its zero-size ``placeholder_autograd_tensor`` (the
    weights are buffers), saved in its state dict; ours too. Checkpoints from before it was saved load."""
    m = TritonTBE(SPECS, device="cpu")
    assert [(n, p.numel(), p.requires_grad) for n, p in m.named_parameters()] == [
        ("placeholder_autograd_tensor", 0, True)]
    assert next(m.parameters()).device == torch.device("cpu")
    state = m.state_dict()
    assert "placeholder_autograd_tensor" in state
    del state["placeholder_autograd_tensor"]
    other = TritonTBE(SPECS, device="cpu")
    other.load_state_dict(state)  # strict
    assert torch.equal(other.weights, m.weights)
    # The fused update still runs with nothing else requiring a gradient, and leaves no .grad.
    before = other.weights.clone()
    other(torch.tensor([1]), torch.tensor([0, 1, 1])).sum().backward()
    assert not torch.equal(before, other.weights) and other.placeholder_autograd_tensor.grad is None


def test_optimizer_step_counter():
    m = TritonTBE(SPECS, device="cpu", optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    m.set_optimizer_step(41)
    m(torch.tensor([1]), torch.tensor([0, 1, 1])).sum().backward()
    assert int(m.iter) == 42
    m.flush()
    m.reset_cache_states()


@pytest.mark.parametrize("optimizer", [EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.EXACT_SGD],
                         ids=lambda o: o.name)
def test_every_forward_advances_the_step_count_as_fbgemms_does(optimizer):
    """FBGEMM's forward advances ``iter`` (eval forwards and forwards under no_grad too) and hands the
    count to its backward. Oracle: FBGEMM's CPU TBE through training steps, no_grad forwards, an eval
    forward in training mode whose output is dropped, and two forwards before their backwards; weights,
    state and the count agree throughout. FBGEMM's SGD forward leaves ``iter`` at 0 (nothing it computes
    reads it), and so does ours where stochastic rounding does not seed from it (fp32 weights here)."""
    ours, fb = make_pair([(8, 4), (6, 8)], oracle="fbgemm", optimizer=optimizer, learning_rate=0.1, eps=0.5)
    g = torch.Generator().manual_seed(4)
    indices, offsets = torch.tensor([1, 1, 5, 2, 0]), torch.tensor([0, 2, 3, 4, 5])

    def grad():
        return torch.randn(2, 12, generator=g)

    plan = ["train", "no_grad", "no_grad", "train", "dropped", "train", "two"]
    forwards = {"train": 1, "no_grad": 1, "dropped": 1, "two": 2}
    for what in plan:
        gs = [grad(), grad()]
        for m in (ours, fb):
            if what == "no_grad":
                with torch.no_grad():
                    m(indices, offsets)
            elif what == "dropped":
                m(indices, offsets)
            elif what == "train":
                m(indices, offsets).backward(gs[0])
            else:
                first, second = m(indices, offsets), m(indices[:3], offsets[:3])
                first.backward(gs[0])
                second.backward(gs[1][:1])
        for a, b in zip(ours.split_embedding_weights(), fb.split_embedding_weights()):
            assert_close(a, b, f"{optimizer.name} after {what}", atol=1e-6, rtol=1e-5)
    assert int(ours.iter) == int(fb.iter)
    assert int(ours.iter) == (0 if optimizer == EmbOptimType.EXACT_SGD else sum(forwards[w] for w in plan))
    if optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD:
        for a, b in zip(ours.split_optimizer_states(), fb.split_optimizer_states()):
            assert_close(a[0], b[0], "row-wise Adagrad state", atol=1e-6, rtol=1e-5)


def test_a_backward_applies_its_own_forwards_step_count():
    """Adam's bias correction uses the count its forward set (FBGEMM passes it to the backward), even
    when eval forwards, another training forward or set_optimizer_step come before the backward.
    Oracle: the reference, with its count set to what each update must use."""
    from test_backward import assert_same_state
    from tbe_cases import oracle_step, skewed_batch

    specs = [(12, 4), (9, 8)]
    ours, ref = make_pair(specs, oracle="reference", optimizer=EmbOptimType.ADAM, learning_rate=0.1, eps=0.1,
                          stochastic_rounding=False)
    g = torch.Generator().manual_seed(5)
    batches = [skewed_batch([r for r, _ in specs], [0, 1], B=3, max_L=4, generator=g) for _ in range(4)]
    grads = [torch.randn(3, 12, generator=g) for _ in range(4)]

    # Step 1, then two eval forwards: the second training forward runs at count 4.
    ours(batches[0].indices, batches[0].offsets).backward(grads[0])
    oracle_step(ref, batches[0], grads[0])
    with torch.no_grad():
        for _ in range(2):
            ours(batches[1].indices, batches[1].offsets)
    out = ours(batches[1].indices, batches[1].offsets)
    # Between that forward and its backward: a later forward (count 5) and a new step count.
    later = ours(batches[2].indices, batches[2].offsets)
    ours.set_optimizer_step(20)
    out.backward(grads[1])
    ref.step_count = 3
    oracle_step(ref, batches[1], grads[1])
    assert_same_state(ours, ref, "reference", "the count-4 update", torch.float32, torch.float32)
    later.backward(grads[2])
    ref.step_count = 4
    oracle_step(ref, batches[2], grads[2])
    assert_same_state(ours, ref, "reference", "the count-5 update", torch.float32, torch.float32)
    # The next forward counts on from the value set: 21.
    ours(batches[3].indices, batches[3].offsets).backward(grads[3])
    ref.step_count = 20
    oracle_step(ref, batches[3], grads[3])
    assert_same_state(ours, ref, "reference", "the count-21 update", torch.float32, torch.float32)
    assert int(ours.iter) == 21


@pytest.mark.parametrize("optimizer,weights,sr,copies,counts", [
    (EmbOptimType.EXACT_SGD, SparseType.FP32, False, False, False),  # as FBGEMM's SGD: no count
    (EmbOptimType.EXACT_SGD, SparseType.FP16, True, True, True),  # the count seeds the rounding
    (EmbOptimType.EXACT_ADAGRAD, SparseType.FP16, False, False, False),
    (EmbOptimType.LARS_SGD, SparseType.FP32, False, False, False),
    (EmbOptimType.EXACT_ROWWISE_ADAGRAD, SparseType.FP16, False, False, True),
    (EmbOptimType.EXACT_ROWWISE_ADAGRAD, SparseType.FP16, True, True, True),
    (EmbOptimType.EXACT_ROWWISE_ADAGRAD, SparseType.FP32, True, False, True),  # fp32: nothing to round
    (EmbOptimType.ADAM, SparseType.FP32, False, True, True),  # bias correction
    (EmbOptimType.LAMB, SparseType.FP32, False, True, True),
], ids=["sgd", "sgd_fp16_sr", "adagrad", "lars", "rwa_fp16", "rwa_fp16_sr", "rwa_fp32_sr", "adam", "lamb"])
def test_a_training_forward_copies_its_count_only_where_the_update_reads_it(optimizer, weights, sr, copies, counts):
    """A forward advances the count where FBGEMM's does (every optimizer but SGD, Adagrad and LARS) or
    where the update reads it (spec.advances_step_count), and a training forward keeps its own copy of
    it for its backward where the update reads it (spec.reads_step_count); otherwise the backward is
    handed ``iter`` itself (no device copy, one launch less per training forward), whose later value it
    does not use. (That the updates still equal FBGEMM's through eval forwards:
    test_every_forward_advances_the_step_count_as_fbgemms_does and
    test_a_backward_applies_its_own_forwards_step_count.)"""
    m = TritonTBE(SPECS, device="cpu", optimizer=optimizer, weights_precision=weights, stochastic_rounding=sr)
    assert m.spec.reads_step_count is copies and m.spec.advances_step_count is counts
    ids, offs = torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2, 3])
    out = m(ids[:2], offs[:3])
    saved = out.grad_fn.step.saved  # the TBEFunction context: autograd.StepVersion
    assert (saved is not m.iter) is copies and int(saved) == int(m.iter) == int(counts)
    with torch.no_grad():
        m(ids[:2], offs[:3])
    assert int(m.iter) == 2 * counts and int(saved) == (1 if copies else 2 * counts)
    out.backward(torch.ones(1, m.total_D))
    assert int(m.iter) == 2 * counts


@pytest.mark.parametrize("pooling,B,grid_y", [(PoolingMode.SUM, 2, None), (PoolingMode.SUM, 5, None),
                                               (PoolingMode.SUM, 5, 1), (PoolingMode.NONE, 2, None)],
                         ids=["pooled_grouped", "pooled_per_bucket", "pooled_sliced", "sequence"])
def test_the_forwards_first_launch_advances_the_count(pooling, B, grid_y, monkeypatch):
    """The count's advance and its backward's copy ride on the forward's first pooled / sequence launch
    (ADVANCE: its first program), not on torch ops of their own: in one grouped launch (B = 2, at most the
    interpreter config's grouped_max_batch), in one launch per D bucket (B = 5), and with each bucket's
    features sliced one per launch (CUDA's grid-y limit shrunk to 1). With the launches recorded and none
    run, the count has not moved, and only the first launch carries the module's count and the copy the
    backward applies. Run, it moves once per forward; where a forward launches nothing (an empty batch),
    torch ops advance it."""
    from torchrec_triton_tbe.ops import launch as launch_ops

    if grid_y is not None:
        monkeypatch.setattr(launch_ops, "MAX_GRID_Y", grid_y)
    specs = [(10, 4), (6, 8), (7, 8)] if pooling == PoolingMode.SUM else [(10, 8), (6, 8)]
    m = TritonTBE(specs, device="cpu", pooling_mode=pooling, optimizer=EmbOptimType.EXACT_SGD,
                  weights_precision=SparseType.FP16, stochastic_rounding=True)
    m.precompile_first_step = False
    assert m.spec.reads_step_count and m.spec.advances_step_count
    T = len(specs)
    offs = torch.arange(T * B + 1)  # one id per bag
    ids = offs[:-1] % 6
    recorded: list = []
    with launch_ops.recording(recorded):
        out = m(ids, offs)
    forwards = [r for r in recorded if r.kernel.__name__ in ("_pooled_forward_kernel", "_sequence_forward_kernel")]
    assert len(forwards) == {(2, None): 1, (5, None): 2, (5, 1): 3}.get((B, grid_y), 1) and int(m.iter) == 0
    saved = out.grad_fn.step.saved
    assert saved is not m.iter
    assert forwards[0].constexprs.get("ADVANCE") is True
    assert forwards[0].args[-2] is m.iter and forwards[0].args[-1] is saved
    assert not any(r.constexprs.get("ADVANCE") for r in forwards[1:])
    # Run: training forwards (their own copies), a no_grad one, an empty batch's.
    first = m(ids, offs)
    second = m(ids, offs)
    with torch.no_grad():
        m(ids, offs)
    empty = m(ids[:0], torch.zeros(1, dtype=torch.int64))
    assert empty.numel() == 0
    counts = [int(o.grad_fn.step.saved) for o in (first, second, empty)]
    assert counts == [1, 2, 4] and int(m.iter) == 4


def test_a_repeated_backward_applies_its_forwards_step_count(monkeypatch):
    """A backward run again (retain_graph, or a retry after the non-finite guard raised) after later
    forwards applies its own forward's count, as FBGEMM's, whose backward keeps the count it was given."""
    from torchrec_triton_tbe.ops import backward as bwd_ops

    applied = []
    update = bwd_ops.fused_update

    def spy(spec, state, *args, **kwargs):
        applied.append(int(state.step))
        return update(spec, state, *args, **kwargs)

    monkeypatch.setattr(bwd_ops, "fused_update", spy)
    m = TritonTBE(SPECS, device="cpu", optimizer=EmbOptimType.ADAM)
    ids, offs = torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2, 3])
    grad = torch.ones(1, 12)
    first = m(ids[:2], offs[:3])
    first.backward(grad, retain_graph=True)
    second = m(ids[:2], offs[:3])
    first.backward(grad)
    second.backward(grad)
    assert applied == [1, 1, 2]

    m.check_finite = True
    third = m(ids[:2], offs[:3])
    with pytest.raises(ValueError, match="not finite"):
        third.backward(torch.full((1, 12), float("nan")), retain_graph=True)
    m(ids[:2], offs[:3])  # a later forward (count 4) before the retry
    third.backward(grad)
    assert applied == [1, 1, 2, 3]


@pytest.mark.parametrize(
    "specs,ftm,match",
    [
        ([], None, "at least one table"),
        ([(10, 0)], None, "dim > 0"),
        ([(10, 4)], [1], "not a table index"),
        ([(10, 4), (5, 4)], [0], None),  # a table no feature uses is allowed (FBGEMM asserts; we don't need to)
    ],
)
def test_bad_layouts(specs, ftm, match):
    if match is None:
        TritonTBE(specs, feature_table_map=ftm, device="cpu")
        return
    with pytest.raises(ValueError, match=match):
        TritonTBE(specs, feature_table_map=ftm, device="cpu")


@pytest.mark.parametrize("spec,what", [((10.5, 4), "rows"), ((10, 4.0), "dim"), (("10", 4), "rows")])
def test_rows_and_dims_must_be_integers(spec, what):
    """FBGEMM's allocation refuses a float row count too; int() would have made (10.5, 4) a 10-row table."""
    with pytest.raises(TypeError, match=rf"{what} must be an integer"):
        TritonTBE([(10, 4), spec], device="cpu")
    TritonTBE([(10, 4), (torch.tensor(5), torch.tensor(4))], device="cpu")  # integer scalars are integers


def test_state_dict_round_trip():
    a = TritonTBE(SPECS, device="cpu", optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    a.init_embedding_weights_uniform(-1, 1)
    a(torch.tensor([1, 2]), torch.tensor([0, 1, 2])).sum().backward()
    b = TritonTBE(SPECS, device="cpu", optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    b.load_state_dict(a.state_dict())
    for x, y in zip(a.split_embedding_weights() + [a.momentum1], b.split_embedding_weights() + [b.momentum1]):
        assert torch.equal(x, y)


# ---------------------------------------------------------------------------------------------- eviction reset
def _module_with_state(optimizer, specs=((10, 4), (6, 8), (7, 4))):
    tbe = TritonTBE(list(specs), optimizer=optimizer, device="cpu")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        tbe.weights.copy_(torch.randn(tbe.weights.shape, generator=g))
        for name in ("momentum1", "momentum2", "row_counter"):
            buf = getattr(tbe, name)
            buf.copy_(torch.rand(buf.shape, generator=g) + 0.5)
    return tbe


def _snapshot(tbe):
    return {name: getattr(tbe, name).clone() for name in ("weights", "momentum1", "momentum2", "row_counter")}


def test_reset_embedding_weight_momentum_zeroes_evicted_rows_like_fbgemm():
    """FBGEMM's reset_weight_momentum kernel (row-wise Adagrad): entry i resets table logical_table_ids[i]'s
    rows pruned_indices[offsets[b]:offsets[b+1]], b = buffer_ids[i]: weights and momentum to zero."""
    tbe = _module_with_state(EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    before = _snapshot(tbe)
    pruned = torch.tensor([1, 3, 0, 5, 2])
    tbe.reset_embedding_weight_momentum(
        pruned_indices=pruned, pruned_indices_offsets=torch.tensor([0, 2, 5]),
        logical_table_ids=torch.tensor([2, 1], dtype=torch.int32), buffer_ids=torch.tensor([0, 1], dtype=torch.int32))
    expected = {2: [1, 3], 1: [0, 5, 2]}
    weights, states = tbe.split_embedding_weights(), tbe.split_optimizer_states()
    old_w = [before["weights"][o : o + r * d].view(r, d) for o, r, d in
             zip(tbe.spec.plan.weights_offsets, tbe.spec.plan.rows, tbe.spec.plan.dims)]
    for t in range(3):
        reset = expected.get(t, [])
        keep = [r for r in range(tbe.spec.plan.rows[t]) if r not in reset]
        assert torch.equal(weights[t][reset], torch.zeros(len(reset), tbe.spec.plan.dims[t]))
        assert torch.equal(states[t][0][reset], torch.zeros(len(reset)))
        assert torch.equal(weights[t][keep], old_w[t][keep])
        off = tbe.spec.plan.row_offsets[t]
        assert torch.equal(states[t][0][keep], before["momentum1"][off : off + tbe.spec.plan.rows[t]][keep])


@pytest.mark.parametrize("optimizer", [EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ADAGRAD, EmbOptimType.ADAM],
                         ids=lambda o: o.name)
def test_reset_embedding_weight_momentum_is_fbgemms_no_op_for_other_optimizers(optimizer):
    tbe = _module_with_state(optimizer)
    before = _snapshot(tbe)
    tbe.reset_embedding_weight_momentum(torch.tensor([1]), torch.tensor([0, 1]), torch.tensor([0], dtype=torch.int32),
                                        torch.tensor([0], dtype=torch.int32))
    assert all(torch.equal(getattr(tbe, k), v) for k, v in before.items())


@pytest.mark.parametrize("pruned,offsets,tables,buffers,match", [
    ([1, 6], [0, 2], [1], [0], r"table 1 has 6 rows"),   # row 6 of a 6-row table
    ([-1], [0, 1], [0], [0], r"table 0 has 10 rows"),
    ([1], [0, 1], [3], [0], r"logical table 3 of 3"),
    ([1], [0, 1], [0], [1], r"buffer 1 with 2 pruned_indices_offsets"),
    ([1], [0, 1], [0, 1], [0], r"2 logical_table_ids but 1 buffer_ids"),
])
def test_reset_embedding_weight_momentum_rejects_bad_ids_before_writing(pruned, offsets, tables, buffers, match):
    tbe = _module_with_state(EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    before = _snapshot(tbe)
    # A valid entry first: nothing may be written when a later one is bad.
    tables_t = torch.tensor([0] + tables, dtype=torch.int32) if len(tables) == len(buffers) else torch.tensor(tables)
    buffers_t = torch.tensor([0] + buffers, dtype=torch.int32) if len(tables) == len(buffers) else torch.tensor(buffers)
    with pytest.raises((IndexError, ValueError), match=match):
        tbe.reset_embedding_weight_momentum(torch.tensor(pruned), torch.tensor(offsets), tables_t, buffers_t)
    assert all(torch.equal(getattr(tbe, k), v) for k, v in before.items())


def test_torchscript_is_refused_with_a_clear_error():
    """FBGEMM's module can be TorchScripted; ours launches Triton kernels from Python and cannot. The error names
    the way out (TorchScript's own, raised deep in its compiler, did not)."""
    m = TritonTBE(SPECS, device="cpu")
    for target in (m, torch.nn.Sequential(m)):
        with pytest.raises(NotImplementedError, match="cannot be TorchScripted.*torch.compile"):
            torch.jit.script(target)


def test_torch_compile_runs_the_module_eagerly_between_graphs():
    """torch.compile of a model holding a TritonTBE: dynamo cannot trace our launches, so the module's
    forward is excluded (torch.compiler.disable) and runs eagerly between the compiled graphs; training
    equals the uncompiled model's (aot_eager: AOTAutograd around the break, no C compiler needed)."""

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.tbe = TritonTBE(SPECS, feature_table_map=[0, 1, 1], device="cpu", learning_rate=0.1,
                                 optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
            self.tbe.init_embedding_weights_uniform(-1, 1)
            self.lin = torch.nn.Linear(4 + 8 + 8, 1)

        def forward(self, indices, offsets):
            return self.lin(torch.relu(self.tbe(indices, offsets))).sum()

    eager, compiled = Model(), Model()
    run = torch.compile(compiled, backend="aot_eager")
    lengths = torch.tensor([1, 2, 0, 3, 1, 2, 2, 0, 1, 1, 3, 1])
    offsets = torch.zeros(13, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    indices = torch.arange(int(offsets[-1])) % 6
    for _ in range(2):
        a, b = eager(indices, offsets), run(indices, offsets)
        a.backward()
        b.backward()
        assert_close(b, a, "loss", 1e-6, 1e-6)
    assert_close(compiled.tbe.weights, eager.tbe.weights, "weights", 1e-6, 1e-6)
    assert_close(compiled.tbe.momentum1, eager.tbe.momentum1, "momentum", 1e-6, 1e-6)
    assert_close(compiled.lin.weight.grad, eager.lin.weight.grad, "dense grad", 1e-6, 1e-6)
    assert int(compiled.tbe.iter) == int(eager.tbe.iter) == 2


def test_module_copies_after_a_forward_without_its_last_stream():
    """The stream of the last forward (TritonTBE._follow_last_stream) is not part of a copy: a CUDA
    stream can be neither deep-copied nor pickled (review of session 38), and a copy has run no forward.
    A stand-in that cannot be copied either takes the stream's place here (no GPU)."""
    import copy
    import pickle
    import threading

    m = TritonTBE([(20, 8)], optimizer=EmbOptimType.ADAM, device="cpu")
    m(torch.tensor([1, 2]), torch.tensor([0, 1, 2])).sum().backward()
    m._last_stream.stream = threading.Lock()
    # Every protocol, 0 and 1 too (autograd.HyperVersion's __slots__ need its __getstate__ there).
    for twin in (copy.deepcopy(m), *(pickle.loads(pickle.dumps(m, protocol=p)) for p in range(pickle.HIGHEST_PROTOCOL + 1))):
        assert twin._last_stream.stream is None and int(twin.iter) == int(m.iter) == 1
        assert torch.equal(twin.weights, m.weights) and torch.equal(twin.momentum2, m.momentum2)
    assert m.placeholder_autograd_tensor.dtype == torch.float32  # FBGEMM's, whatever the default dtype



def test_a_forward_on_another_stream_waits_for_the_last_one_except_in_a_capture(monkeypatch):
    """TritonTBE._follow_last_stream, with stand-in CUDA streams (no GPU): before ``iter`` is written, the
    current stream waits for the last forward's stream when it is another one; never inside a CUDA-graph
    capture (review of session 38: a capture's stream may not wait for work outside it)."""
    class FakeStream:
        def __init__(self, name):
            self.name, self.waited = name, []

        def wait_stream(self, other):
            self.waited.append(other.name)

    a, b, capture = FakeStream("a"), FakeStream("b"), FakeStream("capture")
    current, capturing = [a], [False]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(TritonTBE, "_count_device", property(lambda self: torch.device("cuda", 0)))
    m = TritonTBE([(20, 8)], optimizer=EmbOptimType.ADAM, device="cpu")
    m._follow_last_stream()  # the first forward: nothing to wait for
    m._follow_last_stream()  # the same stream again: stream order suffices
    current[0] = b
    m._follow_last_stream()
    assert (a.waited, b.waited) == ([], ["a"])
    current[0], capturing[0] = capture, True
    m._follow_last_stream()  # inside a capture: no wait on work outside it
    assert capture.waited == [] and m._last_stream.stream is capture
    current[0], capturing[0] = a, False
    m.set_optimizer_step(7)  # writes iter on a: after the capture stream's work
    assert a.waited == ["capture"]
