"""Plan generators for the two sharding types TorchRec's ``sharding_plan`` helpers cannot write for
narrow tables, in the form ``construct_module_sharding_plan`` takes (``ParameterShardingGenerator``).

* ``table_column_wise``: TorchRec has no generator for TABLE_COLUMN_WISE (its planner proposes it).
  This is ``column_wise(ranks=...)``'s layout under the TABLE_COLUMN_WISE type: the column shards of a
  table on ranks of one host, as the planner lays them out.
* ``grid_shard``: TorchRec's ``grid_shard(host_indexes)`` keeps the default column block (at least
  128 columns), so a table of 128 columns or fewer gets one block. This one splits a table into
  ``blocks`` column blocks, block h row-wise over the ranks of host h (wrapping round the world on
  fewer hosts), through the same TorchRec functions ``grid_shard`` uses (``_get_parameter_size_offsets``,
  ``_get_parameter_sharding``: same signatures in torchrec 1.6.1 and 1.9.2).

Either plans ``fused`` tables as well as ours (``use_triton_tbe`` / ``use_fused`` switch the kernel).
"""

from __future__ import annotations

import dataclasses
from typing import List

from torchrec.distributed import sharding_plan as _sp
from torchrec.distributed.types import ShardingType


def table_column_wise(ranks: List[int]):
    """TABLE_COLUMN_WISE: the table's columns split evenly over ``ranks`` (one host's)."""
    column_wise = _sp.column_wise(ranks=ranks)

    def generate(*args, **kwargs):
        return dataclasses.replace(column_wise(*args, **kwargs), sharding_type=ShardingType.TABLE_COLUMN_WISE.value)

    return generate


def grid_shard(blocks: int = 2):
    """GRID_SHARD with ``blocks`` column blocks of equal width (the width must keep FBGEMM's multiple of
    4), block h row-wise over the ``local_size`` ranks of host h modulo the world."""
    if blocks < 1:
        raise ValueError(f"grid_shard: blocks must be >= 1, got {blocks}")

    def generate(param, local_size, world_size, device_type, sharder):
        width = param.shape[1] // blocks
        if width * blocks != param.shape[1] or width % 4:
            raise ValueError(f"grid_shard: {param.shape[1]} columns do not split into {blocks} blocks of a "
                             "multiple of 4 columns")
        shards = _sp._get_parameter_size_offsets(param, ShardingType.GRID_SHARD, local_size, world_size,
                                                 col_wise_shard_dim=width)
        ranks = [i % world_size for i in range(len(shards))]  # block h's row shards: host h's ranks
        return _sp._get_parameter_sharding(param, ShardingType.GRID_SHARD.value,
                                           [(size, offset, rank) for (size, offset), rank in zip(shards, ranks)],
                                           local_size, device_type, sharder)

    return generate
