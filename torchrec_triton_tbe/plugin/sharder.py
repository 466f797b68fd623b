"""Public face of the TorchRec plugin: the sharder, the plan entry that carries our options, plan
rewriting for A/B runs against ``fused``, and the planner set-up.

* ``TritonTBEParameterSharding``: a ``ParameterSharding`` with ``compute_kernel="customized_kernel"``, the
  marker ``customized_compute_kernel="triton_tbe"`` and our options as fields; TorchRec passes them to
  the kernel through ``get_additional_fused_params()``. ``bounds_check_mode`` is TorchRec's own field.
* ``use_triton_tbe(plan, ...)`` / ``use_fused(plan, ...)``: the same plan with the kernel switched.
* ``TritonTBESharder`` / ``TritonTBEEmbeddingCollectionSharder``: TorchRec's ``EmbeddingBagCollection`` /
  ``EmbeddingCollection`` sharders that offer ``customized_kernel`` to the planner, upgrade the planner's
  plain ``ParameterSharding`` entries to ours, and build a sharded collection whose state_dict holds
  ShardedTensors for our tables as for ``fused`` ones. ``TritonTBEFeatureProcessedSharder``,
  ``TritonTBEManagedCollisionSharder``, ``TritonTBEManagedCollisionEmbeddingCollectionSharder``: TorchRec's
  ``FeatureProcessedEmbeddingBagCollection``, ``ManagedCollisionEmbeddingBagCollection`` and
  ``ManagedCollisionEmbeddingCollection`` sharders with ours inside.
  ``TritonTBEEmbeddingTowerSharder``, ``TritonTBEEmbeddingTowerCollectionSharder``: the same for TorchRec's
  ``EmbeddingTower`` and ``EmbeddingTowerCollection``.
* Planner set-up, on import: a bandwidth for ``customized_kernel`` (TorchRec's estimator has none and
  raises) and ``customized_kernel`` in the enumerator's guarded kernels, so the planner uses it only for
  tables whose ``ParameterConstraints.compute_kernels`` ask for it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterable, Optional, TypeVar, Union

import torch
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder, ShardedEmbeddingBagCollection
from torchrec.distributed.embedding_tower_sharding import EmbeddingTowerCollectionSharder, EmbeddingTowerSharder
from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.planner import enumerators as _enumerators
from torchrec.distributed.planner.constants import DDR_MEM_BW, HBM_MEM_BW
from torchrec.distributed.planner.estimator.config import EmbeddingPerfEstimatorConfig
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingEnv,
    ShardingEnv2D,
    ShardingPlan,
    ShardingStrategy,
    ShardingType,
)
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from torchrec_triton_tbe.config import KernelConfig
from torchrec_triton_tbe.plugin.options import MARKER, TritonTBEOptions, reject_plugin_keys
from torchrec_triton_tbe.plugin.sharding import SEQUENCE_SHARDING_TYPES, SUPPORTED_SHARDING_TYPES, building_our_lookups

CUSTOMIZED = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value
FUSED = EmbeddingComputeKernel.FUSED.value


# ---------------------------------------------------------------------------------------------- plan entries
@dataclasses.dataclass
class TritonTBEParameterSharding(ParameterSharding):
    """A plan entry selecting the Triton TBE kernel; the option fields are ``TritonTBEOptions``'s."""

    compute_kernel: str = CUSTOMIZED
    customized_compute_kernel: str = MARKER
    index_dtype: Optional[torch.dtype] = None
    fused_bounds_check: bool = False
    hoist_transpose: bool = False
    kernel_config: Union[str, KernelConfig, None] = None
    check_finite: bool = False
    precompile: bool = True

    def __post_init__(self) -> None:
        if self.compute_kernel != CUSTOMIZED:
            raise ValueError(
                f"TritonTBEParameterSharding needs compute_kernel={CUSTOMIZED!r}, got {self.compute_kernel!r}; "
                "use a plain ParameterSharding (or use_fused) for other kernels"
            )
        if self.customized_compute_kernel != MARKER:
            raise ValueError(f"TritonTBEParameterSharding.customized_compute_kernel must be {MARKER!r}")
        if self.sharding_type not in SUPPORTED_SHARDING_TYPES:
            raise NotImplementedError(
                f"Triton TBE kernel: sharding type {self.sharding_type!r} is not supported; "
                f"supported: {list(SUPPORTED_SHARDING_TYPES)}"
            )
        _ = self.options  # validates the option fields

    @property
    def options(self) -> TritonTBEOptions:
        return TritonTBEOptions(
            index_dtype=self.index_dtype,
            fused_bounds_check=self.fused_bounds_check,
            hoist_transpose=self.hoist_transpose,
            kernel_config=self.kernel_config,
            check_finite=self.check_finite,
            precompile=self.precompile,
        )

    def get_additional_fused_params(self) -> Dict[str, Any]:
        # TorchRec's hook (torchrec/distributed/utils.py, add_params_from_parameter_sharding), called for
        # CUSTOMIZED_KERNEL entries only.
        return self.options.to_fused_params()

    @classmethod
    def from_sharding(cls, sharding: ParameterSharding, options: TritonTBEOptions) -> "TritonTBEParameterSharding":
        base = {f.name: getattr(sharding, f.name) for f in dataclasses.fields(ParameterSharding)}
        base["compute_kernel"] = CUSTOMIZED
        # Not dataclasses.asdict: it would turn a KernelConfig into a dict.
        return cls(**base, **{f.name: getattr(options, f.name) for f in dataclasses.fields(options)})


def _plain(sharding: ParameterSharding, compute_kernel: str) -> ParameterSharding:
    base = {f.name: getattr(sharding, f.name) for f in dataclasses.fields(ParameterSharding)}
    base["compute_kernel"] = compute_kernel
    return ParameterSharding(**base)


def is_triton_tbe_sharding(sharding: ParameterSharding) -> bool:
    return isinstance(sharding, TritonTBEParameterSharding) and sharding.customized_compute_kernel == MARKER


# ---------------------------------------------------------------------------------------------- plan rewriting
Plan = TypeVar("Plan", ShardingPlan, EmbeddingModuleShardingPlan)


def use_triton_tbe(
    plan: Plan, tables: Optional[Iterable[str]] = None, options: TritonTBEOptions = TritonTBEOptions()
) -> Plan:
    """The same plan with ``tables`` (default: every model-parallel table) on the Triton TBE kernel.

    Works on a planner's output or a hand-written plan; placements and shards are kept. Data-parallel
    tables cannot use the kernel (asking for one by name is an error)."""
    return _rewrite(plan, tables, lambda ps: TritonTBEParameterSharding.from_sharding(ps, options))


def use_fused(plan: Plan, tables: Optional[Iterable[str]] = None) -> Plan:
    """The same plan with ``tables`` (default: every model-parallel table) on FBGEMM's ``fused`` kernel.

    Triton-only options are dropped; ``bounds_check_mode`` and the other TorchRec fields are kept."""
    return _rewrite(plan, tables, lambda ps: _plain(ps, FUSED))


def _rewrite(plan, tables, convert):
    wanted = None if tables is None else set(tables)
    module_plans = plan.plan if isinstance(plan, ShardingPlan) else {"": plan}
    known = {t for mp in module_plans.values() if isinstance(mp, EmbeddingModuleShardingPlan) for t in mp}
    if wanted is not None and not wanted <= known:
        raise KeyError(f"tables {sorted(wanted - known)} are not in the plan")
    rewritten = {
        path: _rewrite_module(mp, wanted, convert) if isinstance(mp, EmbeddingModuleShardingPlan) else mp
        for path, mp in module_plans.items()
    }
    return ShardingPlan(rewritten) if isinstance(plan, ShardingPlan) else rewritten[""]


def _rewrite_module(module_plan: EmbeddingModuleShardingPlan, wanted, convert) -> EmbeddingModuleShardingPlan:
    out = type(module_plan)()
    for table, ps in module_plan.items():
        if wanted is None:
            # Data-parallel tables keep TorchRec's dense kernel.
            selected = ps.sharding_type != ShardingType.DATA_PARALLEL.value
        else:
            selected = table in wanted
        out[table] = convert(ps) if selected else ps
    return out


# ---------------------------------------------------------------------------------------------- sharded modules
class _RelabelOurTables:
    """TorchRec's sharded collections skip CUSTOMIZED_KERNEL tables in ``_initialize_torch_state``
    ("implemented in child class"): they would get no ShardedTensor in ``state_dict()`` (so no
    multi-rank checkpoint layout), and a rank holding no shard of one would register no ``weight``
    (``reset_parameters()`` then fails). Our kernels provide everything the fused path reads
    (``state_dict`` through TorchRec's ``get_state_dict``, ``named_parameters_by_table``), so our tables
    are labelled ``fused`` while the stock method runs, and restored afterwards."""

    def _create_lookups(self, *args, **kwargs):
        # Our kernels are built only here (sharding._ours refuses them in a collection of TorchRec's).
        with building_our_lookups():
            return super()._create_lookups(*args, **kwargs)

    def _initialize_torch_state(self, *args, **kwargs) -> None:
        # Arguments passed through as given: TorchRec 1.9's methods take ``skip_registering``, 1.6.1's
        # ShardedEmbeddingCollection takes none.
        ours = {t: ps for t, ps in self.module_sharding_plan.items() if is_triton_tbe_sharding(ps)}
        for table, ps in ours.items():
            self.module_sharding_plan[table] = _plain(ps, FUSED)
        try:
            super()._initialize_torch_state(*args, **kwargs)
        finally:
            self.module_sharding_plan.update(ours)


class TritonTBEShardedEmbeddingBagCollection(_RelabelOurTables, ShardedEmbeddingBagCollection):
    """TorchRec's sharded ``EmbeddingBagCollection``, with our tables' state built like ``fused`` tables'."""


class TritonTBEShardedEmbeddingCollection(_RelabelOurTables, ShardedEmbeddingCollection):
    """TorchRec's sharded ``EmbeddingCollection`` (sequence), with our tables' state built like ``fused``
    tables'."""


# ---------------------------------------------------------------------------------------------- sharders
class _OurKernelSharder:
    """What both sharders add to TorchRec's: ``customized_kernel`` offered to the planner for the sharding
    types we implement, plain ``ParameterSharding(compute_kernel="customized_kernel")`` entries (the
    planner's output, or ``table_wise(rank, compute_kernel="customized_kernel")`` plans) upgraded to ours
    with the sharder's ``options`` (entries already of type ``TritonTBEParameterSharding`` keep theirs),
    and 2D parallel's FULLY_SHARDED strategy refused."""

    options: TritonTBEOptions
    sharding_types_ours: tuple = SUPPORTED_SHARDING_TYPES

    def _init_options(self, fused_params: Optional[Dict[str, Any]], options: TritonTBEOptions) -> None:
        reject_plugin_keys(fused_params, type(self).__name__)
        if not isinstance(options, TritonTBEOptions):
            raise TypeError(f"{type(self).__name__}(options=...) takes a TritonTBEOptions, got {type(options).__name__}")
        self.options = options

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list:
        kernels = list(super().compute_kernels(sharding_type, compute_device_type))
        if sharding_type in self.sharding_types_ours:
            kernels.append(CUSTOMIZED)  # guarded: the planner takes it only where constraints ask
        return kernels

    def _our_params(self, params: Dict[str, ParameterSharding], env: ShardingEnv) -> Dict[str, ParameterSharding]:
        params = {table: self._upgrade(table, ps) for table, ps in params.items()}
        strategy = getattr(env, "sharding_strategy", None)
        if isinstance(env, ShardingEnv2D) and strategy == ShardingStrategy.FULLY_SHARDED:
            ours = sorted(table for table, ps in params.items() if is_triton_tbe_sharding(ps))
            if ours:
                # FULLY_SHARDED swaps in TorchRec's own reduce-scatter kernel class for FBGEMM tables;
                # ours would keep full replicas without the forward's weight sync.
                raise NotImplementedError(
                    f"Triton TBE kernel: tables {ours}: DMPCollection's ShardingStrategy.FULLY_SHARDED is not "
                    "supported (DEFAULT and PER_MODULE are: replicas sync in DMPCollection.sync(), plugin/two_d.py)"
                )
        return params

    def _upgrade(self, table: str, ps: ParameterSharding,
                 options: Optional[TritonTBEOptions] = None) -> ParameterSharding:
        if ps.compute_kernel != CUSTOMIZED or isinstance(ps, TritonTBEParameterSharding):
            return ps
        if hasattr(ps, "get_additional_fused_params"):
            return ps  # another plugin's customized kernel: route it untouched
        if ps.sharding_type not in self.sharding_types_ours:
            raise NotImplementedError(
                f"Triton TBE kernel: table {table!r} is planned with sharding type {ps.sharding_type!r}; "
                f"supported: {list(self.sharding_types_ours)}"
            )
        return TritonTBEParameterSharding.from_sharding(ps, self.options if options is None else options)

    def _resharding_params(self, sharded_module: nn.Module, changed: EmbeddingModuleShardingPlan,
                           env: ShardingEnv) -> EmbeddingModuleShardingPlan:
        """The delta plan of ``DistributedModelParallel.reshard`` with its plain ``customized_kernel`` entries
        (a hand-made delta's, or ``output_sharding_plan_delta``'s from a plain plan) upgraded to ours with
        their table's options. Without it TorchRec's ``update_shards`` would install plain entries, which
        ``_initialize_torch_state`` and the lookups do not take for ours. Resharding moves shards and keeps
        what TorchRec derived from the first sharding (the kernel and its parameters), so a delta that names
        a table the module does not have, moves a table onto or off our kernel, or gives one of ours other
        options is refused before anything moves."""
        before = sharded_module.module_sharding_plan
        unknown = sorted(set(changed) - set(before))
        if unknown:
            raise KeyError(f"Triton TBE kernel: the resharding delta names tables {unknown} that this module does not "
                           f"have ({sorted(before)})")
        out = type(changed)()
        for table, ps in changed.items():
            old = before[table]
            was_ours = is_triton_tbe_sharding(old)
            out[table] = self._upgrade(table, ps, old.options if was_ours else None)
            if was_ours != is_triton_tbe_sharding(out[table]):
                raise NotImplementedError(
                    f"Triton TBE kernel: resharding table {table!r} from compute kernel {old.compute_kernel!r} to "
                    f"{ps.compute_kernel!r}: reshard moves shards and keeps each table's kernel; to change kernels, "
                    "load a checkpoint into a model planned with use_triton_tbe / use_fused (docs/torchrec.md)"
                )
            if was_ours and out[table].options != old.options:
                raise NotImplementedError(
                    f"Triton TBE kernel: resharding table {table!r} with options {out[table].options} (planned with "
                    f"{old.options}): reshard keeps the kernel TorchRec built with the first options; give the "
                    "delta plain entries or the table's own options"
                )
        self._our_params(dict(out), env)  # the same refusals as shard()'s
        return out


class TritonTBESharder(_OurKernelSharder, EmbeddingBagCollectionSharder):
    """Shards ``EmbeddingBagCollection``s; tables planned with ``customized_kernel`` use the Triton kernel.

    ``fused_params`` are the usual sharder-wide FBGEMM keywords (optimizer, learning_rate, eps,
    embedding_table_index_type, ...) shared by ``fused`` and Triton tables; ``options`` are applied to
    plain ``ParameterSharding(compute_kernel="customized_kernel")`` entries (see ``_OurKernelSharder``).
    """

    def __init__(
        self,
        fused_params: Optional[Dict[str, Any]] = None,
        qcomm_codecs_registry: Optional[Dict[str, Any]] = None,
        options: TritonTBEOptions = TritonTBEOptions(),
    ) -> None:
        self._init_options(fused_params, options)
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry)

    def shardable_parameters(self, module: EmbeddingBagCollection) -> Dict[str, nn.Parameter]:
        _require(module, EmbeddingBagCollection, "TritonTBEEmbeddingCollectionSharder")
        return super().shardable_parameters(module)

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: Dict[str, ParameterSharding],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        module_fqn: Optional[str] = None,
    ) -> ShardedEmbeddingBagCollection:
        _require(module, EmbeddingBagCollection, "TritonTBEEmbeddingCollectionSharder")
        return TritonTBEShardedEmbeddingBagCollection(
            module=module,
            table_name_to_parameter_sharding=self._our_params(params, env),
            env=env,
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
            sharded_module_order_overwrite=self._sharded_module_order_overwrite,
        )

    def reshard(
        self,
        sharded_module: ShardedEmbeddingBagCollection,
        changed_shard_to_params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: Optional[torch.device] = None,
    ) -> ShardedEmbeddingBagCollection:
        """TorchRec's dynamic resharding (``DistributedModelParallel.reshard``), with the delta's plain
        ``customized_kernel`` entries upgraded to ours first (``_resharding_params``)."""
        changed = self._resharding_params(sharded_module, changed_shard_to_params, env)
        return super().reshard(sharded_module, changed, env, device)

    @property
    def sharded_module_type(self) -> type:
        return TritonTBEShardedEmbeddingBagCollection


class TritonTBEEmbeddingCollectionSharder(_OurKernelSharder, EmbeddingCollectionSharder):
    """Shards ``EmbeddingCollection``s (sequence embeddings); tables planned with ``customized_kernel``
    use the Triton kernel with ``PoolingMode.NONE``. Arguments as TorchRec's
    ``EmbeddingCollectionSharder`` plus ``options``; sharding types: table-, row- and column-wise (all
    that TorchRec shards an ``EmbeddingCollection`` with, data-parallel aside)."""

    sharding_types_ours = SEQUENCE_SHARDING_TYPES

    def __init__(
        self,
        fused_params: Optional[Dict[str, Any]] = None,
        qcomm_codecs_registry: Optional[Dict[str, Any]] = None,
        use_index_dedup: bool = False,
        options: TritonTBEOptions = TritonTBEOptions(),
    ) -> None:
        self._init_options(fused_params, options)
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry,
                         use_index_dedup=use_index_dedup)

    def shardable_parameters(self, module: EmbeddingCollection) -> Dict[str, nn.Parameter]:
        _require(module, EmbeddingCollection, "TritonTBESharder")
        return super().shardable_parameters(module)

    def shard(
        self,
        module: EmbeddingCollection,
        params: Dict[str, ParameterSharding],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        module_fqn: Optional[str] = None,
    ) -> ShardedEmbeddingCollection:
        _require(module, EmbeddingCollection, "TritonTBESharder")
        return TritonTBEShardedEmbeddingCollection(
            module,
            self._our_params(params, env),
            env,
            self.fused_params,
            device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            use_index_dedup=self._use_index_dedup,
            module_fqn=module_fqn,
        )

    @property
    def sharded_module_type(self) -> type:
        return TritonTBEShardedEmbeddingCollection


class TritonTBEFeatureProcessedSharder(FeatureProcessedEmbeddingBagCollectionSharder):
    """Shards ``FeatureProcessedEmbeddingBagCollection``s (an ``EmbeddingBagCollection`` behind feature
    processors, e.g. ``PositionWeightedModuleCollection``): TorchRec's own sharder around a
    ``TritonTBESharder`` for the inner collection, so its tables planned with ``customized_kernel`` run
    on our kernel as weighted bags, and the processors' learnable weights get their gradient from our
    backward. Same as ``FeatureProcessedEmbeddingBagCollectionSharder(ebc_sharder=TritonTBESharder(...))``,
    plus ``customized_kernel`` offered to the planner (TorchRec's class offers its base kernels only)."""

    def __init__(
        self,
        fused_params: Optional[Dict[str, Any]] = None,
        qcomm_codecs_registry: Optional[Dict[str, Any]] = None,
        options: TritonTBEOptions = TritonTBEOptions(),
    ) -> None:
        super().__init__(
            ebc_sharder=TritonTBESharder(fused_params, qcomm_codecs_registry, options=options),
            qcomm_codecs_registry=qcomm_codecs_registry,
        )

    @property
    def options(self) -> TritonTBEOptions:
        return self._ebc_sharder.options

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list:
        return self._ebc_sharder.compute_kernels(sharding_type, compute_device_type)


class _ManagedCollisionOurs:
    """What both managed-collision sharders add to TorchRec's: our sharder for the inner collection
    (``_inner``, passed as TorchRec's ``_inner_keyword``) and ``customized_kernel`` offered to the
    planner, which TorchRec's classes leave out (they list FBGEMM's kernels only)."""

    _inner: type
    _inner_keyword: str

    def __init__(
        self,
        fused_params: Optional[Dict[str, Any]] = None,
        qcomm_codecs_registry: Optional[Dict[str, Any]] = None,
        options: TritonTBEOptions = TritonTBEOptions(),
        mc_sharder: Optional[Any] = None,
    ) -> None:
        inner = self._inner(fused_params, qcomm_codecs_registry, options=options)
        super().__init__(**{self._inner_keyword: inner}, mc_sharder=mc_sharder,
                         qcomm_codecs_registry=qcomm_codecs_registry)

    @property
    def options(self) -> TritonTBEOptions:
        return self._e_sharder.options

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list:
        kernels = list(super().compute_kernels(sharding_type, compute_device_type))
        if CUSTOMIZED in self._e_sharder.compute_kernels(sharding_type, compute_device_type):
            kernels.append(CUSTOMIZED)
        return kernels


class TritonTBEManagedCollisionSharder(_ManagedCollisionOurs, ManagedCollisionEmbeddingBagCollectionSharder):
    """Shards ``ManagedCollisionEmbeddingBagCollection``s (zero-collision hashing: raw ids remapped to
    table rows, evicted rows reset and re-initialised): TorchRec's own sharder around a
    ``TritonTBESharder``, so the inner tables planned with ``customized_kernel`` run on our kernel and
    TorchRec's eviction reaches ``TritonTBE.reset_embedding_weight_momentum`` (FBGEMM's reset).
    Arguments: ``fused_params``, ``qcomm_codecs_registry``, ``options`` (ours), ``mc_sharder`` (TorchRec's)."""

    _inner = TritonTBESharder
    _inner_keyword = "ebc_sharder"


class TritonTBEManagedCollisionEmbeddingCollectionSharder(
    _ManagedCollisionOurs, ManagedCollisionEmbeddingCollectionSharder
):
    """The same for ``ManagedCollisionEmbeddingCollection``s (sequence tables behind zero-collision
    hashing), around a ``TritonTBEEmbeddingCollectionSharder``."""

    _inner = TritonTBEEmbeddingCollectionSharder
    _inner_keyword = "ec_sharder"


class TritonTBEEmbeddingTowerSharder(_OurKernelSharder, EmbeddingTowerSharder):
    """Shards TorchRec's ``EmbeddingTower`` (an embedding collection and its interaction, placed together on one
    host: table-row- or table-column-wise): TorchRec's own sharder, with our sharder for the tower's
    ``EmbeddingBagCollection`` or ``EmbeddingCollection`` where TorchRec's builds its stock ones, and
    ``customized_kernel`` offered to the planner. Arguments: ``fused_params``, ``qcomm_codecs_registry``,
    ``options`` (ours)."""

    def __init__(
        self,
        fused_params: Optional[Dict[str, Any]] = None,
        qcomm_codecs_registry: Optional[Dict[str, Any]] = None,
        options: TritonTBEOptions = TritonTBEOptions(),
    ) -> None:
        self._init_options(fused_params, options)
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry)

    def embedding_sharder(self, module: nn.Module) -> Any:
        embedding = module.embedding
        args = dict(fused_params=self.fused_params, qcomm_codecs_registry=self.qcomm_codecs_registry,
                    options=self.options)
        if isinstance(embedding, EmbeddingBagCollection):
            return TritonTBESharder(**args)
        if isinstance(embedding, EmbeddingCollection):
            return TritonTBEEmbeddingCollectionSharder(**args)
        return super().embedding_sharder(module)  # TorchRec's error for anything else


class TritonTBEEmbeddingTowerCollectionSharder(EmbeddingTowerCollectionSharder):
    """Shards TorchRec's ``EmbeddingTowerCollection``: TorchRec's own sharder around a
    ``TritonTBEEmbeddingTowerSharder`` for its towers."""

    def __init__(
        self,
        fused_params: Optional[Dict[str, Any]] = None,
        qcomm_codecs_registry: Optional[Dict[str, Any]] = None,
        options: TritonTBEOptions = TritonTBEOptions(),
    ) -> None:
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry)
        self._tower_sharder = TritonTBEEmbeddingTowerSharder(self.fused_params, qcomm_codecs_registry, options)

    @property
    def options(self) -> TritonTBEOptions:
        return self._tower_sharder.options

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list:
        return self._tower_sharder.compute_kernels(sharding_type, compute_device_type)


def _require(module: nn.Module, kind: type, other: str) -> None:
    if not isinstance(module, kind):
        raise TypeError(f"this sharder shards {kind.__name__}s, got a {type(module).__name__}; use {other} for it")


# ---------------------------------------------------------------------------------------------- planner set-up
def install_planner_support() -> None:
    """Idempotent; run on import.

    Bandwidth: the default estimator config (torchrec 1.6.1 and 1.9.2 alike) raises for a kernel it
    has no bandwidth for; ours gets the bandwidth TorchRec gives ``fused`` on default hardware (HBM on
    cuda, DDR on cpu), so the planner selects it without preferring it. The dict is copied onto the
    default config class: the base class's dict is shared by every registered config.

    Guarding: without it the planner would pick ``customized_kernel`` for tables nobody asked for,
    with plain entries that carry no options; guarded kernels are used only when a table's
    ``ParameterConstraints.compute_kernels`` lists them."""
    _enumerators.GUARDED_COMPUTE_KERNELS.add(EmbeddingComputeKernel.CUSTOMIZED_KERNEL)
    bandwidths = dict(EmbeddingPerfEstimatorConfig.kernel_device_bandwidths)
    bandwidths.setdefault(("cuda", CUSTOMIZED), HBM_MEM_BW)
    bandwidths.setdefault(("cpu", CUSTOMIZED), DDR_MEM_BW)
    EmbeddingPerfEstimatorConfig.kernel_device_bandwidths = bandwidths


install_planner_support()
