"""TorchRec plugin: select the Triton TBE kernel per table in a sharding plan.

    from torchrec_triton_tbe.plugin import TritonTBESharder, TritonTBEOptions, use_triton_tbe, use_fused

Importing this package wraps TorchRec's lookup kernel factory (see ``sharding``) and DMPCollection's
replica-sync tensor cache (see ``two_d``), and registers the planner's bandwidth and guard for
``customized_kernel`` (see ``sharder``). Nothing changes for tables
whose plan entry does not ask for ``customized_kernel`` with ``customized_compute_kernel="triton_tbe"``.
"""

# First: on a machine without CUDA, a wrong import order fails here (torchrec_triton_tbe._env), with the fix.
from torchrec_triton_tbe import _env  # noqa: F401
from torchrec_triton_tbe.plugin.lookup import TritonTBEEmbedding, TritonTBEEmbeddingBag
from torchrec_triton_tbe.plugin.options import MARKER, TritonTBEOptions
from torchrec_triton_tbe.plugin.plans import grid_shard, table_column_wise
from torchrec_triton_tbe.plugin.sharder import (
    TritonTBEEmbeddingCollectionSharder,
    TritonTBEEmbeddingTowerCollectionSharder,
    TritonTBEEmbeddingTowerSharder,
    TritonTBEFeatureProcessedSharder,
    TritonTBEManagedCollisionEmbeddingCollectionSharder,
    TritonTBEManagedCollisionSharder,
    TritonTBEParameterSharding,
    TritonTBESharder,
    TritonTBEShardedEmbeddingBagCollection,
    TritonTBEShardedEmbeddingCollection,
    install_planner_support,
    use_fused,
    use_triton_tbe,
)
from torchrec_triton_tbe.plugin.sharding import SEQUENCE_SHARDING_TYPES, SUPPORTED_SHARDING_TYPES, install
from torchrec_triton_tbe.plugin import two_d  # noqa: F401  (DMPCollection's replica sync covers our tables)
from torchrec_triton_tbe.plugin.two_d import triton_tbe_modules

__all__ = [
    "MARKER",
    "SEQUENCE_SHARDING_TYPES",
    "SUPPORTED_SHARDING_TYPES",
    "TritonTBEEmbedding",
    "TritonTBEEmbeddingBag",
    "TritonTBEEmbeddingCollectionSharder",
    "TritonTBEEmbeddingTowerCollectionSharder",
    "TritonTBEEmbeddingTowerSharder",
    "TritonTBEFeatureProcessedSharder",
    "TritonTBEManagedCollisionEmbeddingCollectionSharder",
    "TritonTBEManagedCollisionSharder",
    "TritonTBEOptions",
    "TritonTBEParameterSharding",
    "TritonTBESharder",
    "TritonTBEShardedEmbeddingBagCollection",
    "TritonTBEShardedEmbeddingCollection",
    "grid_shard",
    "install",
    "install_planner_support",
    "table_column_wise",
    "triton_tbe_modules",
    "use_fused",
    "use_triton_tbe",
]
