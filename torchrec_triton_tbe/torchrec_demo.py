"""A/B of a TorchRec model: the same DLRM trained with its sharding plan on ``fused`` (FBGEMM) and on
the Triton TBE kernel, step by step.

    python -m torchrec_triton_tbe.torchrec_demo [--steps 8] [--sharding table_wise] ...

The model is TorchRec's DLRM (dense arch, pairwise interaction, over arch) over an
EmbeddingBagCollection with SUM and MEAN tables fed Zipf-skewed ids. One plan is written, then
switched with ``use_fused`` / ``use_triton_tbe``; the Triton model starts from the ``fused`` model's
checkpoint (``state_dict`` and the fused optimizer's), and at the end its own checkpoint is loaded into
a fresh ``fused`` model, so the run exercises checkpoint interchange both ways (``--optimizer``: any
optimizer TritonTBE implements; FBGEMM's CPU TBE has SGD, Adagrad and row-wise Adagrad). ``--sequence`` adds an
EmbeddingCollection of sequence tables next to the bags (on the Triton kernel with PoolingMode.NONE in the
Triton plan), ``--vbe`` feeds variable-batch KJTs (each feature its own batch, inverse indices; FBGEMM's VBE
takes SGD, row-wise Adagrad and Adam). Both train on the same
batches; every step prints both losses, the largest embedding weight and optimizer state
differences, and each side's time for forward + backward + optimizer.

On a CPU machine it runs a small model on gloo (our kernels under Triton's interpreter, FBGEMM's CPU
TBE as ``fused``: the times compare an interpreter with compiled C++, not kernels). With a GPU it runs a
larger model on it (compiled Triton against FBGEMM's CUDA TBE, nccl). Under ``torchrun
--nproc_per_node N`` it is one N-rank job (data parallel, one GPU per rank): every rank compares its own
shards, rank 0 prints. Training runs in TorchRec's TrainPipelineSparseDist unless ``--loop`` picks another
pipeline or the plain loop. ``--replicas R`` (GPUs) trains both in TorchRec's 2D parallel DMPCollection: R
replicas of world_size / R-rank sharding groups, synced after every step and checked identical at the end.
Exit status 1 if the two runs diverge beyond the tolerance.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import os
import socket
import statistics
import sys
import time
import warnings
import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from torchrec_triton_tbe import _env
from torchrec_triton_tbe.demo import CPU_FUSED_OPTIMIZERS, OPTIMIZERS, skewed_ids
from torchrec_triton_tbe.plugin import (
    TritonTBEEmbeddingCollectionSharder,
    TritonTBEOptions,
    TritonTBESharder,
    two_d,
    use_fused,
    use_triton_tbe,
)

# "mixed": the first four types in turn over the tables; "planner": TorchRec's EmbeddingShardingPlanner picks.
SHARDINGS = ("table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise", "grid_shard", "mixed",
             "planner")
LOOPS = ("pipeline", "semi-sync", "base", "plain")
# The TorchRec train pipelines the demo can train in (every loop but "plain"), by --loop name.
PIPELINES = {
    "pipeline": "TrainPipelineSparseDist",
    # start_batch=0: semi-synchronous from the first batch (TorchRec's default waits 900 batches).
    "semi-sync": "TrainPipelineSemiSync",
    "base": "TrainPipelineBase",
}



@dataclass(frozen=True)
class Setup:
    device: torch.device
    gpu: bool
    created_pg: bool
    rank: int = 0
    world_size: int = 1
    replicas: int = 1  # 2D parallel (DMPCollection): the model sharded over world_size // replicas ranks

    @property
    def group_size(self) -> int:
        """Ranks per sharding group: the ranks a plan spreads tables over."""
        return self.world_size // self.replicas

    def print(self, *args, **kwargs) -> None:
        """Rank 0 prints; the others compute and reduce."""
        if self.rank == 0:
            print(*args, **{"flush": True, **kwargs})

    def all_max(self, value: float) -> float:
        """The largest value over the ranks."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())


def _parse(argv, gpu: bool) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20 if gpu else 8)
    ap.add_argument("--batch-size", type=int, default=None, help="default: 8192 on a GPU, 32 on CPU; --shape's")
    ap.add_argument("--num-tables", type=int, default=8 if gpu else 4, help="half SUM, half MEAN")
    ap.add_argument("--num-embeddings", type=int, default=500_000 if gpu else 200)
    ap.add_argument("--embedding-dim", type=int, default=128 if gpu else 16)
    ap.add_argument("--bag-size", type=int, default=20 if gpu else 3, help="mean ids per bag")
    ap.add_argument("--alpha", type=float, default=1.15, help="Zipf exponent of the ids (> 1)")
    ap.add_argument("--sharding", choices=SHARDINGS, default="table_wise")
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="rowwise_adagrad")
    ap.add_argument("--learning-rate", type=float, default=0.05)
    ap.add_argument("--weights", choices=("fp32", "fp16"), default="fp32",
                    help="the tables' data_type (both kernels; fp16 is what production tables mostly use)")
    ap.add_argument("--index-dtype", choices=("int32", "int64"), default="int64",
                    help="ids/offsets dtype of the KJTs and of both kernels")
    ap.add_argument("--hoist-transpose", action="store_true", help="Triton option: sort ids in forward")
    ap.add_argument("--precompile", action=argparse.BooleanOptionalAction, default=True,
                    help="Triton option (on by default, as in the plugin): compile the kernels of each kernel "
                         "module's first step in worker processes before running it")
    ap.add_argument("--fused-bounds-check", action="store_true", help="Triton option: repair ids in forward")
    ap.add_argument("--sequence", action="store_true",
                    help="add an EmbeddingCollection (sequence tables, one embedding per id) next to the bags")
    ap.add_argument("--vbe", action="store_true",
                    help="variable batch size per feature: each feature's KJT holds its own deduplicated batch, "
                         "expanded to the B samples by inverse indices")
    ap.add_argument("--shape", default=None,
                    help="production-shaped tables: a shape of the bench suite (--suite), e.g. prod_t40_b16k: its "
                         "per-table rows, dims, bag sizes and Zipf exponents and its batch size (--batch-size wins "
                         "when given); the model concatenates the pooled embeddings (dims differ) into an MLP")
    ap.add_argument("--suite", default="h200", help="the bench suite --shape is read from (name or YAML path)")
    ap.add_argument("--rows-scale", type=float, default=1.0,
                    help="multiply every --shape table's rows by this (at least 1 row), to fit a small machine")
    ap.add_argument("--loop", choices=LOOPS, default=None,
                    help="pipeline: TorchRec's TrainPipelineSparseDist (the default; plain with --sequence, whose "
                         "second KJT TorchRec's Batch does not carry); semi-sync: TrainPipelineSemiSync (each "
                         "batch's embeddings from weights one update older); base: TrainPipelineBase (copy "
                         "overlap only); plain: forward, backward, step")
    ap.add_argument("--replicas", type=int, default=1,
                    help="2D parallel: TorchRec's DMPCollection with this many replicas of the model, each sharded "
                         "over world_size / replicas ranks and averaged by sync() after every step (GPUs only)")
    ap.add_argument("--tolerance", type=float, default=None,
                    help="max relative difference allowed (default 1e-4; 2e-3, four fp16 ulps, with --weights fp16: "
                         "the kernels round each updated weight to fp16 independently)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.tolerance is None:
        args.tolerance = 2e-3 if args.weights == "fp16" else 1e-4
    if args.shape is not None and (args.sequence or args.vbe):
        ap.error("--shape takes fixed-batch pooled tables: no --sequence / --vbe")
    if args.shape is None and args.batch_size is None:
        args.batch_size = 8192 if gpu else 32
    return args


def _init_process_group(gpu: bool) -> Setup:
    """The caller's process group if there is one; else torchrun's (RANK / WORLD_SIZE / MASTER_* in the
    environment: one rank per process, one GPU per rank by LOCAL_RANK); else a world of one."""
    created = False
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "MASTER_PORT" not in os.environ:
            # Each rank would pick a port of its own and wait there for the others, forever.
            raise SystemExit(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but MASTER_PORT is not set: set MASTER_ADDR "
                             "and MASTER_PORT on every rank, or launch with torchrun")
        if "WORLD_SIZE" not in os.environ or "MASTER_PORT" not in os.environ:
            with socket.socket() as s:
                s.bind(("localhost", 0))
                port = s.getsockname()[1]
            os.environ.setdefault("MASTER_ADDR", "localhost")
            os.environ.setdefault("MASTER_PORT", str(port))
            for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
                os.environ.setdefault(key, value)
        if gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if gpu else "gloo")
        created = True
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    return Setup(device=device, gpu=gpu, created_pg=created, rank=dist.get_rank(), world_size=dist.get_world_size())


@dataclass(frozen=True)
class Tables:
    bags: list  # EmbeddingBagConfig: the DLRM's sparse features
    sequence: list  # EmbeddingConfig: an EmbeddingCollection next to them (--sequence), or none
    bag_sizes: Optional[list] = None  # per bag table (--shape); else --bag-size for all
    alphas: Optional[list] = None  # per bag table (--shape); else --alpha for all
    # Per bag table (--shape with bag_size_sigma_list): sizes int(normal(L, sigma)), negatives 0, as
    # FBGEMM's generator draws them; None: uniform in [0, 2L].
    bag_sigmas: Optional[list] = None
    note: str = ""  # --shape: what of the shape the demo does not take (_shape_note), printed by rank 0

    @property
    def mixed_dims(self) -> bool:
        """DLRM's interaction needs one embedding dim: a --shape's tables take the concatenating model."""
        return self.bag_sizes is not None


def _data_type(args):
    from torchrec.modules.embedding_configs import DataType

    return DataType.FP16 if getattr(args, "weights", "fp32") == "fp16" else DataType.FP32


def _shape_tables(args) -> Tables:
    """--shape: the suite shape's tables (rows scaled by --rows-scale), SUM pooled as in the suite; its
    batch size unless --batch-size was given."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

    from torchrec_triton_tbe.bench.case import load_suite

    _, shapes = load_suite(args.suite, {})
    found = [sh for sh in shapes if sh.case.name == args.shape]
    if not found:
        raise SystemExit(f"--shape {args.shape!r}: not in suite {args.suite!r} ({', '.join(sh.case.name for sh in shapes)})")
    case = found[0].case
    if case.vbe or case.pooling != "sum":
        raise SystemExit(f"--shape {args.shape!r}: a {case.pooling} / variable-batch shape; the demo takes fixed-batch SUM shapes")
    if args.batch_size is None:
        args.batch_size = case.batch_size_at(0)
    np.random.seed(42)  # FBGEMM's benchmark seeds NumPy before drawing mixed dims (bench/case.py)
    dims = case.table_dims()
    bags = [EmbeddingBagConfig(name=f"t{k}", embedding_dim=dims[k], feature_names=[f"f{k}"], pooling=PoolingType.SUM,
                               num_embeddings=max(1, round(case.num_embeddings_at(k) * args.rows_scale)),
                               data_type=_data_type(args))
            for k in range(case.num_tables)]
    return Tables(bags, [], bag_sizes=[case.bag_size_at(k) for k in range(case.num_tables)],
                  alphas=[case.alpha_at(k) for k in range(case.num_tables)],
                  bag_sigmas=None if case.bag_size_sigma_list is None else list(case.bag_size_sigma_list),
                  note=_shape_note(case, args))


def _shape_note(case, args) -> str:
    """What of a --shape's case the demo does not take (its own options set those), or nothing."""
    ids = 32 if args.index_dtype == "int32" else 64
    unused = [what for what, differs in (("per-sample weights", case.weighted),
                                         (f"{case.indices_dtype}-bit ids", case.indices_dtype != ids),
                                         (f"{case.weights_precision} weights", case.weights_precision != args.weights),
                                         (f"{case.output_dtype} output", case.output_dtype != "fp32"))
              if differs]
    if not unused:
        return ""
    return (f"note: --shape {case.name} gives the tables' rows, dims, bag sizes and Zipf exponents; its "
            f"{', '.join(unused)} are not used (--index-dtype and --weights set ids and weights here)")


def _tables(args) -> Tables:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType

    if args.shape is not None:
        return _shape_tables(args)

    # The tables below get 1/1 to 1/need of --num-embeddings rows; TorchRec's configs divide by their rows.
    n_seq = max(1, args.num_tables // 2) if args.sequence else 0
    need = max(min(3, args.num_tables), 1 + n_seq)
    if args.num_embeddings < need:
        raise SystemExit(f"--num-embeddings {args.num_embeddings}: some tables would get no rows (the demo gives "
                         f"its tables 1/1 to 1/{need} of it); give at least {need}")
    # --vbe on a CPU: FBGEMM's CPU TBE has no merged output of several kernel groups (TorchRec's
    # vbe_output), so every table pools the same way there: one group.
    mean_ok = not (args.vbe and not torch.cuda.is_available())
    bags = [
        EmbeddingBagConfig(
            name=f"t{k}",
            embedding_dim=args.embedding_dim,
            # Unequal sizes, so groups and offsets are not all alike.
            num_embeddings=args.num_embeddings // (1 + k % 3),
            feature_names=[f"f{k}"],
            pooling=PoolingType.SUM if k % 2 == 0 or not mean_ok else PoolingType.MEAN,
            data_type=_data_type(args),
        )
        for k in range(args.num_tables)
    ]
    sequence = [
        # One D (an EmbeddingCollection requires it); the first table serves two features.
        EmbeddingConfig(name=f"s{k}", embedding_dim=args.embedding_dim, num_embeddings=args.num_embeddings // (2 + k),
                        feature_names=[f"q{k}", f"r{k}"] if k == 0 else [f"q{k}"], data_type=_data_type(args))
        for k in range(max(1, args.num_tables // 2) if args.sequence else 0)
    ]
    return Tables(bags, sequence)


class _WithSequence(torch.nn.Module):
    """DLRM plus sequence features: each sample's sequence embeddings, averaged per feature and summed,
    feed one more linear term of the logit."""

    def __init__(self, dlrm, ec, dim: int, device: torch.device) -> None:
        super().__init__()
        self.dlrm, self.ec = dlrm, ec
        self.proj = torch.nn.Linear(dim, 1, device=device)

    def forward(self, dense_features, sparse_features, sequence_features):
        logits = self.dlrm(dense_features=dense_features, sparse_features=sparse_features)
        B = dense_features.shape[0]
        pooled = torch.zeros(B, self.proj.in_features, device=dense_features.device)
        for jt in self.ec(sequence_features).values():
            lengths = jt.lengths().long()
            sample = torch.repeat_interleave(torch.arange(B, device=pooled.device), lengths)
            pooled = pooled + torch.zeros_like(pooled).index_add(0, sample, jt.values()) / lengths.clamp(min=1)[:, None]
        return logits + self.proj(pooled)


class _SparseArch(torch.nn.Module):
    def __init__(self, ebc) -> None:
        super().__init__()
        self.embedding_bag_collection = ebc


class _ConcatModel(torch.nn.Module):
    """For tables of different dims (--shape): the pooled embeddings concatenated with the dense arch's
    output, then an MLP to one logit (DLRM's pairwise interaction needs one dim)."""

    def __init__(self, ebc, dense_in: int, device: torch.device) -> None:
        super().__init__()
        self.sparse_arch = _SparseArch(ebc)
        total = sum(t.embedding_dim for t in ebc.embedding_bag_configs())
        # Sum-pooled bags of up to ~120 ids: normalised before the MLP, so plain SGD on it stays stable.
        self.norm = torch.nn.LayerNorm(total, device=device)
        self.dense_arch = torch.nn.Sequential(torch.nn.Linear(dense_in, 64, device=device), torch.nn.ReLU())
        self.over_arch = torch.nn.Sequential(torch.nn.Linear(total + 64, 128, device=device), torch.nn.ReLU(),
                                             torch.nn.Linear(128, 1, device=device))

    def forward(self, dense_features, sparse_features):
        pooled = self.norm(self.sparse_arch.embedding_bag_collection(sparse_features).values())
        return self.over_arch(torch.cat([pooled, self.dense_arch(dense_features)], 1))


class _Train(torch.nn.Module):
    """model(batch) -> (loss, (loss, logits, labels)), detached outputs: what TrainPipelineSparseDist
    calls (as torchrec.models.dlrm.DLRMTrain, for the concatenating model)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch):
        logits = self.model(batch.dense_features, batch.sparse_features).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())


def _model(tables: Tables, setup: Setup, dense_in: int, pipeline: bool = False):
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    if tables.mixed_dims:
        model = _ConcatModel(EmbeddingBagCollection(tables=tables.bags, device=torch.device("meta")), dense_in,
                             setup.device)
        return _Train(model) if pipeline else model

    D = tables.bags[0].embedding_dim
    dlrm = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables.bags, device=torch.device("meta")),
        dense_in_features=dense_in,
        dense_arch_layer_sizes=[4 * D, D],
        over_arch_layer_sizes=[4 * D, 1],
        dense_device=setup.device,
    )
    if not tables.sequence:
        if pipeline:
            from torchrec.models.dlrm import DLRMTrain

            # TrainPipelineSparseDist calls model(batch) for (loss, output): DLRMTrain's BCE-with-logits
            # mean is the plain loop's loss.
            return DLRMTrain(dlrm)
        return dlrm
    return _WithSequence(dlrm, EmbeddingCollection(tables=tables.sequence, device=torch.device("meta")), D, setup.device)


def _ebc_path(tables: Tables, pipeline: bool) -> str:
    return ("dlrm." if tables.sequence else "model." if pipeline else "") + "sparse_arch.embedding_bag_collection"


def _ebc(model, tables: Tables, pipeline: bool):
    return model.dlrm.sparse_arch.embedding_bag_collection if tables.sequence else (
        model.model if pipeline else model).sparse_arch.embedding_bag_collection


def _plan(model, tables: Tables, sharding: str, setup: Setup, pipeline: bool):
    """{module path: module plan}: the bags' and, with --sequence, the sequence tables' (which TorchRec
    shards table-, row- or column-wise: table-row-wise, table-column-wise and grid plans put them
    table-wise). On N ranks, one host: table-wise tables go round the ranks, row-wise ones span every
    rank, column-wise and table-column-wise ones split in two over ranks 0 and 1 (0 and 0 on one rank),
    table-row-wise ones span the host, grid ones split in two column blocks each spanning the host;
    "mixed" gives the tables the first four in turn; "planner" is TorchRec's EmbeddingShardingPlanner
    over this topology."""
    from torchrec.distributed import sharding_plan as sp

    from torchrec_triton_tbe.plugin import plans as plugin_plans

    W = setup.group_size
    if sharding == "planner":
        from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
        from torchrec.distributed.planner.types import ParameterConstraints

        topology = Topology(world_size=W, local_world_size=W, compute_device=setup.device.type)
        sharders = [TritonTBESharder(), TritonTBEEmbeddingCollectionSharder()]
        # Model-parallel types only: left free, the planner puts small tables data-parallel, where no
        # embedding kernel runs and the A/B compares nothing.
        types = ["table_wise", "row_wise", "column_wise", "table_row_wise"]
        constraints = {t.name: ParameterConstraints(sharding_types=types if t in tables.bags else types[:3])
                       for t in tables.bags + tables.sequence}
        planner = EmbeddingShardingPlanner(topology, constraints=constraints)
        return dict(planner.collective_plan(model, sharders, dist.group.WORLD).plan)
    generators = {
        "table_wise": lambda k: sp.table_wise(rank=k % W),
        "row_wise": lambda k: sp.row_wise(),
        "column_wise": lambda k: sp.column_wise(ranks=[0, 1 % W]),
        "table_row_wise": lambda k: sp.table_row_wise(host_index=0),
    }
    kinds = list(generators)  # "mixed": these four
    generators.update(table_column_wise=lambda k: plugin_plans.table_column_wise(ranks=[0, 1 % W]),
                      grid_shard=lambda k: plugin_plans.grid_shard(blocks=2))

    def generator(kind: str, k: int):
        return generators[kinds[k % len(kinds)] if kind == "mixed" else kind](k)

    common = dict(local_size=W, world_size=W, device_type=setup.device.type)
    plans = {_ebc_path(tables, pipeline): sp.construct_module_sharding_plan(
        _ebc(model, tables, pipeline), {t.name: generator(sharding, k) for k, t in enumerate(tables.bags)},
        sharder=TritonTBESharder(), **common,
    )}
    if tables.sequence:
        # An EmbeddingCollection has no table-row-wise, table-column-wise or grid sharding.
        seq_sharding = "table_wise" if sharding in ("table_row_wise", "table_column_wise", "grid_shard") else sharding
        def seq_kind(k: int) -> str:
            # An EmbeddingCollection has no table-row-wise sharding: "mixed" takes the other three.
            return ("table_wise", "row_wise", "column_wise")[k % 3] if seq_sharding == "mixed" else seq_sharding

        plans["ec"] = sp.construct_module_sharding_plan(
            model.ec, {t.name: generators[seq_kind(k)](k) for k, t in enumerate(tables.sequence)},
            sharder=TritonTBEEmbeddingCollectionSharder(), **common,
        )
    return plans


def _switch(plans: dict, convert) -> dict:
    return {path: convert(plan) for path, plan in plans.items()}


# A CPU-capable stand-in for TorchRec's DMPCollection (which asserts CUDA): tests set it
# (tests/plugin_cases.py cpu_dmp_collection); None: TorchRec's own class.
DMP_COLLECTION_CLASS: Optional[type] = None


def _dmp_collection_class(setup: Setup) -> type:
    if DMP_COLLECTION_CLASS is not None:
        return DMP_COLLECTION_CLASS
    if not setup.gpu:
        raise SystemExit("--replicas: TorchRec's DMPCollection (2D parallel) runs on CUDA or MTIA devices only; "
                         "run it on GPUs")
    from torchrec.distributed.model_parallel import DMPCollection

    return DMPCollection


def _dmp(tables: Tables, setup: Setup, plans: dict, sharders, dense_in: int, lr: float, pipeline: bool):
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    model = _model(tables, setup, dense_in, pipeline)
    if setup.replicas > 1:
        # DMPCollection remaps the plan's ranks and shard placements in place: each model gets its own copy.
        dmp = _dmp_collection_class(setup)(
            model, device=setup.device, plan=ShardingPlan(copy.deepcopy(plans)), world_size=setup.world_size,
            sharding_group_size=setup.group_size, global_pg=dist.group.WORLD, sharders=sharders,
            # Table-row-wise plans span "the host" (host_index=0): in 2D, the sharding group is that host.
            node_group_size=setup.group_size,
        )
        if not setup.gpu:
            dmp.set_all_reduce_hook(two_d.gloo_average)
    else:
        dmp = DistributedModelParallel(
            model,
            env=ShardingEnv.from_process_group(dist.group.WORLD),
            device=setup.device,
            plan=ShardingPlan(plans),
            sharders=sharders,
        )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda ps: torch.optim.SGD(ps, lr=lr)
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def _kjt(configs, args, g, dtype, vbe: bool, bag_sizes=None, alphas=None, bag_sigmas=None):
    """Zipf-skewed bags of every feature of ``configs``. VBE: feature f holds its own batch of B_f <= B
    distinct samples (a per-feature deduplication, as TorchRec's VBE inputs carry), expanded to the B
    samples by ``inverse_indices``."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    B = args.batch_size
    keys = [f for t in configs for f in t.feature_names]
    rows = [t.num_embeddings for t in configs for _ in t.feature_names]
    strides = [int(torch.randint(max(1, B // 4), B + 1, (1,), generator=g)) if vbe else B for _ in keys]
    Ls = bag_sizes or [args.bag_size] * len(keys)
    alphas = alphas or [args.alpha] * len(keys)
    sigmas = bag_sigmas or [None] * len(keys)
    lengths = [torch.randint(0, 2 * L + 1, (s,), generator=g) if sigma is None
               else torch.normal(float(L), float(sigma), (s,), generator=g).long().clamp_min(0)
               for s, L, sigma in zip(strides, Ls, sigmas)]
    # alpha <= 1 (the suites' "uniform" tables): uniform ids, as FBGEMM's request generator.
    values = [skewed_ids(n, int(ls.sum()), a, g) if a > 1 else torch.randint(0, n, (int(ls.sum()),), generator=g)
              for n, ls, a in zip(rows, lengths, alphas)]
    if not vbe:
        return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values).to(dtype),
                                                   lengths=torch.cat(lengths).to(dtype))
    inverse = torch.stack([torch.randint(0, s, (B,), generator=g) for s in strides])
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values).to(dtype), lengths=torch.cat(lengths).to(dtype),
                             stride_per_key_per_rank=[[s] for s in strides], inverse_indices=(keys, inverse))


def _batches(tables: Tables, args, setup: Setup, dense_in: int):
    """args.steps batches of this rank (its own seed: data parallel), on the CPU: both kernels' models
    get the same ones (the pipeline moves each to the device itself)."""
    g = torch.Generator().manual_seed(args.seed * 1000 + setup.rank)
    dtype = torch.int32 if args.index_dtype == "int32" else torch.int64
    out = []
    for _ in range(args.steps):
        kjt = _kjt(tables.bags, args, g, dtype, args.vbe, tables.bag_sizes, tables.alphas, tables.bag_sigmas)
        seq = _kjt(tables.sequence, args, g, dtype, False) if tables.sequence else None
        dense = torch.randn(args.batch_size, dense_in, generator=g)
        labels = (torch.rand(args.batch_size, generator=g) < 0.3).float()
        out.append((dense, kjt, labels, seq))
    return out


def _pipeline_batches(batches):
    from torchrec.datasets.utils import Batch

    return [Batch(dense_features=d, sparse_features=k, labels=y) for d, k, y, _ in batches]


def _local(t) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    from torchrec.distributed.types import ShardedTensor

    if isinstance(t, ShardedTensor):
        # On N ranks a rank may hold no shard of a table: nothing of it to compare here.
        shards = [s.tensor.reshape(-1) for s in t.local_shards()]
        return torch.cat(shards) if shards else torch.zeros(0)
    if isinstance(t, DTensor):
        # 2D parallel: this rank's shards, behind TorchRec's LocalShardsWrapper.
        local = t.to_local()
        shards = [s.reshape(-1) for s in local.local_shards()] if hasattr(local, "local_shards") else [local.reshape(-1)]
        return torch.cat(shards) if shards else torch.zeros(0)
    return t.reshape(-1)


def _replicas_identical(dmp) -> bool:
    """Whether every replica of this rank's shards (weights and fused-optimizer state) holds the same
    values, over DMPCollection's replica group (a collective: every rank calls it)."""
    group = dmp.device_mesh.get_group(mesh_dim="replicate")
    same = True
    for tensors in (_embedding_state(dmp), _optimizer_state(dmp)):
        for key in sorted(tensors):
            t = _local(tensors[key]).double()
            high, low = t.clone(), t.clone()
            dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
            dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
            same = same and torch.equal(high, low)
    return same


def _inf_if_not_finite(value: float) -> float:
    """A NaN difference as +inf: Python's max() and a MAX all-reduce would otherwise drop or keep it by
    argument order, and a run gone NaN must read as a MISMATCH."""
    return value if math.isfinite(value) else math.inf


# Elements compared at a time: a whole table in float64 with its temporaries (11 GB for prod_t40_b16k's
# largest) does not fit an 80 GB GPU beside the two models (session 45, H100).
_DIFF_SLICE = 1 << 24


def _max_rel_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    worst = None
    for key in a:
        x, y = _local(a[key]).reshape(-1), _local(b[key]).reshape(-1)
        for i in range(0, x.numel(), _DIFF_SLICE):
            xs, ys = x[i : i + _DIFF_SLICE].double(), y[i : i + _DIFF_SLICE].double()
            # Equal infinities differ by NaN, and so does NaN on both sides: both count as +inf.
            rel = torch.nan_to_num((xs - ys).abs() / (1.0 + ys.abs()), nan=math.inf, posinf=math.inf).max()
            worst = rel if worst is None else torch.maximum(worst, rel.to(worst.device))
    return 0.0 if worst is None else float(worst)


def _embedding_state(dmp) -> Dict[str, torch.Tensor]:
    return {k: v for k, v in dmp.state_dict().items() if ".embedding_bags." in k or ".embeddings." in k}


def _optimizer_state(dmp) -> Dict[str, torch.Tensor]:
    state = dmp.fused_optimizer.state_dict()["state"]
    return {f"{p}/{k}": v for p, entries in state.items() for k, v in entries.items()}


def _step(dmp, opt, batch, setup: Setup, timings: Optional[dict] = None) -> tuple[float, float]:
    """The plain loop's step: forward, loss, backward (the fused optimizer inside), the dense step.
    ``timings``: gets ``issue_ms``, the host time until the step's last call returned (before the
    closing synchronize): close to the step's time when the host, not the GPU, bounds it."""
    dense, kjt, labels, seq = (None if x is None else x.to(setup.device) for x in batch)
    if setup.gpu:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    extra = {} if seq is None else {"sequence_features": seq}
    logits = dmp(dense_features=dense, sparse_features=kjt, **extra).squeeze(-1)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if setup.replicas > 1:
        dmp.sync()  # 2D parallel: replicas averaged (weights and fused-optimizer state)
    if timings is not None:
        timings["issue_ms"] = (time.perf_counter() - t0) * 1e3
    if setup.gpu:
        torch.cuda.synchronize()
    return loss.item(), (time.perf_counter() - t0) * 1e3


def _pipeline(loop: str, model, optimizer, device: torch.device):
    # train_pipelines.py defines all three in TorchRec 1.6.1 and 1.9.2 (the package exports only some).
    from torchrec.distributed.train_pipeline import train_pipelines

    cls = getattr(train_pipelines, PIPELINES[loop])
    extra = {} if loop == "base" else {"dmp_collection_sync_interval_batches": None}  # the demo syncs itself
    if loop == "semi-sync":
        return cls(model, optimizer, device, start_batch=0, **extra)
    return cls(model, optimizer, device, **extra)


def _pipeline_step(pipeline, it, setup: Setup, model) -> tuple[float, float]:
    """One pipeline progress(): this batch's forward, backward and optimizer step, with the next batch's
    copy (and, but for TrainPipelineBase, its input distribution) started (the loop TorchRec users run)."""
    if setup.gpu:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    loss = pipeline.progress(it)[0]  # DLRMTrain's output: (loss, logits, labels), detached
    if setup.replicas > 1:
        model.sync()  # 2D parallel (the pipelines' own per-batch sync is off: _pipeline)
    value = loss.item()
    if setup.gpu:
        torch.cuda.synchronize()
    return value, (time.perf_counter() - t0) * 1e3


def main(argv=None) -> int:
    gpu = torch.cuda.is_available() and not _env.interpreting()
    args = _parse(argv, gpu)
    # TorchRec and torch deprecation chatter would bury the table.
    for name in ("fbgemm_gpu", "torchrec", "torch.fx._symbolic_trace", None):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    setup = _init_process_group(gpu)
    global _GLOO_RANKS
    _GLOO_RANKS = not setup.gpu and setup.world_size > 1
    try:
        return _run(args, setup)
    finally:
        if setup.created_pg:
            dist.destroy_process_group()


_GLOO_RANKS = False  # whether the last main() ran on several gloo ranks (see cli)


def cli() -> None:
    """The command line (``python -m`` and the console script): main(), then exit with its status. After
    a run on several gloo ranks the process leaves without interpreter finalization: gloo's worker
    threads can still hold work objects at exit, and tearing them down then aborts the process
    ("terminate called without an active exception", SIGABRT, after destroy_process_group; seen under
    torchrun on the CPU machine, docs/torchrec.md; cf. pytorch/pytorch#179291). Output is flushed first and
    the process group is already destroyed; a run that raised exits through the exception as usual."""
    rc = main()
    if _GLOO_RANKS:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    raise SystemExit(rc)


def _precompile_lines(model) -> List[str]:
    """Where each Triton kernel's precompile (--precompile: inside step 0) spent its time."""
    from torchrec_triton_tbe.plugin import triton_tbe_modules

    lines = []
    for m in triton_tbe_modules(model):
        r = m.precompile_report
        if r is None:
            continue
        if not r.compiled:
            lines.append(f"precompile: {r.specializations} specializations, nothing compiled (Triton's interpreter)")
            continue
        jobs = [t for _, t in r.job_seconds]
        timed = f" (jobs: {sum(jobs):.2f} s in all, longest {max(jobs):.2f} s)" if jobs else ""
        lines.append(
            f"precompile: {r.specializations} specializations in {r.seconds:.2f} s: dry run {r.record_seconds:.2f} s, "
            f"compile {r.compile_seconds:.2f} s on {r.workers} {'pre-started ' if r.prestarted else ''}"
            f"{'processes' if r.pool == 'process' else 'threads'}{timed}, "
            f"load {r.load_seconds:.2f} s more on {r.load_threads} threads "
            f"({r.cache_hits} cache hits, {r.load_compiles} compiled again"
            + (f", {len(r.worker_errors)} worker errors: {r.worker_errors[0]}" if r.worker_errors else "") + ")")
    return lines


def _run(args, setup: Setup) -> int:
    if not setup.gpu and args.vbe and args.index_dtype == "int32":
        # fbgemm-gpu-cpu 1.9.0 corrupts its heap on variable batches of int32 ids ("free(): invalid next size").
        raise SystemExit("--vbe with --index-dtype int32: FBGEMM's CPU TBE (the 'fused' side without a GPU) "
                         "corrupts its heap on it; use int64 ids on a CPU")
    if not setup.gpu and args.optimizer not in CPU_FUSED_OPTIMIZERS:
        raise SystemExit(f"--optimizer {args.optimizer}: FBGEMM's CPU TBE (the 'fused' side without a GPU) "
                         f"implements only {', '.join(CPU_FUSED_OPTIMIZERS)}; run it on a GPU")
    if args.replicas < 1 or setup.world_size % args.replicas:
        raise SystemExit(f"--replicas {args.replicas}: must divide the world size ({setup.world_size})")
    if args.replicas > 1:
        _dmp_collection_class(setup)  # refuses CPUs here, before anything is built
        setup = dataclasses.replace(setup, replicas=args.replicas)
    torch.manual_seed(args.seed)
    tables = _tables(args)
    if tables.note:
        setup.print(tables.note)
    dense_in = 13  # DLRM's Criteo dense feature count
    index_dtype = torch.int32 if args.index_dtype == "int32" else torch.int64
    # TorchRec's own keys, for both kernels: ids reach them in the KJT's dtype.
    fused_params = dict(
        optimizer=OPTIMIZERS[args.optimizer], learning_rate=args.learning_rate, eps=1e-2,
        embedding_table_index_type=index_dtype, embedding_table_offset_type=index_dtype,
    )
    options = TritonTBEOptions(
        index_dtype=index_dtype, hoist_transpose=args.hoist_transpose, fused_bounds_check=args.fused_bounds_check,
        precompile=args.precompile,
    )
    loop = args.loop or ("plain" if tables.sequence else "pipeline")
    if loop != "plain" and tables.sequence:
        raise SystemExit(f"--loop {loop} with --sequence: TorchRec's Batch carries one KJT; use --loop plain")
    if loop == "semi-sync" and not setup.gpu:
        # TorchRec's own fill_pipeline calls record_stream on the batch, which CPU tensors refuse ("unknown
        # parameter type"), with fused as with ours.
        raise SystemExit("--loop semi-sync: TorchRec's TrainPipelineSemiSync needs CUDA streams; run it on a GPU")
    pipeline = loop != "plain"
    sharders = [TritonTBESharder(fused_params=fused_params), TritonTBEEmbeddingCollectionSharder(fused_params=fused_params)]
    plan = _plan(_model(tables, setup, dense_in, pipeline), tables, args.sharding, setup, pipeline)

    row_split = {ps.sharding_type for mp in plan.values() for ps in mp.values()} & {"row_wise", "table_row_wise"}
    if not setup.gpu and setup.world_size > 1:
        # Row splits give a rank a shard of 0 rows wherever ceil(rows / ranks) runs out early (4 rows on 3
        # ranks: 2, 2, 0), and FBGEMM's CPU TBE trains the next table of the group wrongly then
        # (docs/torchrec.md, "Where fused cannot be the reference"): the A/B would fail on fused's side.
        empty = sorted(t for mp in plan.values() for t, ps in mp.items()
                       if ps.sharding_type in ("row_wise", "table_row_wise", "grid_shard")
                       and any(sh.shard_sizes[0] == 0 for sh in getattr(ps.sharding_spec, "shards", None) or ()))
        if empty:
            raise SystemExit(f"tables {empty} get a shard of 0 rows on some of the {setup.world_size} ranks of "
                             "this plan: FBGEMM's CPU TBE ('fused' here) mis-trains the table after a 0-row shard; "
                             "raise --rows-scale / --num-embeddings, or use table_wise / column_wise sharding")
    if args.vbe and not setup.gpu and setup.world_size > 1 and row_split:
        # TorchRec 1.9.2's own backward of a variable batch over row-split tables gathers unequal sizes,
        # which gloo refuses ("ProcessGroupGloo::allgather: invalid tensor size"), on fused as on ours.
        raise SystemExit(f"--vbe on {setup.world_size} gloo ranks with {sorted(row_split)} tables: TorchRec's "
                         "backward fails on gloo for fused too; use table_wise / column_wise, or GPUs (NCCL)")
    fused, fused_opt = _dmp(tables, setup, _switch(plan, use_fused), sharders, dense_in, args.learning_rate, pipeline)
    ours, our_opt = _dmp(tables, setup, _switch(plan, lambda p: use_triton_tbe(p, options=options)), sharders,
                         dense_in, args.learning_rate, pipeline)
    # The Triton model starts from the fused model's checkpoint: weights, dense layers, optimizer state.
    # No deepcopy: loading copies into the destination's own tensors, and a state dict's tables are views
    # of one flat TBE buffer, whose deepcopy clones the whole buffer per table (prod_t40_b16k: 40 x 5 GiB,
    # out of memory on the H200).
    result = ours.load_state_dict(fused.state_dict())
    if result.missing_keys or result.unexpected_keys:
        raise RuntimeError(f"checkpoint interchange failed: {result}")
    ours.fused_optimizer.load_state_dict(fused.fused_optimizer.state_dict())
    batches = _batches(tables, args, setup, dense_in)

    where = ("GPU: compiled Triton vs FBGEMM CUDA TBE" if setup.gpu
             else "CPU: Triton interpreter vs FBGEMM CPU TBE")
    pooling = ",".join(t.pooling.name for t in tables.bags)
    print = setup.print  # noqa: A001  (rank 0 prints; every rank computes)
    print(f"TorchRec DLRM A/B, plan kernel 'fused' vs 'customized_kernel' (triton_tbe) on {where}, "
          f"world_size={setup.world_size}, loop={PIPELINES.get(loop, 'plain')}"
          + (f", 2D parallel: {setup.replicas} replicas x {setup.group_size}-rank sharding groups (DMPCollection)"
             if setup.replicas > 1 else ""))
    if tables.mixed_dims:
        dims = sorted({t.embedding_dim for t in tables.bags})
        sizes = (f"shape={args.shape} (suite {args.suite}, rows x{args.rows_scale:g}): rows "
                 f"{min(t.num_embeddings for t in tables.bags)}..{max(t.num_embeddings for t in tables.bags)} "
                 f"dims {dims[0]}..{dims[-1]} L {min(tables.bag_sizes)}..{max(tables.bag_sizes)}")
    else:
        sizes = (f"rows<={args.num_embeddings} dim={args.embedding_dim} mean L={args.bag_size} alpha={args.alpha}")
    print(f"tables={len(tables.bags)} {sizes} weights={args.weights} pooling={pooling} B={args.batch_size} sharding={args.sharding} "
          f"optimizer={args.optimizer} ids={args.index_dtype} options={options}"
          + (f" sequence_tables={len(tables.sequence)}" if tables.sequence else "")
          + (" vbe=variable batch per feature" if args.vbe else ""))
    placements = [f"{t}={ps.sharding_type}" + (f"@{ps.ranks}" if ps.ranks is not None else "")
                  for mp in plan.values() for t, ps in mp.items()]
    if len(placements) > 12:  # many tables: the count of each sharding type
        kinds = [ps.sharding_type for mp in plan.values() for ps in mp.values()]
        placements = [f"{k} x{kinds.count(k)}" for k in sorted(set(kinds))]
    print("plan: " + ", ".join(placements))
    head = (f"{'step':>4} {'loss fused':>11} {'loss triton':>11} {'max|dW|rel':>10} {'max|dS|rel':>10} "
            f"{'ms fused':>9} {'ms triton':>9}")
    print(head)
    print("-" * len(head), flush=True)
    rows: List[tuple] = []
    worst = 0.0
    # disable=None: the bar shows on a terminal and stays out of piped logs.
    if pipeline:
        pipes = [_pipeline(loop, m, o, setup.device) for m, o in ((fused, fused_opt), (ours, our_opt))]
        iters = [iter(_pipeline_batches(batches)) for _ in pipes]
        steps = [lambda k=k, m=m: _pipeline_step(pipes[k], iters[k], setup, m) for k, m in enumerate((fused, ours))]
    else:
        steps = [lambda k=k, m=m, o=o: _step(m, o, batches[step], setup)
                 for k, (m, o) in enumerate(((fused, fused_opt), (ours, our_opt)))]
    # disable unless rank 0 on a terminal: the bar stays out of piped logs and of other ranks'.
    bar = tqdm(range(len(batches)), desc="A/B steps", unit="step", leave=False,
               disable=None if setup.rank == 0 else True)
    for step in bar:
        loss_f, ms_f = steps[0]()
        loss_o, ms_o = steps[1]()
        # Every rank compares its own shards and its own batch's loss; the table shows the worst rank.
        d_w = setup.all_max(_max_rel_diff(_embedding_state(ours), _embedding_state(fused)))
        d_s = setup.all_max(_max_rel_diff(_optimizer_state(ours), _optimizer_state(fused)))
        d_l = setup.all_max(_inf_if_not_finite(abs(loss_o - loss_f) / (1.0 + abs(loss_f))))
        ms_f, ms_o = setup.all_max(ms_f), setup.all_max(ms_o)
        worst = max(worst, d_w, d_s, d_l)
        rows.append((ms_f, ms_o))
        if setup.rank == 0:
            tqdm.write(f"{step:>4} {loss_f:>11.6f} {loss_o:>11.6f} {d_w:>10.2e} {d_s:>10.2e} {ms_f:>9.1f} {ms_o:>9.1f}")
    bar.close()
    for line in _precompile_lines(ours):
        print(line)
    # Step 0 includes kernel compilation / interpreter warm-up; the median ignores stray slow steps.
    timed = rows[1:] or rows
    med_f = statistics.median(r[0] for r in timed)
    med_o = statistics.median(r[1] for r in timed)
    # Data parallel: every rank trains its own batch of args.batch_size per step.
    examples = args.batch_size * setup.world_size
    print(f"median ms/step after step 0 (slowest rank): fused {med_f:.1f}, triton {med_o:.1f}; "
          f"examples/s over {setup.world_size} rank(s): fused {examples * 1e3 / max(med_f, 1e-9):,.0f}, "
          f"triton {examples * 1e3 / max(med_o, 1e-9):,.0f}"
          + ("" if setup.gpu else "  (CPU: Triton's interpreter, not kernels)"))
    # The other direction of the checkpoint interchange: the trained Triton model's state into a fresh
    # fused model must be exact.
    back, _ = _dmp(tables, setup, _switch(plan, use_fused), sharders, dense_in, args.learning_rate, pipeline)
    result = back.load_state_dict(ours.state_dict())
    if result.missing_keys or result.unexpected_keys:
        raise RuntimeError(f"checkpoint interchange failed: {result}")
    back.fused_optimizer.load_state_dict(ours.fused_optimizer.state_dict())
    d_back = setup.all_max(max(_max_rel_diff(_embedding_state(back), _embedding_state(ours)),
                               _max_rel_diff(_optimizer_state(back), _optimizer_state(ours))))
    print(f"checkpoint fused -> triton (before step 0) and triton -> fused (now): largest difference {d_back:.1e}")
    ok = worst <= args.tolerance and d_back == 0.0
    if setup.replicas > 1:
        # Every rank matched fused's shards; the sync must also have left the replicas identical.
        split = [name for name, m in (("fused", fused), ("triton", ours)) if not _replicas_identical(m)]
        print(f"2D parallel: replicas after the last sync(): {'differ on ' + ', '.join(split) if split else 'bitwise identical'}")
        ok = ok and not split
    print(f"{'MATCH' if ok else 'MISMATCH'}: largest relative difference {worst:.2e} (tolerance {args.tolerance:.0e})")
    return 0 if ok else 1


if __name__ == "__main__":
    cli()
