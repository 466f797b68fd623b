"""Feature-processed bags through TorchRec (gloo, CPU): a ``FeatureProcessedEmbeddingBagCollection`` with
``PositionWeightedModuleCollection`` (learnable per-position weights, as in TorchRec's DLRM-style
models) on our kernel, via ``TritonTBEFeatureProcessedSharder``: the processors' weights reach our
kernel as per-sample weights and get their gradient from our backward; losses, position weights,
table weights and fused-optimizer state match ``fused`` (FBGEMM's CPU TBE) on 1 and 2 ranks; the
planner picks our kernel where constraints ask for it."""

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

import plugin_cases as pc
from plugin_cases import EmbOptimType
from torchrec_triton_tbe.plugin import TritonTBEEmbeddingBag, TritonTBEFeatureProcessedSharder, use_fused, use_triton_tbe

from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.sharding_plan import construct_module_sharding_plan
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from torchrec.optim.optimizers import in_backward_optimizer_filter

# SUM only: FBGEMM 1.9.0's CPU backward of weighted MEAN omits the 1/L its forward applies.
TABLES = tuple(dataclasses.replace(t, pooling=PoolingType.SUM) for t in pc.TABLES)
FEATURES = [f for t in TABLES for f in t.feature_names]
MAX_LENGTH = 4  # plugin_cases.batch draws up to 3 ids per bag


class FPModel(nn.Module):
    def __init__(self, device: str = "meta") -> None:
        super().__init__()
        dev = torch.device(device)
        self.fp = FeatureProcessedEmbeddingBagCollection(
            EmbeddingBagCollection(tables=list(TABLES), is_weighted=True, device=dev),
            PositionWeightedModuleCollection({f: MAX_LENGTH for f in FEATURES}, device=dev),
        )

    def forward(self, kjt) -> torch.Tensor:
        return self.fp(kjt).values()


def _initial_state():
    torch.manual_seed(0)
    return FPModel(device="cpu").state_dict()


def _train(plan, sharder, rank: int, steps: int = 3):
    dmp = DistributedModelParallel(FPModel(), env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=torch.device("cpu"), plan=ShardingPlan({"fp": plan}), sharders=[sharder])
    # DMP's load_state_dict rewrites the keys of the dict it is given: each model loads its own copy.
    result = dmp.load_state_dict(copy.deepcopy(_initial_state()), strict=False)
    assert not result.missing_keys and not result.unexpected_keys, result
    dense = torch.optim.SGD([p for _, p in in_backward_optimizer_filter(dmp.named_parameters())], lr=0.5)
    losses = []
    for step in range(steps):
        loss = pc.loss_fn(dmp(pc.batch(TABLES, step, rank)), step)
        dense.zero_grad()
        loss.backward()  # the tables' fused optimizer steps inside
        dense.step()
        losses.append(loss.item())
    return losses, dmp


def _kernels(dmp):
    return [k for lookup in dmp.module.fp._lookups for k in pc._unwrap(lookup)._emb_modules]


def _position_weights(dmp):
    return {k: v.detach().clone() for k, v in dmp.state_dict().items() if "position_weights" in k}


def run_ab(sharding: str, optimizer: EmbOptimType, rank: int = 0, world_size: int = 1) -> None:
    sharder = TritonTBEFeatureProcessedSharder(fused_params=pc.fused_params(optimizer))
    plan = construct_module_sharding_plan(FPModel().fp, pc.GENERATORS[sharding](world_size), sharder=sharder,
                                          local_size=world_size, world_size=world_size, device_type="cpu")
    fused_losses, fused = _train(use_fused(plan), sharder, rank)
    our_losses, ours = _train(use_triton_tbe(plan), sharder, rank)
    assert _kernels(ours) and all(type(k) is TritonTBEEmbeddingBag for k in _kernels(ours))
    assert not any(type(k) is TritonTBEEmbeddingBag for k in _kernels(fused))
    what = f"feature-processed {sharding} {optimizer.name} rank {rank}/{world_size}"
    pc.assert_close(torch.tensor(our_losses), torch.tensor(fused_losses), f"{what}: losses")
    ours_pw, fused_pw = _position_weights(ours), _position_weights(fused)
    assert sorted(ours_pw) == sorted(fused_pw) and len(ours_pw) == len(FEATURES), sorted(ours_pw)
    for key in fused_pw:
        # Positions 0..2 occur in the batches: their weights must have moved, and alike on both kernels.
        assert not torch.equal(fused_pw[key][:3], torch.ones(3)), f"{what}: {key} never trained"
        pc.assert_close(ours_pw[key], fused_pw[key], f"{what}: {key}")
    pc.assert_same_state(ours, fused, what)


@pytest.fixture(scope="module")
def one_rank():
    pc.single_rank_pg()


@pytest.mark.parametrize("optimizer", [EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.EXACT_SGD],
                         ids=lambda o: o.name)
def test_position_weighted_bags_match_fused(one_rank, optimizer):
    run_ab("table_wise", optimizer)


@pytest.mark.parametrize("sharding", ["table_column_wise", "grid_shard"])
def test_position_weighted_bags_on_two_dimensional_shardings(one_rank, sharding):
    run_ab(sharding, EmbOptimType.EXACT_ROWWISE_ADAGRAD)


def _two_ranks(rank: int, world_size: int) -> None:
    for sharding in ("row_wise", "column_wise"):
        run_ab(sharding, EmbOptimType.EXACT_ROWWISE_ADAGRAD, rank, world_size)


def test_position_weighted_bags_two_ranks():
    pc.spawn(_two_ranks, 2)


def test_planner_picks_our_kernel_for_constrained_feature_processed_tables(one_rank):
    constraints = {"t0": ParameterConstraints(compute_kernels=["customized_kernel"]),
                   "t2": ParameterConstraints(compute_kernels=["customized_kernel"])}
    sharder = TritonTBEFeatureProcessedSharder(fused_params=pc.fused_params(EmbOptimType.EXACT_ROWWISE_ADAGRAD))
    planner = EmbeddingShardingPlanner(Topology(world_size=1, compute_device="cpu"), constraints=constraints)
    plan = planner.plan(FPModel(), [sharder]).plan["fp"]
    assert {t: ps.compute_kernel for t, ps in plan.items()} == {
        "t0": "customized_kernel", "t1": plan["t1"].compute_kernel, "t2": "customized_kernel"}
    assert plan["t1"].compute_kernel != "customized_kernel"
    _, dmp = _train(plan, sharder, 0, steps=1)
    assert sum(type(k) is TritonTBEEmbeddingBag for k in _kernels(dmp)) >= 1
