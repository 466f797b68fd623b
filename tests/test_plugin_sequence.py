"""Sequence embeddings through TorchRec (gloo, CPU): an ``EmbeddingCollection`` whose plan asks for
``customized_kernel`` runs on our kernel (``TritonTBEEmbedding``, PoolingMode.NONE) with TorchRec's
sequence lookup and output dist around it, and trains to the same losses, weights and fused-optimizer
state as with ``fused`` (FBGEMM's CPU TBE), on table-, row- and column-wise plans, 1 and 2 ranks, with
the plan options; checkpoints interchange with ``fused`` both ways."""

import copy

import pytest
import torch

import plugin_cases as pc
from plugin_cases import EmbOptimType, TritonTBEOptions as Options
from torchrec_triton_tbe.plugin import (
    TritonTBEEmbedding,
    TritonTBEEmbeddingCollectionSharder,
    TritonTBESharder,
)

from torchrec.distributed.batched_embedding_kernel import BatchedFusedEmbedding
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingEnv, ShardingPlan

ADAGRAD, SGD, EXACT_ADAGRAD = EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ADAGRAD
I32 = torch.int32
SEQ_TABLES, SeqModel = pc.SEQ_TABLES, pc.SeqModel
_initial_state, _plans = pc.seq_initial_state, pc.seq_plans


def _dmp(plan, sharder, init=None, need_indices=False):
    dmp = DistributedModelParallel(SeqModel(need_indices=need_indices), env=ShardingEnv.from_process_group(pc.dist.group.WORLD),
                                   device=torch.device("cpu"), plan=ShardingPlan({"ec": plan}), sharders=[sharder])
    result = dmp.load_state_dict(init if init is not None else _initial_state(), strict=False)
    assert not result.missing_keys and not result.unexpected_keys, result
    return dmp


def _train(dmp, steps: int, rank: int, dtype=torch.int64, first_step: int = 0):
    losses = []
    for step in range(first_step, first_step + steps):
        loss = pc.loss_fn(dmp(pc.batch(SEQ_TABLES, step, rank, dtype)), step)
        loss.backward()
        dmp.fused_optimizer.step()
        losses.append(loss.item())
    return losses


def _kernels(dmp):
    sharded = dmp.module.ec
    return [k for lookup in sharded._lookups for k in pc._unwrap(lookup)._emb_modules]


def run_ab(sharding: str, optimizer, options: Options = Options(), rank: int = 0, world_size: int = 1,
           kjt_dtype=torch.int64, need_indices: bool = False):
    """``need_indices``: the EmbeddingCollection also returns each lookup's id (SeqModel checks them)."""
    fused_plan, our_plan = _plans(sharding, world_size, options)
    sharder = TritonTBEEmbeddingCollectionSharder(fused_params=pc.fused_params(optimizer))
    (fl, fused), (ol, ours) = [(None, _dmp(p, sharder, need_indices=need_indices)) for p in (fused_plan, our_plan)]
    fl, ol = _train(fused, 2, rank, kjt_dtype), _train(ours, 2, rank, kjt_dtype)
    assert _kernels(ours) and all(type(k) is TritonTBEEmbedding for k in _kernels(ours))
    assert all(type(k) is BatchedFusedEmbedding for k in _kernels(fused))
    for k in _kernels(ours):
        assert k.emb_module.spec.nobag and k.options == options
    pc.assert_close(torch.tensor(ol), torch.tensor(fl), f"{sharding} losses")
    pc.assert_same_state(ours, fused, f"sequence {sharding} {optimizer.name}")
    return ours, fused


@pytest.fixture(scope="module")
def one_rank():
    pc.single_rank_pg()


@pytest.mark.parametrize("sharding,optimizer,options,kjt_dtype", [
    ("table_wise", ADAGRAD, Options(), torch.int64),
    ("row_wise", SGD, Options(index_dtype=I32, hoist_transpose=True), I32),
    ("column_wise", ADAGRAD, Options(fused_bounds_check=True), torch.int64),
    ("table_wise", EXACT_ADAGRAD, Options(hoist_transpose=True, fused_bounds_check=True), torch.int64),
], ids=["tw-rowwise", "rw-sgd-int32-hoist", "cw-rowwise-fusedbc", "tw-adagrad-hoist-fusedbc"])
def test_sequence_collection_matches_fused(one_rank, sharding, optimizer, options, kjt_dtype):
    run_ab(sharding, optimizer, options, kjt_dtype=kjt_dtype)


def test_sequence_collection_with_need_indices_matches_fused(one_rank):
    run_ab("table_wise", ADAGRAD, need_indices=True)


@pytest.mark.parametrize("sharding", ["table_wise", "column_wise"])
def test_sequence_checkpoints_interchange_with_fused(one_rank, sharding):
    _interchange(0, 1, sharding)


def _interchange(rank: int, world_size: int, sharding: str) -> None:
    fused_plan, our_plan = _plans(sharding, world_size)
    sharder = TritonTBEEmbeddingCollectionSharder(fused_params=pc.fused_params(ADAGRAD))
    for src_plan, dst_plan in ((fused_plan, our_plan), (our_plan, fused_plan)):
        src = _dmp(src_plan, sharder)
        _train(src, 2, rank)
        model_sd, optim_sd = copy.deepcopy(src.state_dict()), copy.deepcopy(src.fused_optimizer.state_dict())
        dst = _dmp(dst_plan, sharder)
        result = dst.load_state_dict(model_sd)
        assert not result.missing_keys and not result.unexpected_keys, result
        dst.fused_optimizer.load_state_dict(optim_sd)
        pc.assert_same_state(dst, src, f"sequence {sharding} after load", atol=0, rtol=0)
        pc.assert_close(torch.tensor(_train(dst, 2, rank, first_step=2)), torch.tensor(_train(src, 2, rank, first_step=2)),
                        f"sequence {sharding} losses after load")


def _two_ranks(rank: int, world_size: int) -> None:
    for sharding, optimizer in (("table_wise", ADAGRAD), ("row_wise", ADAGRAD), ("column_wise", SGD)):
        run_ab(sharding, optimizer, rank=rank, world_size=world_size)
    run_ab("row_wise", ADAGRAD, rank=rank, world_size=world_size, need_indices=True)
    _interchange(rank, world_size, "row_wise")


def test_sequence_collection_two_ranks():
    pc.spawn(_two_ranks, 2)


def test_each_sharder_shards_its_own_collection():
    with pytest.raises(TypeError, match="TritonTBEEmbeddingCollectionSharder"):
        TritonTBESharder().shardable_parameters(SeqModel().ec)
    with pytest.raises(TypeError, match="TritonTBESharder"):
        TritonTBEEmbeddingCollectionSharder().shardable_parameters(pc.Model().ebc)
    sharder = TritonTBEEmbeddingCollectionSharder()
    assert "customized_kernel" in sharder.compute_kernels("row_wise", "cuda")
    assert "customized_kernel" not in sharder.compute_kernels("data_parallel", "cuda")
