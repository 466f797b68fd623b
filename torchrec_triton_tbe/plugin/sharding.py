"""Routing: TorchRec's ``CUSTOMIZED_KERNEL`` with our marker builds ``TritonTBEEmbeddingBag``.

TorchRec has no kernel registry: ``GroupedPooledEmbeddingsLookup._create_embedding_kernel`` builds one
kernel per grouped table config and raises ``ValueError`` for ``CUSTOMIZED_KERNEL``. We wrap that method
(option A of the integration notes) rather than subclassing every sharding type (option B):

* one wrapper covers table-wise, row-wise, column-wise, table-row-wise, table-column-wise and grid
  sharding, since each of them builds the same lookup class; option B needs a subclass per sharding
  type overriding ``create_lookup``, whose bodies differ between torchrec 1.6.1 and 1.9.2 (row-wise
  alone differs by ~230 lines), so copies of them would be the fragile part;
* the wrapped method has the same signature in 1.6.1 and 1.9.2 (``config, device, pg, sharding_type,
  env``), and TorchRec calls it positionally in both;
* the wrapper only acts on ``CUSTOMIZED_KERNEL`` groups carrying ``customized_compute_kernel="triton_tbe"``
  (which TorchRec would reject anyway) and delegates everything else, other plugins' customized kernels
  included, to the original method;
* it builds our kernels only for our sharded collections (``building_our_lookups``), and refuses them in
  TorchRec's own, which would leave their tables without TorchRec's state.

The cost is a process-wide change at import of ``torchrec_triton_tbe.plugin``; ``install()`` is
idempotent and ``installed()`` reports it. The sequence lookup (``EmbeddingCollection``,
``GroupedEmbeddingsLookup``) is wrapped the same way and builds ``TritonTBEEmbedding``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup, GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.distributed.types import ShardingEnv, ShardingType

from torchrec_triton_tbe.plugin.lookup import TritonTBEEmbedding, TritonTBEEmbeddingBag
from torchrec_triton_tbe.plugin.options import is_triton_tbe

_PATCHED = "_triton_tbe_routing"

SUPPORTED_SHARDING_TYPES = (
    ShardingType.TABLE_WISE.value,
    ShardingType.ROW_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_ROW_WISE.value,
    ShardingType.TABLE_COLUMN_WISE.value,
    ShardingType.GRID_SHARD.value,
)

# TorchRec shards an EmbeddingCollection table-, row- or column-wise (or data-parallel).
SEQUENCE_SHARDING_TYPES = (
    ShardingType.TABLE_WISE.value,
    ShardingType.ROW_WISE.value,
    ShardingType.COLUMN_WISE.value,
)


def _ours(config: GroupedEmbeddingConfig) -> bool:
    if not (config.compute_kernel == EmbeddingComputeKernel.CUSTOMIZED_KERNEL and is_triton_tbe(config.fused_params)):
        return False
    if not _BUILDING_OURS.get():
        # TorchRec's own sharded collection would run our kernel but build no state for its tables
        # (no ShardedTensor in state_dict, no weight on a rank without a shard): a plan switched with
        # use_triton_tbe, given to DistributedModelParallel with TorchRec's sharders (or ours listed before
        # TorchRec's for the same module type: a later sharder of a type replaces an earlier one).
        tables = [t.name for t in config.embedding_tables]
        raise ValueError(
            f"tables {tables} are planned on the Triton TBE kernel, but their collection is being sharded by a "
            "sharder that is not this plugin's: pass torchrec_triton_tbe.plugin's sharder for it "
            "(TritonTBESharder for an EmbeddingBagCollection, TritonTBEEmbeddingCollectionSharder, "
            "TritonTBEFeatureProcessedSharder, TritonTBEManagedCollisionSharder, "
            "TritonTBEManagedCollisionEmbeddingCollectionSharder, TritonTBEEmbeddingTowerSharder or "
            "TritonTBEEmbeddingTowerCollectionSharder) in DistributedModelParallel's sharders, "
            "and no other sharder for the same module type after it"
        )
    return True


# Set while one of our sharded collections builds its lookups (sharder._RelabelOurTables).
_BUILDING_OURS: contextvars.ContextVar[bool] = contextvars.ContextVar("triton_tbe_building_ours", default=False)


@contextlib.contextmanager
def building_our_lookups() -> Iterator[None]:
    token = _BUILDING_OURS.set(True)
    try:
        yield
    finally:
        _BUILDING_OURS.reset(token)


def _wrap_pooled(original):
    @functools.wraps(original)
    def _create_embedding_kernel(
        self,
        config: GroupedEmbeddingConfig,
        device: Optional[torch.device],
        pg: Optional[dist.ProcessGroup],
        sharding_type: Optional[ShardingType],
        env: Optional[ShardingEnv] = None,
    ):
        if not _ours(config):
            return original(self, config, device, pg, sharding_type, env)
        # Sharding types are validated with the plan (TritonTBEParameterSharding, TritonTBESharder.shard):
        # lookups cannot tell them apart (grid sharding passes TABLE_ROW_WISE, TW and CW pass none).
        return TritonTBEEmbeddingBag(config=config, pg=pg, device=device, sharding_type=sharding_type, env=env)

    setattr(_create_embedding_kernel, _PATCHED, original)
    return _create_embedding_kernel


def _wrap_sequence(original):
    @functools.wraps(original)
    def _create_embedding_kernel(self, config, pg, device, env=None):
        # TorchRec 1.6.1 and 1.9.2 call it (config, pg, device[, env]); the pooled lookup's order differs.
        if not _ours(config):
            return original(self, config, pg, device, env)
        return TritonTBEEmbedding(config=config, pg=pg, device=device)

    setattr(_create_embedding_kernel, _PATCHED, original)
    return _create_embedding_kernel


_TARGETS = ((GroupedPooledEmbeddingsLookup, _wrap_pooled), (GroupedEmbeddingsLookup, _wrap_sequence))


def install() -> None:
    """Wraps both lookups' ``_create_embedding_kernel`` once (re-imports and repeated calls are no-ops)."""
    for cls, wrap in _TARGETS:
        current = cls.__dict__["_create_embedding_kernel"]
        if not hasattr(current, _PATCHED):
            cls._create_embedding_kernel = wrap(current)


def installed() -> bool:
    return all(hasattr(cls.__dict__["_create_embedding_kernel"], _PATCHED) for cls, _ in _TARGETS)


install()
