"""The TorchRec compute kernels backed by ``TritonTBE``: one instance per grouped table config, pooled
(``EmbeddingBagCollection``) or sequence (``EmbeddingCollection``).

Mirrors TorchRec's ``BatchedFusedEmbeddingBag`` (the ``fused`` kernel) member for member where TorchRec
looks: the same constructor arguments reach the module, ``state_dict`` keys are ``<table>.weight``,
``named_parameters_by_table`` yields storage-sharing slices, and the optimizer is TorchRec's own
``EmbeddingFusedOptimizer`` over the module's FBGEMM-compatible state API, so checkpoints and
``DistributedModelParallel.fused_optimizer`` look exactly as with ``fused``.
"""

from __future__ import annotations

from typing import Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.batched_embedding_kernel import (
    BaseBatchedEmbedding,
    BaseBatchedEmbeddingBag,
    EmbeddingFusedOptimizer,
)
from torchrec.distributed.composable.table_batched_embedding_slice import TableBatchedEmbeddingSlice
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import data_type_to_sparse_type
from torchrec.optim.fused import EmptyFusedOptimizer, FusedOptimizer, FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_triton_tbe._fbgemm import PoolingMode
from torchrec_triton_tbe.module import TritonTBE
from torchrec_triton_tbe.plugin.options import TritonTBEOptions


def _build_module(kernel, config: GroupedEmbeddingConfig, device, pg, pooling_mode) -> None:
    """What both kernel classes do after TorchRec's base __init__ (which reads the index / offset dtypes
    and, pooled, the pooling from config; it never mutates config.fused_params): our options out of the
    fused_params, the module on the group's tables, TorchRec's own fused optimizer over it, init."""
    fused_params = dict(config.fused_params or {})  # a copy: TorchRec keeps using the original
    kernel.options = TritonTBEOptions.pop_from(fused_params)
    kernel._emb_module = TritonTBE(
        list(zip(kernel._local_rows, kernel._local_cols)),
        feature_table_map=kernel._feature_table_map,
        pooling_mode=pooling_mode,
        weights_precision=data_type_to_sparse_type(config.data_type),
        device=device,
        table_names=[t.name for t in config.embedding_tables],
        embedding_shard_info=list(
            zip(kernel._num_embeddings, kernel._embedding_dims, kernel._row_offset, kernel._col_offset)
        ),
        kernel_config=kernel.options.kernel_config,
        fused_bounds_check=kernel.options.fused_bounds_check,
        hoist_transpose=kernel.options.hoist_transpose,
        **fused_params,
    )
    kernel._emb_module.check_finite = kernel.options.check_finite
    kernel._emb_module.precompile_first_step = kernel.options.precompile
    if kernel.options.precompile:
        # Their start-up then overlaps the rest of the model's construction and the first batch's
        # preparation instead of the first step.
        kernel._emb_module.start_precompile_workers()
    kernel._optim = EmbeddingFusedOptimizer(config, kernel._emb_module, pg)
    kernel.init_parameters()


class _TritonTBEKernel(FusedOptimizerModule):
    """What TorchRec reads from a fused kernel, shared by the pooled and the sequence class: the module,
    its fused optimizer, storage-sharing per-table slices, parameters marked as optimized in backward."""

    options: TritonTBEOptions
    _emb_module: TritonTBE

    @property
    def emb_module(self) -> TritonTBE:  # type: ignore[override]
        return self._emb_module

    @property
    def fused_optimizer(self) -> FusedOptimizer:
        return self._optim

    @property
    def _param_per_table(self) -> Dict[str, TableBatchedEmbeddingSlice]:  # type: ignore[override]
        # Rebuilt on each access, as TorchRec's fused kernel does: a slice must view the module's
        # current flat buffer, which nn.Module._apply (e.g. .to()) may have replaced.
        return dict(self._slices_by_table())

    @_param_per_table.setter
    def _param_per_table(self, value: Dict[str, TableBatchedEmbeddingSlice]) -> None:
        # The base classes' __init__ assign an empty dict; the property above supersedes it.
        pass

    def _ids(self, features: KeyedJaggedTensor) -> tuple:
        # .to() is a no-op when the KJT already holds the plan's dtype: int32 ids arrive untouched.
        return (features.values().to(self._embedding_table_index_type),
                features.offsets().to(self._embedding_table_offset_type))

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[Tuple[str, torch.Tensor]]:
        # Fused convention: weights and optimizer state are updated in backward, so no external
        # optimizer or DDP may see them (optimizer state is reached through fused_optimizer).
        yield from ()

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[Tuple[str, nn.Parameter]]:
        for name, tensor in self.named_split_embedding_weights(prefix, recurse, remove_duplicate):
            param = nn.Parameter(tensor)  # requires_grad, as TorchRec's fused kernel yields them
            # Marks the weight as optimized in backward, so dense optimizers skip it.
            param._in_backward_optimizers = [EmptyFusedOptimizer()]  # type: ignore[attr-defined]
            yield name, param

    def flush(self) -> None:
        self._emb_module.flush()

    def purge(self) -> None:
        self._emb_module.reset_cache_states()

    # ------------------------------------------------------------------ helpers
    def _slices_by_table(self) -> Iterator[Tuple[str, TableBatchedEmbeddingSlice]]:
        """One slice per table name over the flat weights, like TorchRec's fused kernel: the shards
        of one table on this rank (column-wise) are adjacent, so one slice spans all of them."""
        module = self._emb_module
        plan = module.spec.plan
        counts: Dict[str, int] = dict(self.table_name_to_count)
        weights_by_table = module.split_embedding_weights()
        states = module.get_optimizer_state()
        # The slices' requires_grad follows their data's: True with TorchRec's fused kernel, whose flat
        # weights are FBGEMM's weights_dev Parameter. An alias of the module's flat buffer (same storage:
        # the kernels' in-place updates show through) gives ours the same flag.
        flat = nn.Parameter(module.weights)
        for k, table in enumerate(self._config.embedding_tables):
            count = counts.pop(table.name, None)
            if count is None:
                continue
            rows, dim = plan.rows[k], plan.dims[k]
            start = plan.weights_offsets[k]
            weight = TableBatchedEmbeddingSlice(
                data=flat,
                start_offset=start,
                end_offset=start + count * rows * dim,
                num_embeddings=-1,
                embedding_dim=dim,
            )
            # Per-table view of the group optimizer (shares lr and step), as TorchRec's fused kernel.
            weight._in_backward_optimizers = [  # type: ignore[attr-defined]
                EmbeddingFusedOptimizer(
                    config=self._config,
                    emb_module=module,
                    pg=self._pg,
                    create_for_table=table.name,
                    param_weight_for_table=weight,
                    embedding_weights_by_table=weights_by_table,
                    all_optimizer_states=states,
                )
            ]
            yield table.name, weight

    def extra_repr(self) -> str:
        return f"tables={[t.name for t in self._config.embedding_tables]}, options={self.options}"



class TritonTBEEmbeddingBag(_TritonTBEKernel, BaseBatchedEmbeddingBag[torch.Tensor]):
    """Pooled lookup + fused optimizer for the tables of one group, on ``TritonTBE``.

    Takes the arguments of TorchRec's ``BatchedFusedEmbeddingBag`` (``env`` is accepted and unused, as
    there); plan options arrive in ``config.fused_params`` (see ``options``)."""

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        pg: Optional[dist.ProcessGroup] = None,
        device: Optional[torch.device] = None,
        sharding_type: Optional[ShardingType] = None,
        env: Optional[ShardingEnv] = None,
    ) -> None:
        # MEAN becomes SUM for RW / TWRW in the base class: the sharded collection divides later.
        BaseBatchedEmbeddingBag.__init__(self, config, pg, device, sharding_type)
        _build_module(self, config, device, pg, self._pooling)

    def forward(
        self,
        features: KeyedJaggedTensor,
        vbe_output: Optional[torch.Tensor] = None,
        vbe_output_offsets: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        # TorchRec's base forward passes VBE metadata to FBGEMM's own classes only (any other module
        # would pool a variable batch as a fixed one): ours gets it here, as FBGEMM's does there.
        weights = features.weights_or_none()
        if weights is not None and not torch.is_floating_point(weights):
            weights = None
        indices, offsets = self._ids(features)
        vbe = {}
        if features.variable_stride_per_key():
            vbe = dict(batch_size_per_feature_per_rank=features.stride_per_key_per_rank(),
                       vbe_output=vbe_output, vbe_output_offsets=vbe_output_offsets)
        elif vbe_output is not None or vbe_output_offsets is not None:
            raise ValueError("Triton TBE kernel: vbe_output / vbe_output_offsets given for a fixed-batch KJT")
        return self._emb_module(indices=indices, offsets=offsets, per_sample_weights=weights, **vbe)


class TritonTBEEmbedding(_TritonTBEKernel, BaseBatchedEmbedding[torch.Tensor]):
    """Sequence lookup (``EmbeddingCollection``: one output row per id, ``[sum(lengths), D]``) + fused
    optimizer, on ``TritonTBE`` with ``PoolingMode.NONE``. Takes the arguments of TorchRec's
    ``BatchedFusedEmbedding``; TorchRec pads variable-batch KJTs before the lookup (sequence VBE)."""

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        pg: Optional[dist.ProcessGroup] = None,
        device: Optional[torch.device] = None,
    ) -> None:
        BaseBatchedEmbedding.__init__(self, config, pg, device)
        _build_module(self, config, device, pg, PoolingMode.NONE)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        indices, offsets = self._ids(features)
        return self._emb_module(indices=indices, offsets=offsets)
