"""Variable batch size per feature through TorchRec (gloo, CPU): KJTs with ``stride_per_key_per_rank``
and inverse indices reach our kernel as FBGEMM's ``batch_size_per_feature_per_rank`` (and, with several
kernel groups, TorchRec's merged ``vbe_output``), on every pooled sharding type, 1 and 2 ranks.

Oracles: ``fused`` on the same VBE KJT where FBGEMM's CPU TBE can run it (one kernel group: it has no
pre-allocated merged output on CPU); otherwise ``fused`` on the KJT expanded to a fixed batch through
its inverse indices, which gives the same outputs and, since each deduplicated bag's gradient is the
sum over its copies, the same row gradients, weights and optimizer state."""

import pytest
import torch

import plugin_cases as pc
from plugin_cases import EmbOptimType, TritonTBESharder, Variant, use_fused, use_triton_tbe

import torchrec
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

ADAGRAD, SGD = EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.EXACT_SGD
ONE_GROUP = Variant(weighted=True)  # every table SUM, weighted: one kernel group per sharding type
SHARDINGS = ["table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise", "grid_shard"]


def vbe_kjt(tables, step: int, rank: int = 0, weighted: bool = False) -> KeyedJaggedTensor:
    """Per feature its own (deduplicated) batch of skewed bags, and inverse indices mapping the B = 4
    samples of the step onto them."""
    g = torch.Generator().manual_seed(100 * rank + step)
    keys = [f for t in tables for f in t.feature_names]
    rows = {f: t.num_embeddings for t in tables for f in t.feature_names}
    strides = [int(s) for s in torch.randint(1, pc.B + 1, (len(keys),), generator=g)]
    lengths = [torch.randint(0, 4, (s,), generator=g) for s in strides]
    values = [(rows[k] * torch.rand(int(ls.sum()), generator=g) ** 3).long() for k, ls in zip(keys, lengths)]
    inverse = torch.stack([torch.randint(0, s, (pc.B,), generator=g) for s in strides])
    vals = torch.cat(values)
    return KeyedJaggedTensor(
        keys=keys, values=vals, lengths=torch.cat(lengths), stride_per_key_per_rank=[[s] for s in strides],
        inverse_indices=(keys, inverse),
        weights=torch.rand(vals.numel(), generator=g) + 0.5 if weighted else None,
    )


def expand(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """The same lookups as a fixed-batch KJT: sample b of feature f is bag inverse[f, b] of f."""
    keys, inverse = kjt.inverse_indices()
    lengths, values, weights = [], [], []
    for f, key in enumerate(keys):
        jt = kjt[key]
        offs = jt.offsets()
        for b in inverse[f].tolist():
            s, e = int(offs[b]), int(offs[b + 1])
            lengths.append(e - s)
            values.append(jt.values()[s:e])
            if jt.weights_or_none() is not None:
                weights.append(jt.weights()[s:e])
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.cat(values), lengths=torch.tensor(lengths),
        weights=torch.cat(weights) if weights else None,
    )


def _train(dmp, variant: Variant, rank: int, expanded: bool, steps: int = 2):
    losses = []
    for step in range(steps):
        kjt = vbe_kjt(variant.tables, step, rank, variant.weighted)
        loss = pc.loss_fn(dmp(expand(kjt) if expanded else kjt), step)
        loss.backward()
        dmp.fused_optimizer.step()
        losses.append(loss.item())
    return losses


def run(sharding: str, variant: Variant, optimizer, fused_on_vbe: bool, rank: int = 0, world_size: int = 1):
    plan = pc.base_plan(sharding, world_size, variant)
    sharder = TritonTBESharder(fused_params=pc.fused_params(optimizer))
    fused = pc.make_dmp(use_fused(plan), sharder, variant)
    ours = pc.make_dmp(use_triton_tbe(plan), sharder, variant)
    fused_losses = _train(fused, variant, rank, expanded=not fused_on_vbe)
    our_losses = _train(ours, variant, rank, expanded=False)
    pc.assert_routed(ours, expect_ours=True)
    pc.assert_close(torch.tensor(our_losses), torch.tensor(fused_losses), f"VBE {sharding} losses")
    pc.assert_same_state(ours, fused, f"VBE {sharding} {optimizer.name}")


@pytest.fixture(scope="module")
def one_rank():
    pc.single_rank_pg()


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_vbe_matches_fused_on_the_same_batches(one_rank, sharding):
    if sharding == "grid_shard" and torchrec.__version__.startswith("1.6."):
        # TorchRec 1.6.1's grid output permute takes the 1-D variable-batch output as a [B, D] tensor
        # ("pooled_embs must be at least a 2-D tensor"), with fused as with ours; 1.9.2 runs it.
        pytest.skip("TorchRec 1.6.1 has no variable batch on grid-sharded tables (fused neither)")
    run(sharding, ONE_GROUP, ADAGRAD, fused_on_vbe=True)


@pytest.mark.parametrize("sharding,optimizer", [("table_wise", ADAGRAD), ("column_wise", SGD)])
def test_merged_vbe_of_several_groups_matches_the_expanded_batch(one_rank, sharding, optimizer):
    """SUM and MEAN tables: several kernel groups, so TorchRec hands each a slice of one merged output."""
    run(sharding, Variant(), optimizer, fused_on_vbe=False)


def _two_ranks(rank: int, world_size: int) -> None:
    # Not row-wise: TorchRec's variable-batch reduce-scatter of row-wise shards gathers tensors of
    # different sizes per rank, which gloo refuses ("ProcessGroupGloo::allgather: invalid tensor size"),
    # with fused as with ours.
    run("table_wise", ONE_GROUP, ADAGRAD, fused_on_vbe=True, rank=rank, world_size=world_size)
    run("column_wise", Variant(), SGD, fused_on_vbe=False, rank=rank, world_size=world_size)


def test_vbe_two_ranks():
    pc.spawn(_two_ranks, 2)


def test_expanded_oracle_detects_a_wrong_layout(one_rank):
    """Negative control: the expansion oracle is not vacuous (ignoring the inverse indices differs)."""
    kjt = vbe_kjt(ONE_GROUP.tables, 0, weighted=True)
    plan = use_triton_tbe(pc.base_plan("table_wise", 1, ONE_GROUP))
    sharder = TritonTBESharder(fused_params=pc.fused_params(SGD))
    # Separate models: TorchRec sets a model's input dist up for fixed or variable batches at its first call.
    fixed, variable = (pc.make_dmp(plan, sharder, ONE_GROUP) for _ in range(2))
    keys, inverse = kjt.inverse_indices()
    wrong = KeyedJaggedTensor(keys=keys, values=kjt.values(), lengths=kjt.lengths(), weights=kjt.weights(),
                              stride_per_key_per_rank=kjt.stride_per_key_per_rank(),
                              inverse_indices=(keys, torch.zeros_like(inverse)))
    assert torch.allclose(fixed(expand(kjt)), variable(kjt), atol=1e-6)
    assert not torch.allclose(fixed(expand(kjt)), variable(wrong))
