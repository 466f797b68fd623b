"""Managed-collision (zero-collision hashing) tables through TorchRec (gloo, CPU): a
``ManagedCollisionEmbeddingBagCollection`` (bags) or ``ManagedCollisionEmbeddingCollection`` (sequence)
with ``MCHManagedCollisionModule``s remaps raw ids from a hash space larger than the tables, evicts rows
every step and resets them through ``TritonTBE.reset_embedding_weight_momentum``; via
``TritonTBEManagedCollisionSharder`` / ``TritonTBEManagedCollisionEmbeddingCollectionSharder`` it trains
like ``fused`` (losses, table weights, optimizer state) on 1 and 2 ranks.

FBGEMM's CPU TBE has no ``reset_weight_momentum`` op (CUDA only), so on the ``fused`` side the test
installs FBGEMM's CUDA semantics written in PyTorch (``_fbgemm_reset``: the evicted rows' weights and
row-wise momentum set to zero); ours runs unpatched. TorchRec then re-initialises evicted rows with
the table's random init_fn: each step seeds the RNG so both models draw the same values."""

import copy
import dataclasses

import torch
import torch.distributed as dist
from torch import nn

import plugin_cases as pc
from plugin_cases import EmbOptimType
from torchrec_triton_tbe.module import TritonTBE
from torchrec_triton_tbe.plugin import (
    TritonTBEEmbedding,
    TritonTBEEmbeddingBag,
    TritonTBEManagedCollisionEmbeddingCollectionSharder,
    TritonTBEManagedCollisionSharder,
    use_fused,
    use_triton_tbe,
)

from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection, ManagedCollisionEmbeddingCollection
from torchrec.modules.mc_modules import DistanceLFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

HASH_SIZE = 1000  # raw ids; the tables hold 20-30 rows, so every step evicts
# collection -> (tables, the collection's and the managed-collision module's classes, sharder, kernel class,
# the state_dict infix of table weights)
COLLECTIONS = {
    "ebc": (tuple(dataclasses.replace(t, pooling=PoolingType.SUM) for t in pc.TABLES), EmbeddingBagCollection,
            ManagedCollisionEmbeddingBagCollection, TritonTBEManagedCollisionSharder, TritonTBEEmbeddingBag,
            ".embedding_bags."),
    "ec": (pc.SEQ_TABLES, EmbeddingCollection, ManagedCollisionEmbeddingCollection,
           TritonTBEManagedCollisionEmbeddingCollectionSharder, TritonTBEEmbedding, ".embeddings."),
}


class MCModel(nn.Module):
    def __init__(self, collection: str = "ebc", device: str = "meta") -> None:
        super().__init__()
        dev = torch.device(device)
        tables, inner, outer = COLLECTIONS[collection][:3]
        self.collection = collection
        mcs = {t.name: MCHManagedCollisionModule(zch_size=t.num_embeddings, device=dev, eviction_interval=1,
                                                 eviction_policy=DistanceLFU_EvictionPolicy(), input_hash_size=HASH_SIZE)
               for t in tables}
        self.mc = outer(inner(tables=list(tables), device=dev), ManagedCollisionCollection(mcs, list(tables)),
                        return_remapped_features=False)

    def forward(self, kjt) -> torch.Tensor:
        out = self.mc(kjt)[0]
        if self.collection == "ebc":
            return out.values()
        return torch.cat([out[f].values() for f in pc.SEQ_FEATURES])


def _fbgemm_reset(self, pruned_indices, pruned_indices_offsets, logical_table_ids, buffer_ids) -> None:
    """FBGEMM's CUDA reset_weight_momentum (row-wise Adagrad), for FBGEMM's CPU TBE."""
    weights, states = self.split_embedding_weights(), self.split_optimizer_states()
    for table, buffer in zip(logical_table_ids.tolist(), buffer_ids.tolist()):
        rows = pruned_indices[pruned_indices_offsets[buffer] : pruned_indices_offsets[buffer + 1]]
        weights[table][rows] = 0
        states[table][0][rows] = 0


def _raw_ids(tables, step: int, rank: int) -> KeyedJaggedTensor:
    kjt = pc.batch(tables, step, rank)
    g = torch.Generator().manual_seed(500 + 10 * step + rank)
    # Skewed raw ids over the hash space: some recur (they keep their slot), many are new (evictions).
    raw = (HASH_SIZE * torch.rand(kjt.values().shape, generator=g) ** 2).long()
    return KeyedJaggedTensor(keys=kjt.keys(), values=raw, lengths=kjt.lengths())


def _train(collection: str, plan, sharder, rank: int, init, steps: int = 4):
    tables, *_, infix = COLLECTIONS[collection]
    dmp = DistributedModelParallel(MCModel(collection), env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=torch.device("cpu"), plan=ShardingPlan({"mc": plan}), sharders=[sharder])
    # The tables' weights only: the collision modules start empty on both.
    result = dmp.load_state_dict({k: v for k, v in copy.deepcopy(init).items() if infix in k}, strict=False)
    assert not result.unexpected_keys, result
    losses = []
    for step in range(steps):
        torch.manual_seed(100 + step)  # the eviction's init_fn draws from it
        loss = pc.loss_fn(dmp(_raw_ids(tables, step, rank)), step)
        loss.backward()
        losses.append(loss.item())
    return losses, dmp


def _kernels(dmp):
    return [k for lookup in dmp.module.mc._embedding_module._lookups for k in pc._unwrap(lookup)._emb_modules]


def run_ab(rank: int = 0, world_size: int = 1, collection: str = "ebc") -> None:
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    tables, _, _, sharder_type, kernel_type, _ = COLLECTIONS[collection]
    torch.manual_seed(0)
    init = MCModel(collection, device="cpu").state_dict()
    sharder = sharder_type(fused_params=pc.fused_params(EmbOptimType.EXACT_ROWWISE_ADAGRAD))
    plan = construct_module_sharding_plan(MCModel(collection).mc, {t.name: row_wise() for t in tables},
                                          sharder=sharder, local_size=world_size, world_size=world_size,
                                          device_type="cpu")
    resets = []
    original = TritonTBE.reset_embedding_weight_momentum

    def counted(self, *args, **kwargs):
        resets.append(int(kwargs["pruned_indices"].numel()))
        return original(self, *args, **kwargs)

    saved = SplitTableBatchedEmbeddingBagsCodegen.__dict__.get("reset_embedding_weight_momentum")
    SplitTableBatchedEmbeddingBagsCodegen.reset_embedding_weight_momentum = _fbgemm_reset
    TritonTBE.reset_embedding_weight_momentum = counted
    try:
        fused_losses, fused = _train(collection, use_fused(plan), sharder, rank, init)
        our_losses, ours = _train(collection, use_triton_tbe(plan), sharder, rank, init)
    finally:
        if saved is None:
            del SplitTableBatchedEmbeddingBagsCodegen.reset_embedding_weight_momentum
        else:
            SplitTableBatchedEmbeddingBagsCodegen.reset_embedding_weight_momentum = saved
        TritonTBE.reset_embedding_weight_momentum = original
    assert _kernels(ours) and all(type(k) is kernel_type for k in _kernels(ours))
    assert sum(resets) > 0, "no row was evicted: the test shows nothing"
    what = f"managed collision {collection} row_wise rank {rank}/{world_size} ({sum(resets)} rows evicted)"
    pc.assert_close(torch.tensor(our_losses), torch.tensor(fused_losses), f"{what}: losses")
    pc.assert_same_state(ours, fused, what)


def test_managed_collision_bags_match_fused_through_evictions():
    pc.single_rank_pg()
    run_ab(collection="ebc")


def test_managed_collision_sequence_tables_match_fused_through_evictions():
    pc.single_rank_pg()
    run_ab(collection="ec")


def _two_ranks(rank: int, world_size: int) -> None:
    for collection in COLLECTIONS:
        run_ab(rank, world_size, collection)


def test_managed_collision_two_ranks():
    pc.spawn(_two_ranks, 2)


def test_sharders_offer_our_kernel_to_the_planner():
    for sharder in (TritonTBEManagedCollisionSharder(), TritonTBEManagedCollisionEmbeddingCollectionSharder()):
        assert "customized_kernel" in sharder.compute_kernels("row_wise", "cpu")
        assert "fused" in sharder.compute_kernels("row_wise", "cpu")
