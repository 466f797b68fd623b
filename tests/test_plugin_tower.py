"""TorchRec's EmbeddingTower and EmbeddingTowerCollection (an embedding collection and its interaction,
placed together) with our tower sharders: a planner's plan on ``customized_kernel`` builds our kernel for the
tower's tables, and training equals the same plan on ``fused`` (FBGEMM's CPU TBE), table-row- and
table-column-wise, on one gloo rank: towers of an EmbeddingBagCollection, alone or in a collection, and of an
EmbeddingCollection (sequence tables). TorchRec's own tower sharders build its stock collection sharders
inside, so our tables there were refused."""

import pytest
import torch
from torch import nn

import plugin_cases as pc
from plugin_cases import EmbOptimType
from torchrec_triton_tbe.plugin import (
    TritonTBEEmbedding,
    TritonTBEEmbeddingBag,
    TritonTBEEmbeddingTowerCollectionSharder,
    TritonTBEEmbeddingTowerSharder,
    use_fused,
    use_triton_tbe,
)

import torchrec.distributed.embedding_tower_sharding as tower_sharding
from torchrec.distributed.batched_embedding_kernel import BatchedFusedEmbedding, BatchedFusedEmbeddingBag
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.embedding_tower import EmbeddingTower, EmbeddingTowerCollection

WIDTH = sum(t.embedding_dim * len(t.feature_names) for t in pc.TABLES)
KINDS = ("tower", "tower-collection", "sequence-tower")


class Interaction(nn.Module):
    """Pooled: the KeyedTensor's [B, WIDTH] values; sequence: every feature's [ids, 8] rows, stacked."""

    def __init__(self, sequence: bool, device: torch.device) -> None:
        super().__init__()
        self.sequence = sequence
        self.proj = nn.Linear(8 if sequence else WIDTH, 4, device=device)

    def forward(self, embedded) -> torch.Tensor:
        if self.sequence:
            return self.proj(torch.cat([embedded[f].values() for f in pc.SEQ_FEATURES]))
        return self.proj(embedded.values())


def _tables(kind: str) -> tuple:
    return pc.SEQ_TABLES if kind == "sequence-tower" else pc.TABLES


class TowerModel(nn.Module):
    def __init__(self, kind: str, device: str = "cpu") -> None:  # TorchRec moves a tower's interaction
        super().__init__()
        device = torch.device(device)
        sequence = kind == "sequence-tower"
        collection = (EmbeddingCollection if sequence else EmbeddingBagCollection)(tables=list(_tables(kind)),
                                                                                   device=device)
        tower = EmbeddingTower(collection, Interaction(sequence, device))
        self.towers = EmbeddingTowerCollection([tower]) if kind == "tower-collection" else tower

    def forward(self, kjt) -> torch.Tensor:
        return self.towers(kjt)  # EmbeddingTowerCollection: features, then weighted features


@pytest.fixture(scope="module")
def one_rank():
    pc.single_rank_pg()


@pytest.fixture
def cpu_interaction_ddp(monkeypatch):
    """TorchRec wraps a tower's interaction in DDP(device_ids=[device]), which torch refuses for a CPU device,
    with fused as with ours: on the CPU, without device_ids."""
    ddp = tower_sharding.DistributedDataParallel

    def on_cpu(module, device_ids=None, **kwargs):
        if device_ids and all(torch.device(d).type == "cpu" for d in device_ids):
            device_ids = None
        return ddp(module, device_ids=device_ids, **kwargs)

    monkeypatch.setattr(tower_sharding, "DistributedDataParallel", on_cpu)


def _kernels(module: nn.Module) -> list:
    """The TBE kernels of the sharded collections under ``module``, found through ``_modules`` (TorchRec's
    sharded modules list only themselves in ``modules()``, and hold their lookups in a plain list)."""
    if isinstance(module, (ShardedEmbeddingBagCollection, ShardedEmbeddingCollection)):
        return [k for lookup in module._lookups for k in pc._unwrap(lookup)._emb_modules]
    return [k for child in module._modules.values() if child is not None for k in _kernels(child)]


def _load_tables(dmp, init: dict, tables) -> None:
    """The unsharded tables' weights, copied into each kernel's shards (TorchRec's tower collection loads a
    state_dict under other names than its ``state_dict()`` gives, with fused as with ours)."""
    seen = set()
    with torch.no_grad():
        for kernel in _kernels(dmp):
            for table, weight in zip(kernel.config.embedding_tables, kernel.emb_module.split_embedding_weights()):
                (r0, c0), (rows, cols) = table.local_metadata.shard_offsets, table.local_metadata.shard_sizes
                weight.copy_(init[f"{table.name}.weight"][r0:r0 + rows, c0:c0 + cols])
                seen.add(table.name)
    assert seen == {t.name for t in tables}, seen


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sharding", ["table_row_wise", "table_column_wise"])
def test_tower_tables_train_like_fused(one_rank, cpu_interaction_ddp, kind, sharding):
    optimizer = EmbOptimType.EXACT_ROWWISE_ADAGRAD
    sharder_type = TritonTBEEmbeddingTowerCollectionSharder if kind == "tower-collection" else \
        TritonTBEEmbeddingTowerSharder
    sharder = sharder_type(fused_params=pc.fused_params(optimizer))
    tables = _tables(kind)
    constraints = {t.name: ParameterConstraints(sharding_types=[sharding], compute_kernels=["customized_kernel"])
                   for t in tables}
    planner = EmbeddingShardingPlanner(Topology(world_size=1, compute_device="cpu"), constraints=constraints)
    plan = planner.collective_plan(TowerModel(kind), [sharder], torch.distributed.group.WORLD)
    torch.manual_seed(0)
    init = {".".join(k.split(".")[-2:]): v for k, v in TowerModel(kind).state_dict().items()
            if ".embedding." in k}  # "<table>.weight"
    results = []
    for which in (use_fused(plan), plan):
        torch.manual_seed(0)  # the same interaction weights (TorchRec's DDP renames their keys)
        dmp = DistributedModelParallel(TowerModel(kind), env=ShardingEnv.from_process_group(
            torch.distributed.group.WORLD), device=torch.device("cpu"), plan=which, sharders=[sharder])
        _load_tables(dmp, init, tables)
        losses = []
        for step in range(2):
            loss = pc.loss_fn(dmp(pc.batch(tables, step)), step)
            loss.backward()
            dmp.fused_optimizer.step()
            losses.append(loss.item())
        results.append((losses, dmp))
    (fused_losses, fused), (our_losses, ours) = results
    sequence = kind == "sequence-tower"
    kernel_types = (TritonTBEEmbedding, BatchedFusedEmbedding) if sequence else (TritonTBEEmbeddingBag,
                                                                                 BatchedFusedEmbeddingBag)
    assert _kernels(ours) and all(type(k) is kernel_types[0] for k in _kernels(ours)), _kernels(ours)
    assert _kernels(fused) and all(type(k) is kernel_types[1] for k in _kernels(fused))
    pc.assert_close(torch.tensor(our_losses), torch.tensor(fused_losses), f"{sharding} losses")
    pc.assert_same_state(ours, fused, f"tower {sharding}")


def test_torchrecs_own_tower_sharder_is_refused_for_our_tables(one_rank, cpu_interaction_ddp):
    from torchrec.distributed.embedding_tower_sharding import EmbeddingTowerSharder

    sharder = TritonTBEEmbeddingTowerSharder(fused_params=pc.fused_params(EmbOptimType.EXACT_SGD))
    constraints = {t.name: ParameterConstraints(sharding_types=["table_row_wise"],
                                                compute_kernels=["customized_kernel"]) for t in pc.TABLES}
    planner = EmbeddingShardingPlanner(Topology(world_size=1, compute_device="cpu"), constraints=constraints)
    plan = use_triton_tbe(planner.collective_plan(TowerModel("tower"), [sharder], torch.distributed.group.WORLD))
    with pytest.raises(ValueError, match=r"planned on the Triton TBE kernel.*TritonTBEEmbeddingTowerSharder"):
        DistributedModelParallel(TowerModel("tower"), env=ShardingEnv.from_process_group(torch.distributed.group.WORLD),
                                 device=torch.device("cpu"), plan=plan,
                                 sharders=[EmbeddingTowerSharder(fused_params=pc.fused_params(EmbOptimType.EXACT_SGD))])
