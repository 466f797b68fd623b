"""2D parallel (TorchRec's DMPCollection: sharding groups x replicas) with tables on our kernel, on gloo
ranks: the replicas' weights and optimizer state are averaged by DMPCollection.sync() exactly as for
``fused`` tables (plugin/two_d.py), training matches ``fused``, and the strategy we do not support is
refused by name. TorchRec's class asserts CUDA; the tests run it through ``plugin_cases.cpu_dmp_collection``
(its own source without that assert)."""

import pytest
import torch
import torch.distributed as dist

import plugin_cases as pc
from torchrec_triton_tbe._fbgemm import EmbOptimType
from torchrec_triton_tbe.plugin import TritonTBESharder, two_d


def test_sync_wrapper_is_installed_on_torchrec_dmp_collection():
    from torchrec.distributed.model_parallel import DMPCollection

    assert two_d.installed(DMPCollection)
    two_d.install()  # idempotent
    assert not hasattr(getattr(DMPCollection._cache_sync_tensors, "_triton_tbe_2d_sync"), "_triton_tbe_2d_sync")


@pytest.mark.parametrize("optimizer", [EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.EXACT_SGD,
                                       EmbOptimType.EXACT_ADAGRAD], ids=lambda o: o.name)
def test_two_replicas_of_one_rank_match_fused(optimizer):
    """2 ranks: sharding groups of one rank (every table on it), two replicas with different batches."""
    pc.spawn(pc.two_d_ab, 2, "table_wise", 1, optimizer)


@pytest.mark.parametrize("sharding", ["row_wise", "column_wise", "table_wise"])
def test_two_replicas_of_two_rank_groups_match_fused(sharding):
    """4 ranks: two sharding groups of two ranks (tables split across the group), two replicas."""
    pc.spawn(pc.two_d_ab, 4, sharding, 2, EmbOptimType.EXACT_ROWWISE_ADAGRAD)


def _adam_replicas(rank, world_size):
    # FBGEMM's CPU TBE has no Adam, and TorchRec's own sync reads state["sum"], which a fused Adam
    # table lacks: ours alone, checked against the replica mean inside two_d_train.
    losses, tensors = pc.two_d_train(rank, world_size, "table_wise", 1, "triton", EmbOptimType.ADAM)
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    states = [name for name in tensors if "/state" in name]
    assert len(states) == 2 * 3, states  # exp_avg and exp_avg_sq of three tables, all synced


def test_adam_moments_are_synced_too():
    pc.spawn(_adam_replicas, 2)


def _fully_sharded_refused(rank, world_size):
    from torchrec.distributed.types import ShardingPlan, ShardingStrategy

    _, our_plan = pc.Case().plans(1)
    with pytest.raises(NotImplementedError, match="Triton TBE kernel: tables .*FULLY_SHARDED"):
        pc.cpu_dmp_collection()(
            pc.Model(), device=torch.device("cpu"), plan=ShardingPlan({"ebc": our_plan}), world_size=world_size,
            sharding_group_size=1, global_pg=dist.group.WORLD, sharders=[TritonTBESharder()],
            sharding_strategy=ShardingStrategy.FULLY_SHARDED,
        )


def test_fully_sharded_strategy_is_refused_by_name():
    pc.spawn(_fully_sharded_refused, 2)


@pytest.mark.parametrize("sharding,world_size,group_size", [("table_wise", 2, 1), ("row_wise", 4, 2)])
def test_sequence_collection_replicas_match_fused(sharding, world_size, group_size):
    """EmbeddingCollection (PoolingMode.NONE) tables on our kernel in 2D parallel."""
    pc.spawn(pc.two_d_ab, world_size, sharding, group_size, EmbOptimType.EXACT_ROWWISE_ADAGRAD, "ec")


def test_submodule_context_syncs_its_tables_on_its_own_replica_group():
    """4 ranks: the bags in a DMPCollectionConfig of their own (row-wise over two-rank groups, 2 replicas),
    the sequence tables in the default context (one-rank groups, 4 replicas)."""
    pc.spawn(pc.two_d_submodule_ab, 4)
