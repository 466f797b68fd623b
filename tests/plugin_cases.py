"""Shared material for the TorchRec plugin tests: a small collection of tables, skewed KJT batches,
DistributedModelParallel construction for a plan, A/B training of the same plan on ``fused``
(FBGEMM's CPU TBE) and on the Triton kernel, state comparison, and process groups (an in-process
world of one, or spawned gloo ranks)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import socket
import sys
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

# First: the plugin must be imported before torchrec on a machine without CUDA (see torchrec_triton_tbe/_env.py).
import torchrec_triton_tbe.plugin as plugin
import tbe_cases
from torchrec_triton_tbe._fbgemm import BoundsCheckMode, EmbOptimType
from torchrec_triton_tbe.plugin import (
    TritonTBEEmbeddingCollectionSharder,
    TritonTBEOptions,
    TritonTBESharder,
    two_d,
    use_fused,
    use_triton_tbe,
)

from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardedTensor,
    ShardingEnv,
    ShardingPlan,
)
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

logging.getLogger("fbgemm_gpu").setLevel(logging.ERROR)
logging.getLogger("torchrec").setLevel(logging.ERROR)

# Dims are multiples of 8 so a two-way column split keeps FBGEMM's multiple-of-4 rule.
TABLES = (
    EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=24, feature_names=["f0"], pooling=PoolingType.SUM),
    EmbeddingBagConfig(
        name="t1", embedding_dim=16, num_embeddings=20, feature_names=["f1", "f2"], pooling=PoolingType.MEAN
    ),
    EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=30, feature_names=["f3"], pooling=PoolingType.SUM),
)
B = 4
LR = 0.1
# By weight precision, as in tests/tbe_cases.py (fp16: FBGEMM's own test tolerance).
TOLERANCE = {DataType.FP32: (1e-5, 1e-5), DataType.FP16: (5e-3, 2e-2)}
ATOL, RTOL = TOLERANCE[DataType.FP32]


@dataclasses.dataclass(frozen=True)
class Variant:
    """Which collection: per-sample weights or not, weight precision; ``dense``: a dense parameter (a
    learned output scale) beside the tables, so DistributedModelParallel wraps the model in DDP, as
    its ``reshard`` expects."""

    weighted: bool = False
    data_type: DataType = DataType.FP32
    dense: bool = False

    @property
    def tables(self) -> Sequence[EmbeddingBagConfig]:
        # Weighted: all SUM, since FBGEMM 1.9.0's CPU backward of weighted MEAN omits the 1/L its
        # forward applies.
        pooling = {"pooling": PoolingType.SUM} if self.weighted else {}
        return tuple(dataclasses.replace(t, data_type=self.data_type, **pooling) for t in TABLES)


# ---------------------------------------------------------------------------------------------- process groups
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def single_rank_pg() -> dist.ProcessGroup:
    """The pytest process as a gloo world of one (created once, kept for the session)."""
    if not dist.is_initialized():
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", LOCAL_RANK="0",
                          MASTER_ADDR="localhost", MASTER_PORT=str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    assert dist.get_world_size() == 1
    return dist.group.WORLD


def spawn(fn: Callable, world_size: int, *args, backend: str = "gloo") -> None:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` ranks (gloo on CPU; ``backend="nccl"``: one
    GPU per rank); a failure on any rank (with its traceback) fails the caller."""
    torch.multiprocessing.spawn(_rank_main, args=(world_size, free_port(), fn, args, backend), nprocs=world_size,
                                join=True)


def _rank_main(rank: int, world_size: int, port: int, fn: Callable, args, backend: str = "gloo") -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), MASTER_ADDR="localhost", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two ranks share two cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    # Success: leave without interpreter finalization. After torch.distributed.checkpoint's collectives,
    # gloo's worker threads can still hold work objects at exit, and tearing them down during
    # finalization aborts the process ("terminate called without an active exception", after
    # destroy_process_group; about one run in four of tests/test_plugin_checkpoint.py; cf.
    # pytorch/pytorch#179291). A failure above still raises into spawn's error report.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------------------------------------- model and data
class Model(nn.Module):
    def __init__(self, variant: Variant = Variant(), device: str = "meta") -> None:
        super().__init__()
        self.variant = variant
        self.ebc = EmbeddingBagCollection(
            tables=list(variant.tables), is_weighted=variant.weighted, device=torch.device(device)
        )
        if variant.dense:
            self.scale = nn.Parameter(torch.ones(1, device=torch.device(device)))

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.ebc(kjt).values()
        return pooled * self.scale if self.variant.dense else pooled


def reference_state(variant: Variant = Variant(), seed: int = 0) -> Dict[str, torch.Tensor]:
    """Unsharded initial weights, the same on every rank: both kernels start from them."""
    torch.manual_seed(seed)
    return Model(variant, device="cpu").state_dict()


def batch(
    tables: Sequence[EmbeddingBagConfig], step: int, rank: int = 0, dtype: torch.dtype = torch.int64,
    max_L: int = 3, bad_ids: bool = False, weighted: bool = False,
) -> KeyedJaggedTensor:
    """Skewed ids: row 0 of each table takes a third of the lookups (long runs in backward), the rest
    follow rows * u^3. ``bad_ids`` puts one out-of-range id (and one negative) in the first feature;
    ``weighted`` adds per-sample weights in [0.5, 1.5)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    keys, lengths, values = [], [], []
    for table in tables:
        for name in table.feature_names:
            ls = torch.randint(0, max_L + 1, (B,), generator=g)
            n = int(ls.sum())
            tail = (table.num_embeddings * torch.rand(n, generator=g) ** 3).long().clamp(max=table.num_embeddings - 1)
            hot = torch.rand(n, generator=g) < 0.33
            keys.append(name)
            lengths.append(ls)
            values.append(torch.where(hot, torch.zeros_like(tail), tail))
    if bad_ids:
        lengths[0][0] += 2
        first = values[0]
        values[0] = torch.cat([torch.tensor([tables[0].num_embeddings + 5, -3]), first])
    ids = torch.cat(values)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=ids.to(dtype), lengths=torch.cat(lengths).to(dtype),
        weights=torch.rand(ids.numel(), generator=g) + 0.5 if weighted else None,
    )


def loss_fn(pooled: torch.Tensor, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + step)
    proj = torch.randn(pooled.shape[1], generator=g).to(pooled.device)
    target = torch.randn(pooled.shape[0], generator=g).to(pooled.device)
    return ((pooled @ proj - target) ** 2).mean()


# ---------------------------------------------------------------------------------------------- plans and DMP
GENERATORS = {
    "table_wise": lambda ws: {"t0": table_wise(rank=0), "t1": table_wise(rank=ws - 1), "t2": table_wise(rank=0)},
    "row_wise": lambda ws: {"t0": row_wise(), "t1": row_wise(), "t2": row_wise()},
    # Two column shards per table: on one rank both land on rank 0 (one slice spans both).
    "column_wise": lambda ws: {t.name: column_wise(ranks=[0, ws - 1]) for t in TABLES},
    "table_row_wise": lambda ws: {t.name: table_row_wise(host_index=0) for t in TABLES},
    "table_column_wise": lambda ws: {t.name: plugin.table_column_wise(ranks=[0, ws - 1]) for t in TABLES},
    # Two column blocks, each row-wise over the ranks (one host): TorchRec's own grid_shard keeps these
    # narrow tables in one block.
    "grid_shard": lambda ws: {t.name: plugin.grid_shard(blocks=2) for t in TABLES},
}


def base_plan(sharding: str, world_size: int, variant: Variant = Variant(),
              device: str = "cpu") -> EmbeddingModuleShardingPlan:
    gens = GENERATORS[sharding](world_size)
    return construct_module_sharding_plan(
        Model(variant).ebc, {t.name: gens[t.name] for t in TABLES}, sharder=TritonTBESharder(),
        local_size=world_size, world_size=world_size, device_type=device,
    )


def fused_params(optimizer: EmbOptimType, **extra) -> dict:
    return dict(optimizer=optimizer, learning_rate=LR, eps=0.05, **extra)


def make_dmp(plan: EmbeddingModuleShardingPlan, sharder, variant: Variant = Variant(), init: Optional[dict] = None,
             device: str = "cpu"):
    dmp = DistributedModelParallel(
        Model(variant), env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device(device),
        plan=ShardingPlan({"ebc": plan}), sharders=[sharder],
    )
    state = init if init is not None else reference_state(variant)
    result = dmp.load_state_dict(state, strict=False)
    assert not result.missing_keys and not result.unexpected_keys, result
    return dmp


@dataclasses.dataclass(frozen=True)
class Case:
    """One A/B: the same plan and batches, trained on ``fused`` and on ours."""

    sharding: str = "table_wise"
    optimizer: EmbOptimType = EmbOptimType.EXACT_ROWWISE_ADAGRAD
    options: TritonTBEOptions = TritonTBEOptions()
    kjt_dtype: torch.dtype = torch.int64
    bounds_check_mode: Optional[BoundsCheckMode] = None
    bad_ids: bool = False
    variant: Variant = Variant()
    steps: int = 2

    def plans(self, world_size: int, device: str = "cpu"):
        plan = base_plan(self.sharding, world_size, self.variant, device)
        if self.bounds_check_mode is not None:
            for ps in plan.values():
                ps.bounds_check_mode = self.bounds_check_mode
        return use_fused(plan), use_triton_tbe(plan, options=self.options)


def train(dmp, steps: int, rank: int, kjt_dtype=torch.int64, bad_ids: bool = False, first_step: int = 0,
          device: str = "cpu") -> List[float]:
    variant = dmp.module.variant
    losses = []
    for step in range(first_step, first_step + steps):
        kjt = batch(variant.tables, step, rank, kjt_dtype, bad_ids=bad_ids, weighted=variant.weighted)
        kjt = kjt.to(torch.device(device))
        loss = loss_fn(dmp(kjt), step)
        loss.backward()
        dmp.fused_optimizer.step()
        losses.append(loss.item())
    return losses


def run_case(case: Case, rank: int = 0, world_size: int = 1):
    """Trains the case's plan on fused and on ours and asserts they match; returns (ours, fused)."""
    fused_plan, our_plan = case.plans(world_size)
    sharder = TritonTBESharder(fused_params=fused_params(case.optimizer))
    results = []
    for plan in (fused_plan, our_plan):
        dmp = make_dmp(plan, sharder, case.variant)
        losses = train(dmp, case.steps, rank, case.kjt_dtype, case.bad_ids)
        results.append((losses, dmp))
    (fused_losses, fused_dmp), (our_losses, our_dmp) = results
    assert_routed(our_dmp, expect_ours=True)
    assert_routed(fused_dmp, expect_ours=False)
    assert_options(our_dmp, case)
    atol, rtol = TOLERANCE[case.variant.data_type]
    assert_close(torch.tensor(our_losses), torch.tensor(fused_losses), f"{case} losses", atol, rtol)
    assert_same_state(our_dmp, fused_dmp, str(case), atol, rtol)
    return our_dmp, fused_dmp


def run_cases(rank: int, world_size: int, cases: Sequence[Case]) -> None:
    for case in cases:
        run_case(case, rank, world_size)


# ---------------------------------------------------------------------------------------------- comparisons
def kernels(dmp, collection: str = "ebc") -> list:
    sharded = getattr(dmp.module, collection)
    return [k for lookup in sharded._lookups for k in _unwrap(lookup)._emb_modules]


def _unwrap(lookup):
    while hasattr(lookup, "module") and not hasattr(lookup, "_emb_modules"):
        lookup = lookup.module
    return lookup


def assert_routed(dmp, expect_ours: bool, collection: str = "ebc") -> None:
    from torchrec.distributed.batched_embedding_kernel import BatchedFusedEmbedding, BatchedFusedEmbeddingBag

    ks = kernels(dmp, collection)
    assert ks, "no kernels on this rank"
    if collection == "ebc":
        kind = plugin.TritonTBEEmbeddingBag if expect_ours else BatchedFusedEmbeddingBag
    else:
        kind = plugin.TritonTBEEmbedding if expect_ours else BatchedFusedEmbedding
    assert all(type(k) is kind for k in ks), [type(k).__name__ for k in ks]


def assert_options(dmp, case: Case) -> None:
    """The plan's options reached every one of our kernels' modules."""
    options = case.options
    index_dtype = options.index_dtype or torch.int64
    for kernel in kernels(dmp):
        module = kernel.emb_module
        assert kernel.options == options, (kernel.options, options)
        assert (module.spec.hoist_transpose, module.spec.fused_bounds_check) == (
            options.hoist_transpose, options.fused_bounds_check)
        assert module.embedding_table_index_type == module.embedding_table_offset_type == index_dtype
        assert (module.check_finite, module.precompile_first_step) == (options.check_finite, options.precompile)
        if options.kernel_config is not None:
            assert module.kernel_config.target == options.kernel_config


def local(t) -> torch.Tensor:
    """A tensor, or the local shards of a ShardedTensor stacked along their first dim."""
    if isinstance(t, ShardedTensor):
        shards = [s.tensor.reshape(-1) for s in t.local_shards()]
        return torch.cat(shards) if shards else torch.zeros(0)
    return t.reshape(-1)


def dense(t) -> torch.Tensor:
    """A tensor, or a ShardedTensor's local shards placed at their offsets in a zero tensor of its full
    size (on one rank: the whole tensor, whatever the sharding)."""
    if not isinstance(t, ShardedTensor):
        return t
    out = torch.zeros(t.size(), dtype=t.dtype)
    for shard in t.local_shards():
        index = tuple(slice(o, o + n) for o, n in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes))
        out[index] = shard.tensor
    return out


def shard_layout(t) -> tuple:
    if isinstance(t, ShardedTensor):
        meta = t.metadata()
        return ("sharded", tuple(t.size()), tuple(
            (tuple(m.shard_offsets), tuple(m.shard_sizes), str(m.placement)) for m in meta.shards_metadata))
    return ("tensor", tuple(t.size()))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, atol=ATOL, rtol=RTOL) -> None:
    """tests/tbe_cases.py's comparison (NaN on either side fails) at the plugin tests' fp32 tolerance."""
    tbe_cases.assert_close(actual, expected, what, atol=atol, rtol=rtol)


def optimizer_state(dmp) -> Dict[str, torch.Tensor]:
    state = dmp.fused_optimizer.state_dict()["state"]
    return {f"{param}/{key}": value for param, entries in state.items() for key, value in entries.items()}


def assert_same_state(ours, fused, what: str, atol=ATOL, rtol=RTOL) -> None:
    """Same keys, layouts and (local) values in the model state_dict and the fused optimizer state."""
    for kind, a, b in (("weights", ours.state_dict(), fused.state_dict()),
                       ("optimizer", optimizer_state(ours), optimizer_state(fused))):
        assert sorted(a) == sorted(b), f"{what} {kind}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            layouts = shard_layout(a[key]), shard_layout(b[key])
            assert layouts[0] == layouts[1], f"{what} {key}: {layouts[0]} != {layouts[1]}"
            assert_close(local(a[key]), local(b[key]), f"{what} {kind} {key}", atol, rtol)


# ---------------------------------------------------------------------------------------------- resharding
class _Done:
    def wait(self, *args) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@contextlib.contextmanager
def self_sends():
    """``torch.distributed.batch_isend_irecv`` on a world of one whose sends all go to itself: each receive
    copies the send of its tag (gloo cannot send to itself; NCCL can). For resharding on one CPU rank."""
    real = dist.batch_isend_irecv

    def batch_isend_irecv(ops):
        assert dist.get_world_size() == 1, "self_sends() is for a world of one"
        sends = {op.tag: op.tensor for op in ops if op.op is dist.isend}
        assert len(sends) == sum(op.op is dist.isend for op in ops), "two sends with one tag"
        for op in ops:
            if op.op is dist.irecv:
                op.tensor.copy_(sends.pop(op.tag))
        assert not sends, f"sends nobody received: tags {sorted(sends)}"
        return [_Done() for _ in ops]

    dist.batch_isend_irecv = batch_isend_irecv
    try:
        yield
    finally:
        dist.batch_isend_irecv = real


def reshard_ab(rank: int, world_size: int, device: str = "cpu") -> None:
    """TorchRec's dynamic resharding (``DistributedModelParallel.reshard``) of a table-wise plan, on fused and
    on ours: t0 and t1 swap ranks (on one rank: each moves onto itself, a send to self), given as TorchRec's
    delta plans are, plain ``ParameterSharding``s. Training before and after gives the same losses, weights
    and optimizer state on both kernels, and our tables keep our kernel and their plan options (not the
    sharder's), and the reshard itself leaves every weight and optimizer state as it was. On gloo, one rank
    only, under ``self_sends()``: gloo has no send to self, and on two gloo ranks TorchRec's transfer waits
    forever with fused as with ours."""
    case = Case("table_wise", EmbOptimType.EXACT_ROWWISE_ADAGRAD, TritonTBEOptions(hoist_transpose=True),
                variant=Variant(dense=True))
    sharder = TritonTBESharder(fused_params=fused_params(case.optimizer))  # the sharder's options: defaults
    last = world_size - 1
    results = []
    for kernel, plan in zip(("fused", "customized_kernel"), case.plans(world_size, device)):
        dmp = make_dmp(plan, sharder, case.variant, device=device)
        losses = train(dmp, 2, rank, device=device)
        moves = {"t0": last, "t1": 0, "t2": 0}  # t2 stays: left out of the delta
        new_plan = construct_module_sharding_plan(
            Model().ebc, {t: table_wise(rank=r, compute_kernel=kernel) for t, r in moves.items()},
            sharder=TritonTBESharder(), local_size=world_size, world_size=world_size, device_type=device,
        )
        delta = EmbeddingModuleShardingPlan({t: new_plan[t] for t in ("t0", "t1")})
        assert all(type(ps) is ParameterSharding for ps in delta.values()), delta
        before = full_state(dmp)
        with self_sends() if device == "cpu" else contextlib.nullcontext():
            dmp.reshard({"ebc": (0.0, delta)}, "ebc")
        after = full_state(dmp)  # every weight and optimizer state moved as it was
        assert sorted(after) == sorted(before), (sorted(after), sorted(before))
        for name in before:
            assert_close(after[name], before[name], f"{kernel}: {name} after reshard", atol=0, rtol=0)
        losses += train(dmp, 2, rank, first_step=2, device=device)
        results.append((losses, dmp))
    (fused_losses, fused), (our_losses, ours) = results
    entries = ours.module.ebc.module_sharding_plan
    assert all(isinstance(ps, plugin.TritonTBEParameterSharding) and ps.options == case.options
               for ps in entries.values()), entries
    assert entries["t0"].ranks == [last] and entries["t1"].ranks == [0], entries
    assert_routed(ours, expect_ours=True)
    assert_routed(fused, expect_ours=False)
    assert_options(ours, case)
    assert_close(torch.tensor(our_losses), torch.tensor(fused_losses), f"reshard on {world_size} ranks: losses")
    assert_same_state(ours, fused, f"reshard on {world_size} ranks, rank {rank}")


# ---------------------------------------------------------------------------------------------- checkpoints
def checkpoint_interchange(rank: int, world_size: int, sharding: str,
                           optimizer: EmbOptimType = EmbOptimType.EXACT_ROWWISE_ADAGRAD) -> None:
    """A checkpoint (model state_dict + fused optimizer state_dict) written with one kernel loads into
    a model planned with the other, and training continues identically; both directions."""
    fused_plan, our_plan = Case(sharding=sharding).plans(world_size)
    sharder = TritonTBESharder(fused_params=fused_params(optimizer))
    for src_plan, dst_plan in ((fused_plan, our_plan), (our_plan, fused_plan)):
        what = f"{sharding} {src_plan['t0'].compute_kernel} -> {dst_plan['t0'].compute_kernel}"
        src = make_dmp(src_plan, sharder)
        train(src, 2, rank)
        model_sd = copy.deepcopy(src.state_dict())
        optim_sd = copy.deepcopy(src.fused_optimizer.state_dict())
        dst = make_dmp(dst_plan, sharder, init=reference_state(seed=1))
        fresh = torch.cat([local(v) for _, v in sorted(dst.state_dict().items())])
        assert not torch.allclose(fresh, torch.cat([local(v) for _, v in sorted(model_sd.items())])), "no-op load"
        result = dst.load_state_dict(model_sd)
        assert not result.missing_keys and not result.unexpected_keys, result
        dst.fused_optimizer.load_state_dict(optim_sd)
        assert_same_state(dst, src, f"{what} after load", atol=0, rtol=0)
        src_losses = train(src, 2, rank, first_step=2)
        dst_losses = train(dst, 2, rank, first_step=2)
        assert_close(torch.tensor(dst_losses), torch.tensor(src_losses), f"{what} losses after load")
        assert_same_state(dst, src, f"{what} after training on")


# ---------------------------------------------------------------------------------------------- distributed checkpoints
def full_state(dmp) -> Dict[str, torch.Tensor]:
    """Every weight and fused-optimizer state tensor at its full size, whatever the plan: each rank's
    shards at their offsets, summed over the ranks (the shards are disjoint; a rank that holds no
    shard of a table may not list its state at all). A collective."""
    local = {**{f"model/{k}": v for k, v in dmp.state_dict().items()},
             **{f"optim/{k}": v for k, v in optimizer_state(dmp).items()}}
    meta = {k: (tuple(v.size()), v.dtype, isinstance(v, ShardedTensor)) for k, v in local.items()}
    everyone = [meta]
    if dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, meta)
    union: Dict[str, tuple] = {}
    for m in everyone:
        for k, (size, dtype, sharded) in m.items():
            prev = union.get(k)
            union[k] = (size, dtype, sharded or (prev is not None and prev[2]))
    out = {}
    for k in sorted(union):
        size, dtype, sharded = union[k]
        full = dense(local[k]).double().cpu() if k in local else torch.zeros(size, dtype=torch.float64)
        if sharded and dist.get_world_size() > 1:
            on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else full.device
            full = full.to(on)  # NCCL reduces GPU tensors only
            dist.all_reduce(full)
            full = full.cpu()
        out[k] = full
    return out


def plan_for(sharding: str, kernel: str, world_size: int) -> EmbeddingModuleShardingPlan:
    fused_plan, our_plan = Case(sharding=sharding).plans(world_size)
    return our_plan if kernel == "triton" else fused_plan


def _sharder():
    return TritonTBESharder(fused_params=fused_params(EmbOptimType.EXACT_ROWWISE_ADAGRAD))


def dcp_load(path: str, sharding: str, kernel: str, world_size: int, saved: Dict[str, torch.Tensor]):
    """A model planned with ``sharding`` on ``kernel``, its weights set apart first, loaded from the
    torch.distributed.checkpoint at ``path``: its full state must equal ``saved`` exactly."""
    import torch.distributed.checkpoint as dcp

    dst = make_dmp(plan_for(sharding, kernel, world_size), _sharder(), init=reference_state(seed=1))
    key = "model/ebc.embedding_bags.t0.weight"
    assert not torch.equal(full_state(dst)[key], saved[key]), "the load would be a no-op"
    target = {"model": dst.state_dict(), "optim": dst.fused_optimizer.state_dict()}
    dcp.load(target, checkpoint_id=path)
    result = dst.load_state_dict(target["model"])
    assert not result.missing_keys and not result.unexpected_keys, result
    dst.fused_optimizer.load_state_dict(target["optim"])
    got = full_state(dst)
    assert sorted(got) == sorted(saved), (sorted(got), sorted(saved))
    for k in saved:
        assert torch.equal(got[k], saved[k]), f"{sharding} {kernel} after load: {k} differs"
    return dst


def dcp_reshard(rank: int, world_size: int, path: str, src: tuple, dst: tuple) -> None:
    """``src`` = (sharding, kernel) trains two steps and saves a distributed checkpoint (model and fused
    optimizer) to ``path``; a model planned as ``dst`` loads it (equal exactly) and both train two more
    steps: same losses, same full state. Rank 0 also writes the saved full state beside the checkpoint
    (full_state.pt) for loads in other world sizes."""
    import torch.distributed.checkpoint as dcp

    model = make_dmp(plan_for(src[0], src[1], world_size), _sharder())
    train(model, 2, rank)
    dcp.save({"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}, checkpoint_id=path)
    saved = full_state(model)
    if rank == 0:
        torch.save(saved, os.path.join(path, "full_state.pt"))
    loaded = dcp_load(path, dst[0], dst[1], world_size, saved)
    what = f"{src} -> {dst} on {world_size} ranks"
    assert_close(torch.tensor(train(loaded, 2, rank, first_step=2)), torch.tensor(train(model, 2, rank, first_step=2)),
                 f"{what}: losses after the load")
    after_src, after_dst = full_state(model), full_state(loaded)
    for k in after_src:
        assert_close(after_dst[k], after_src[k], f"{what}: {k} after training on")


# ---------------------------------------------------------------------------------------------- sequence model
# One D for every table: an EmbeddingCollection requires it (and FBGEMM's sequence kernels).
SEQ_TABLES = (
    EmbeddingConfig(name="s0", embedding_dim=8, num_embeddings=24, feature_names=["g0"]),
    EmbeddingConfig(name="s1", embedding_dim=8, num_embeddings=20, feature_names=["g1", "g2"]),
    EmbeddingConfig(name="s2", embedding_dim=8, num_embeddings=30, feature_names=["g3"]),
)
SEQ_FEATURES = [f for t in SEQ_TABLES for f in t.feature_names]
SEQ_PLANS = {
    "table_wise": lambda ws: {"s0": table_wise(rank=0), "s1": table_wise(rank=ws - 1), "s2": table_wise(rank=0)},
    "row_wise": lambda ws: {t.name: row_wise() for t in SEQ_TABLES},
    "column_wise": lambda ws: {t.name: column_wise(ranks=[0, ws - 1]) for t in SEQ_TABLES},
}


class SeqModel(nn.Module):
    def __init__(self, device: str = "meta", need_indices: bool = False) -> None:
        super().__init__()
        self.need_indices = need_indices
        self.ec = EmbeddingCollection(tables=list(SEQ_TABLES), device=torch.device(device), need_indices=need_indices)

    def forward(self, kjt) -> torch.Tensor:
        out = self.ec(kjt)
        if self.need_indices:
            # The ids come back beside each feature's embeddings (as the JaggedTensor's weights).
            for f in SEQ_FEATURES:
                assert torch.equal(out[f].weights(), kjt[f].values()), f
        return torch.cat([out[f].values() for f in SEQ_FEATURES])


def seq_initial_state():
    torch.manual_seed(0)
    return SeqModel(device="cpu").state_dict()


def seq_plans(sharding: str, world_size: int, options: TritonTBEOptions = TritonTBEOptions()):
    gens = SEQ_PLANS[sharding](world_size)
    plan = construct_module_sharding_plan(SeqModel().ec, gens, sharder=TritonTBEEmbeddingCollectionSharder(),
                                          local_size=world_size, world_size=world_size, device_type="cpu")
    return use_fused(plan), use_triton_tbe(plan, options=options)



# ---------------------------------------------------------------------------------------------- 2D parallel
def cpu_dmp_collection() -> type:
    """TorchRec's ``DMPCollection`` made to run on CPU gloo ranks, for tests only. TorchRec refuses anything
    but CUDA / MTIA with one ``assert device.type == "cuda" or ...`` and writes shard placements with a
    device index (``rank:1/cpu:1``), which CPU ShardedTensors reject. So: TorchRec's own class source,
    compiled with assertions stripped (``compile(..., optimize=1)``, as ``python -O`` would; its other
    asserts only guard internal invariants), with its placements rewritten to ``rank:N/cpu`` after its own
    plan remap. Process groups, plan remap, sharding, module grouping and ``sync()`` are TorchRec's code.
    The plugin's replica-sync wrapper is installed on the copy as on TorchRec's class."""
    import inspect
    import textwrap

    import torchrec.distributed.model_parallel as mp
    from torch.distributed.remote_device import _remote_device

    source = textwrap.dedent(inspect.getsource(mp.DMPCollection))
    assert 'device.type == "cuda"' in source, "TorchRec's DMPCollection no longer asserts CUDA: drop this shim"
    namespace = dict(vars(mp))
    exec(compile(source, mp.__file__, "exec", optimize=1), namespace)
    base = namespace["DMPCollection"]
    two_d.install(base)

    class CpuDMPCollection(base):
        def _remap_sharding_plan(self, plan, *args, **kwargs) -> None:
            super()._remap_sharding_plan(plan, *args, **kwargs)
            for module_plan in plan.plan.values():
                for ps in module_plan.values():
                    for shard in getattr(ps.sharding_spec, "shards", None) or ():
                        shard.placement = _remote_device(f"rank:{shard.placement.rank()}/cpu")

    return CpuDMPCollection


def replica_mean(group, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` averaged over the replica process group ``group`` (a collective on it)."""
    total = tensor.detach().double().clone()
    dist.all_reduce(total, group=group)
    return total / dist.get_world_size(group)


def replicas_equal(group, tensor: torch.Tensor) -> bool:
    everyone = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, tensor.detach().contiguous(), group=group)
    return all(torch.equal(everyone[0], t) for t in everyone[1:])


def sync_and_check(dmp, groups: Dict[str, object], what: str) -> None:
    """``dmp.sync()``, checked per collection (``groups``: collection attribute -> its replica group):
    the replicas' kernel tensors differed before it (else the check shows nothing), and after it they
    are equal and equal their mean from before it."""
    means, differed = {}, []
    for collection, group in groups.items():
        for name, t in kernel_tensors(dmp, collection).items():
            means[collection, name] = replica_mean(group, t)
            if not replicas_equal(group, t):
                differed.append((collection, name))
    for collection in groups:
        assert any(c == collection for c, _ in differed), \
            f"{what}: {collection}'s replicas agreed before sync(): the test shows nothing"
    dmp.sync()
    for collection, group in groups.items():
        for name, t in kernel_tensors(dmp, collection).items():
            assert replicas_equal(group, t), f"{what}: {collection} {name} differs across replicas after sync()"
            assert_close(t, means[collection, name].to(t.dtype), f"{what}: {collection} {name} vs the replica mean")


def kernel_tensors(dmp, collection: str = "ebc") -> Dict[str, torch.Tensor]:
    """Per kernel on this rank, each table's weight and each optimizer state, through FBGEMM's getters
    (FBGEMM's CPU TBE for fused, ours for ours): the same names for both kernels."""
    out = {}
    for k, kernel in enumerate(kernels(dmp, collection)):
        module = kernel.emb_module
        for t, w in enumerate(module.split_embedding_weights()):
            out[f"kernel{k}/table{t}/weight"] = w
        if module.optimizer != EmbOptimType.EXACT_SGD:
            for t, states in enumerate(module.split_optimizer_states()):
                for s, state in enumerate(states):
                    out[f"kernel{k}/table{t}/state{s}"] = state
    return out


def two_d_train(rank: int, world_size: int, sharding: str, group_size: int, kernel: str,
                optimizer: EmbOptimType, collection: str = "ebc", device: str = "cpu", steps: int = 2) -> tuple:
    """A ``DMPCollection`` of the test model (``collection`` "ebc": the pooled tables; "ec": the sequence
    tables): ``sharding`` within sharding groups of ``group_size`` ranks, ``world_size // group_size``
    replicas, each rank its own batches, ``sync()`` after every step. Checks that every step's sync made
    the replicas' tensors equal, and equal to their mean before it, and that the replicas differed before
    it (so the sync is what made them agree). On ``device="cuda"`` (NCCL ranks): TorchRec's own
    ``DMPCollection`` with its default ``ReduceOp.AVG``. Returns (losses, tensors on the CPU)."""
    if collection == "ebc":
        model, tables, init, sharder_type = Model(), TABLES, reference_state(), TritonTBESharder
        fused_plan, our_plan = Case(sharding=sharding, optimizer=optimizer).plans(group_size)
    else:
        model, tables, init = SeqModel(), SEQ_TABLES, seq_initial_state()
        sharder_type = TritonTBEEmbeddingCollectionSharder
        fused_plan, our_plan = seq_plans(sharding, group_size)
    dmp_class = cpu_dmp_collection() if device == "cpu" else _torchrec_dmp_collection()
    dmp = dmp_class(
        model, device=torch.device(device), plan=ShardingPlan({collection: our_plan if kernel == "triton" else fused_plan}),
        world_size=world_size, sharding_group_size=group_size, global_pg=dist.group.WORLD,
        sharders=[sharder_type(fused_params=fused_params(optimizer))],
    )
    if device == "cpu":
        dmp.set_all_reduce_hook(two_d.gloo_average)
    assert_routed(dmp, expect_ours=kernel == "triton", collection=collection)
    result = dmp.load_state_dict(init, strict=False)
    assert not result.missing_keys and not result.unexpected_keys, result
    losses = []
    for step in range(steps):
        kjt = batch(tables, step, rank).to(torch.device(device))
        loss = loss_fn(dmp(kjt), step)
        loss.backward()
        dmp.fused_optimizer.step()
        sync_and_check(dmp, {collection: dmp._default_ctx.replica_pg}, f"{kernel} step {step}")
        losses.append(loss.item())
    return losses, {name: t.detach().cpu().clone() for name, t in kernel_tensors(dmp, collection).items()}


def _torchrec_dmp_collection() -> type:
    from torchrec.distributed.model_parallel import DMPCollection

    return DMPCollection


def two_d_ab(rank: int, world_size: int, sharding: str, group_size: int, optimizer: EmbOptimType,
             collection: str = "ebc", device: str = "cpu") -> None:
    """The same 2D-parallel training on fused and on ours: same losses, weights and optimizer state."""
    fused_losses, fused = two_d_train(rank, world_size, sharding, group_size, "fused", optimizer, collection, device)
    our_losses, ours = two_d_train(rank, world_size, sharding, group_size, "triton", optimizer, collection, device)
    what = f"2D {collection} {sharding} group {group_size} of {world_size} ranks, {optimizer.name}, rank {rank}"
    assert_close(torch.tensor(our_losses), torch.tensor(fused_losses), f"{what}: losses")
    assert sorted(ours) == sorted(fused), (sorted(ours), sorted(fused))
    for name in fused:
        assert_close(ours[name], fused[name], f"{what}: {name}")


class BothModel(nn.Module):
    """The pooled and the sequence test tables side by side."""

    def __init__(self, device: str = "meta") -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=list(TABLES), device=torch.device(device))
        self.ec = EmbeddingCollection(tables=list(SEQ_TABLES), device=torch.device(device))

    def forward(self, bags: KeyedJaggedTensor, sequences: KeyedJaggedTensor) -> tuple:
        out = self.ec(sequences)
        return self.ebc(bags).values(), torch.cat([out[f].values() for f in SEQ_FEATURES])


def two_d_submodule_train(rank: int, world_size: int, kernel: str, steps: int = 2) -> tuple:
    """DMPCollection with a submodule context: the EmbeddingBagCollection row-wise over sharding groups
    of two ranks (its own DMPCollectionConfig: world_size / 2 replicas), the EmbeddingCollection in the
    default context, table-wise on one-rank groups (world_size replicas). Each collection's tables must
    sync on their own context's replica group (plugin/two_d.py groups ours as TorchRec groups FBGEMM's)."""
    from torchrec.distributed.types import DMPCollectionConfig

    optimizer = EmbOptimType.EXACT_ROWWISE_ADAGRAD
    bag_plans, seq_plan_pair = Case(sharding="row_wise", optimizer=optimizer).plans(2), seq_plans("table_wise", 1)
    pick = 1 if kernel == "triton" else 0
    sharders = [TritonTBESharder(fused_params=fused_params(optimizer)),
                TritonTBEEmbeddingCollectionSharder(fused_params=fused_params(optimizer))]
    dmp = cpu_dmp_collection()(
        BothModel(), device=torch.device("cpu"), plan=ShardingPlan({"ec": seq_plan_pair[pick]}),
        world_size=world_size, sharding_group_size=1, global_pg=dist.group.WORLD, sharders=sharders,
        submodule_configs=[DMPCollectionConfig(module=EmbeddingBagCollection,
                                               plan=ShardingPlan({"ebc": bag_plans[pick]}), sharding_group_size=2)],
    )
    dmp.set_all_reduce_hook(two_d.gloo_average)
    bag_ctx, seq_ctx = dmp._submodule_ctxs[0], dmp._default_ctx
    assert dist.get_world_size(bag_ctx.replica_pg) == world_size // 2
    assert dist.get_world_size(seq_ctx.replica_pg) == world_size
    assert_routed(dmp, expect_ours=kernel == "triton", collection="ebc")
    assert_routed(dmp, expect_ours=kernel == "triton", collection="ec")
    if kernel == "triton":
        ours = {id(k.emb_module): c for c in ("ebc", "ec") for k in kernels(dmp, c)}
        assert {ours[id(m)] for m in bag_ctx.triton_tbe_modules} == {"ebc"}, "bag tables outside their context"
        assert {ours[id(m)] for m in seq_ctx.triton_tbe_modules} == {"ec"}, "sequence tables outside their context"
    result = dmp.load_state_dict({**reference_state(), **seq_initial_state()}, strict=False)
    assert not result.missing_keys and not result.unexpected_keys, result
    losses = []
    for step in range(steps):
        pooled, sequence = dmp(batch(TABLES, step, rank), batch(SEQ_TABLES, step, 10 + rank))
        loss = loss_fn(pooled, step) + (sequence ** 2).mean()
        loss.backward()
        dmp.fused_optimizer.step()
        sync_and_check(dmp, {"ebc": bag_ctx.replica_pg, "ec": seq_ctx.replica_pg}, f"{kernel} step {step}")
        losses.append(loss.item())
    tensors = {f"{c}/{name}": t.detach().clone() for c in ("ebc", "ec") for name, t in kernel_tensors(dmp, c).items()}
    return losses, tensors


def two_d_submodule_ab(rank: int, world_size: int) -> None:
    fused_losses, fused = two_d_submodule_train(rank, world_size, "fused")
    our_losses, ours = two_d_submodule_train(rank, world_size, "triton")
    assert_close(torch.tensor(our_losses), torch.tensor(fused_losses), f"2D submodule contexts rank {rank}: losses")
    assert sorted(ours) == sorted(fused), (sorted(ours), sorted(fused))
    for name in fused:
        assert_close(ours[name], fused[name], f"2D submodule contexts rank {rank}: {name}")
