"""The kernel class TorchRec builds for our tables (world size 1, gloo, in process): what TorchRec reads
from it (state_dict, parameters, fused optimizer), how ids reach it, learning-rate changes, and
checkpoint interchange with ``fused``."""

import copy

import pytest
import torch

import plugin_cases as pc
from plugin_cases import EmbOptimType, TritonTBEOptions, TritonTBESharder, use_fused, use_triton_tbe
from torchrec_triton_tbe.module import TritonTBE
from torchrec_triton_tbe.plugin import TritonTBEEmbeddingBag

from torchrec.distributed.composable.table_batched_embedding_slice import TableBatchedEmbeddingSlice
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

ADAGRAD, SGD = EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.EXACT_SGD


@pytest.fixture(scope="module", autouse=True)
def _pg():
    pc.single_rank_pg()


def _pair(optimizer=ADAGRAD, options=TritonTBEOptions(), sharding="table_wise", **fused_extra):
    plan = pc.base_plan(sharding, 1)
    sharder = TritonTBESharder(fused_params=pc.fused_params(optimizer, **fused_extra))
    return pc.make_dmp(use_fused(plan), sharder), pc.make_dmp(use_triton_tbe(plan, options=options), sharder)


def test_state_dict_parameters_and_optimizer_look_like_fused():
    fused, ours = _pair()
    pc.assert_routed(ours, expect_ours=True)
    assert all(isinstance(k, FusedOptimizerModule) for k in pc.kernels(ours))
    # Same model state_dict keys, ShardedTensor layout and values; same fused optimizer state keys.
    pc.assert_same_state(ours, fused, "fresh", atol=0, rtol=0)
    state = ours.fused_optimizer.state_dict()["state"]
    assert {p: sorted(s) for p, s in state.items()} == {
        f"ebc.embedding_bags.{t}.weight": [f"{t}.momentum1"] for t in ("t0", "t1", "t2")
    }
    # Each table's registered weight is a slice sharing storage with the kernel's flat weights, and is
    # marked as optimized in backward (dense optimizers skip it).
    kernel = next(k for k in pc.kernels(ours) if "t1" in [t.name for t in k.config.embedding_tables])
    weight = ours.module.ebc.embedding_bags["t1"].weight
    assert isinstance(weight, TableBatchedEmbeddingSlice) and hasattr(weight, "_in_backward_optimizers")
    k = [t.name for t in kernel.config.embedding_tables].index("t1")
    weight.data[3, 2] = 123.0
    assert kernel.emb_module.split_embedding_weights()[k][3, 2] == 123.0
    names = dict(ours.named_parameters())
    assert all(hasattr(names[n], "_in_backward_optimizers") for n in names if "embedding_bags" in n)
    # requires_grad as with fused (whose slices view FBGEMM's weights_dev Parameter): code that picks
    # parameters by the flag sees the same ones.
    flags = {n: p.requires_grad for n, p in fused.named_parameters()}
    assert {n: p.requires_grad for n, p in ours.named_parameters()} == flags and any(flags.values())


def test_sgd_has_no_optimizer_state_like_fused():
    fused, ours = _pair(SGD)
    assert ours.fused_optimizer.state_dict()["state"] == fused.fused_optimizer.state_dict()["state"]
    assert all(v == {} for v in ours.fused_optimizer.state_dict()["state"].values())


def test_learning_rate_changes_reach_the_kernel():
    fused, ours = _pair()
    scheds = []
    for dmp in (fused, ours):
        # A scheduler over DMP's fused optimizer: lr halves every step.
        scheds.append(torch.optim.lr_scheduler.StepLR(dmp.fused_optimizer, step_size=1, gamma=0.5))
    losses = [[], []]
    for step in range(3):
        for i, dmp in enumerate((fused, ours)):
            loss = pc.loss_fn(dmp(pc.batch(pc.TABLES, step)), step)
            loss.backward()
            dmp.fused_optimizer.step()  # pushes the group's lr into the kernels (TorchRec semantics)
            losses[i].append(loss.item())
        for kernel in pc.kernels(ours):
            assert kernel.emb_module.get_learning_rate() == pytest.approx(pc.LR * 0.5**step)
        for sched in scheds:
            sched.step()
    pc.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), "losses under StepLR")
    pc.assert_same_state(ours, fused, "StepLR")

    # Training effect: lr 0 set through the optimizer freezes the weights (row-wise state still grows).
    for group in ours.fused_optimizer.param_groups:
        group["lr"] = 0.0
    ours.fused_optimizer.step()
    assert all(k.emb_module.get_learning_rate() == 0.0 for k in pc.kernels(ours))
    before = copy.deepcopy({k: pc.local(v) for k, v in ours.state_dict().items()})
    pc.train(ours, 1, 0, first_step=5)
    after = {k: pc.local(v) for k, v in ours.state_dict().items()}
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("optimizer", [ADAGRAD, SGD], ids=lambda o: o.name)
def test_a_scheduler_stepped_between_forward_and_backward_trains_like_fused(optimizer):
    """The loop `loss = model(batch); opt.zero_grad(); loss.backward(); opt.step(); sched.step()`: TorchRec's
    fused optimizer pushes the scheduled rate into the kernels in zero_grad(), between the forward and its
    backward. FBGEMM applies the rate the forward ran under (autograd.HyperVersion); so does the plugin."""
    fused, ours = _pair(optimizer)
    scheds = [torch.optim.lr_scheduler.StepLR(dmp.fused_optimizer, step_size=1, gamma=0.5) for dmp in (fused, ours)]
    losses = [[], []]
    for step in range(3):
        for i, dmp in enumerate((fused, ours)):
            loss = pc.loss_fn(dmp(pc.batch(pc.TABLES, step)), step)
            dmp.fused_optimizer.zero_grad()
            loss.backward()
            dmp.fused_optimizer.step()
            scheds[i].step()
            losses[i].append(loss.item())
    pc.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), "losses, zero_grad after the forward")
    pc.assert_same_state(ours, fused, "StepLR, zero_grad after the forward")


@pytest.mark.parametrize(
    "plan_dtype, kjt_dtype, expected",
    [(torch.int32, torch.int32, torch.int32), (torch.int32, torch.int64, torch.int32),
     (None, torch.int32, torch.int64), (torch.int64, torch.int64, torch.int64)],
    ids=["int32-plan-int32-kjt", "int32-plan-int64-kjt", "default-plan-int32-kjt", "int64"],
)
def test_index_dtype_reaches_the_kernel(monkeypatch, plan_dtype, kjt_dtype, expected):
    """TorchRec's embedding_table_index/offset_type keys, set by the plan option, reach the kernel: an
    int32 KJT arrives as int32 (no int64 round trip) and the module gets int32 ids and offsets."""
    seen = []
    kernel_forward, module_forward = TritonTBEEmbeddingBag.forward, TritonTBE.forward

    def spy_kernel(self, features, *args, **kwargs):
        seen.append(("kjt", features.values().dtype, features.offsets().dtype))
        return kernel_forward(self, features, *args, **kwargs)

    def spy_module(self, indices, offsets, *args, **kwargs):
        seen.append(("module", indices.dtype, offsets.dtype, self.embedding_table_index_type))
        return module_forward(self, indices, offsets, *args, **kwargs)

    monkeypatch.setattr(TritonTBEEmbeddingBag, "forward", spy_kernel)
    monkeypatch.setattr(TritonTBE, "forward", spy_module)
    _, ours = _pair(options=TritonTBEOptions(index_dtype=plan_dtype))
    pc.train(ours, 1, 0, kjt_dtype=kjt_dtype)
    # The first training forward calls the module twice: precompile's dry run (on by default), then the step.
    kjt_calls = [s for s in seen if s[0] == "kjt"]
    module_calls = [s for s in seen if s[0] == "module"]
    assert kjt_calls and all(s[1:] == (kjt_dtype, kjt_dtype) for s in kjt_calls), seen
    assert len(module_calls) >= len(kjt_calls) and all(s[1:3] == (expected, expected) for s in module_calls), seen
    assert all(s[3] == (plan_dtype or torch.int64) for s in module_calls), seen


def test_variable_batch_reaches_the_module_as_fbgemms_batch_sizes(monkeypatch):
    """A variable-stride KJT calls the module with FBGEMM's batch_size_per_feature_per_rank (and TorchRec's
    merged output arguments), where TorchRec's base forward would give a non-FBGEMM module fixed batches."""
    _, ours = _pair()
    kernel = pc.kernels(ours)[0]
    names = [f for t in kernel.config.embedding_tables for f in t.feature_names]
    # Feature 0 has 2 samples, the others 1: lengths must match the strides.
    kjt = KeyedJaggedTensor(
        keys=names, values=torch.zeros(len(names) + 1, dtype=torch.int64),
        lengths=torch.ones(len(names) + 1, dtype=torch.int64),
        stride_per_key_per_rank=[[2]] + [[1]] * (len(names) - 1),
    )
    assert kjt.variable_stride_per_key()
    seen = {}
    original = type(kernel.emb_module).forward

    def spy(module, *args, **kwargs):
        seen.update(kwargs)
        return original(module, *args, **kwargs)

    monkeypatch.setattr(type(kernel.emb_module), "forward", spy)
    out = kernel(kjt)
    assert seen["batch_size_per_feature_per_rank"] == [[2]] + [[1]] * (len(names) - 1)
    assert seen["vbe_output"] is None and seen["vbe_output_offsets"] is None
    dims = [t.local_cols for t in kernel.config.embedding_tables for _ in t.feature_names]
    assert out.shape == (2 * dims[0] + sum(dims[1:]),)  # FBGEMM's 1-D VBE layout
    with pytest.raises(ValueError, match="fixed-batch KJT"):
        kernel(KeyedJaggedTensor.from_lengths_sync(keys=names, values=torch.zeros(len(names), dtype=torch.int64),
                                                   lengths=torch.ones(len(names), dtype=torch.int64)),
               vbe_output=torch.zeros(3))


def test_checkpoint_interchange_one_rank():
    pc.checkpoint_interchange(0, 1, "table_wise")


def test_comparison_detects_a_different_kernel_setting():
    """Negative control for the A/B helpers: a learning rate 10% off is caught."""
    plan = pc.base_plan("table_wise", 1)
    fused = pc.make_dmp(use_fused(plan), TritonTBESharder(fused_params=pc.fused_params(ADAGRAD)))
    ours = pc.make_dmp(use_triton_tbe(plan), TritonTBESharder(
        fused_params=dict(pc.fused_params(ADAGRAD), learning_rate=pc.LR * 1.1)))
    pc.train(fused, 2, 0)
    pc.train(ours, 2, 0)
    with pytest.raises(AssertionError, match="differ"):
        pc.assert_same_state(ours, fused, "lr off by 10%")
