"""The optimizer chosen the way TorchRec's tutorials choose it: ``apply_optimizer_in_backward(cls,
ebc.parameters(), kwargs)`` on the unsharded model, no optimizer in the sharder's ``fused_params``.
TorchRec maps the class to FBGEMM's ``EmbOptimType`` and the kwargs to the kernel's keywords (``lr`` ->
``learning_rate``); our kernel must receive the same configuration as ``fused``.

Oracles: ``fused`` (FBGEMM's CPU TBE) for torch's SGD and Adagrad and TorchRec's RowWiseAdagrad; for the
optimizers FBGEMM's CPU TBE lacks, our kernel configured through ``fused_params`` with FBGEMM's
keywords (itself tested against the reference in test_plugin_optimizers.py)."""

import copy

import pytest
import torch
import torch.distributed as dist

import plugin_cases as pc
from plugin_cases import EmbOptimType
from torchrec_triton_tbe.plugin import TritonTBESharder, use_fused, use_triton_tbe

import torchrec.optim as trec_optim
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

# (optimizer class, its kwargs, the EmbOptimType TorchRec maps it to, the same as FBGEMM keywords)
WITH_FUSED = [
    (torch.optim.SGD, {"lr": 0.1}, EmbOptimType.EXACT_SGD, {}),
    (torch.optim.Adagrad, {"lr": 0.1, "eps": 0.05}, EmbOptimType.EXACT_ADAGRAD, {"eps": 0.05}),
    (trec_optim.RowWiseAdagrad, {"lr": 0.1, "eps": 0.05}, EmbOptimType.EXACT_ROWWISE_ADAGRAD, {"eps": 0.05}),
]
OURS_ONLY = [
    (trec_optim.Adam, {"lr": 0.02, "eps": 1e-6, "beta1": 0.8, "beta2": 0.95}, EmbOptimType.ADAM,
     {"eps": 1e-6, "beta1": 0.8, "beta2": 0.95}),
    (trec_optim.PartialRowWiseAdam, {"lr": 0.02, "eps": 1e-6}, EmbOptimType.PARTIAL_ROWWISE_ADAM, {"eps": 1e-6}),
    (trec_optim.LAMB, {"lr": 0.02, "eps": 1e-6}, EmbOptimType.LAMB, {"eps": 1e-6}),
]


def _train(plan, optimizer=None, fused_params=None, steps: int = 3):
    model = pc.Model()
    if optimizer is not None:
        cls, kwargs = optimizer
        # A copy: TorchRec adds its own keys to the dict it is given.
        apply_optimizer_in_backward(cls, model.ebc.parameters(), dict(kwargs))
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=torch.device("cpu"), plan=ShardingPlan({"ebc": plan}),
                                   sharders=[TritonTBESharder(fused_params=fused_params)])
    result = dmp.load_state_dict(copy.deepcopy(pc.reference_state()), strict=False)
    assert not result.missing_keys and not result.unexpected_keys, result
    losses = []
    for step in range(steps):
        loss = pc.loss_fn(dmp(pc.batch(pc.TABLES, step)), step)
        loss.backward()  # the optimizer applied in backward steps here
        losses.append(loss.item())
    return losses, dmp


@pytest.fixture(scope="module")
def one_rank():
    pc.single_rank_pg()


def _check_kernels(dmp, emb_type, lr):
    kernels = pc.kernels(dmp)
    assert kernels
    for kernel in kernels:
        assert kernel.emb_module.optimizer == emb_type
        assert kernel.emb_module.get_learning_rate() == pytest.approx(lr)


@pytest.mark.parametrize("cls,kwargs,emb_type,_", WITH_FUSED, ids=lambda v: getattr(v, "__name__", None))
@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
def test_optimizer_in_backward_matches_fused(one_rank, cls, kwargs, emb_type, _, sharding):
    plan = pc.base_plan(sharding, 1)
    fused_losses, fused = _train(use_fused(plan), (cls, kwargs))
    our_losses, ours = _train(use_triton_tbe(plan), (cls, kwargs))
    pc.assert_routed(ours, expect_ours=True)
    _check_kernels(ours, emb_type, kwargs["lr"])
    pc.assert_close(torch.tensor(our_losses), torch.tensor(fused_losses), f"{cls.__name__} losses")
    pc.assert_same_state(ours, fused, f"{cls.__name__} {sharding}")


@pytest.mark.parametrize("cls,kwargs,emb_type,keywords", OURS_ONLY, ids=lambda v: getattr(v, "__name__", None))
def test_optimizer_in_backward_equals_the_fused_params_route(one_rank, cls, kwargs, emb_type, keywords):
    plan = use_triton_tbe(pc.base_plan("table_wise", 1))
    aoib_losses, aoib = _train(plan, (cls, kwargs))
    direct_losses, direct = _train(plan, fused_params=dict(optimizer=emb_type, learning_rate=kwargs["lr"], **keywords))
    _check_kernels(aoib, emb_type, kwargs["lr"])
    assert torch.equal(torch.tensor(aoib_losses), torch.tensor(direct_losses)), (aoib_losses, direct_losses)
    pc.assert_same_state(aoib, direct, f"{cls.__name__}", atol=0, rtol=0)
