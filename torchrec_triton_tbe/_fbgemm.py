"""FBGEMM's enums, re-used (never redefined), from the module paths shared by fbgemm_gpu 1.6-1.9.

Only enum types come from here; the kernel path (kernels/, ops/) never calls an FBGEMM operator.
"""

from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType  # noqa: F401
from fbgemm_gpu.split_table_batched_embeddings_ops_common import (  # noqa: F401
    BoundsCheckMode,
    CacheAlgorithm,
    ComputeDevice,
    EmbeddingLocation,
    PoolingMode,
)
from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode  # noqa: F401
# Optimizer configuration objects (defined in this module in 1.6, re-exported from it in 1.9).
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: F401,E402
    CounterBasedRegularizationDefinition,
    CowClipDefinition,
    GlobalWeightDecayDefinition,
    UserEnabledConfigDefinition,
)
