"""2D parallel: TorchRec's ``DMPCollection`` replica sync covers tables on our kernel.

``DMPCollection`` shards a model within each sharding group and replicates it across groups; after a step,
``sync()`` averages every replicated embedding tensor over the replica process group. It finds the tensors
once, after sharding: ``_group_sharded_modules`` collects FBGEMM ``SplitTableBatchedEmbeddingBagsCodegen``
modules *by class*, and ``_cache_sync_tensors`` files their ``split_embedding_weights()`` and each table's
``state["sum"]`` into per-dtype lists (``ctx.weights_by_dtype``, ``ctx.optimizer_tensors_by_dtype``) that
``sync()`` all-reduces (``allreduce_coalesced``, ``ReduceOp.AVG``, or the user's ``custom_all_reduce``).
Our modules are not of that class, so without this wrapper their replicas would silently drift apart.

We wrap ``_cache_sync_tensors`` (same name, signature and role in TorchRec 1.6.1 and 1.9.2) and, after
TorchRec's own pass, add our modules' tensors to the same lists, so they are averaged in the same
collectives as ``fused`` tables' and nothing else about ``sync()`` changes:

* the whole flat weight buffer of each module (all its tables; what ``split_embedding_weights()`` views);
* every optimizer state buffer (row-wise Adagrad's and Adagrad's ``sum`` as for ``fused``; and the
  Adam / LAMB moments, row counters and LARS momentum, which TorchRec's ``state["sum"]`` cannot reach: a
  ``fused`` Adam table fails there with ``KeyError: 'sum'``). Step counters need no sync: replicas step
  together.

Which context a module belongs to follows TorchRec's grouping: a module inside a sharded module of a
submodule context's type (``DMPCollectionConfig``) syncs on that context's replica group; every other
one on the default context's.
"""

from __future__ import annotations

import functools
from typing import Iterable, List

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DMPCollection

from torchrec_triton_tbe.module import TritonTBE

_PATCHED = "_triton_tbe_2d_sync"


def sync_tensors(module: TritonTBE) -> List[torch.Tensor]:
    """The tensors replicas of ``module`` must agree on: its weights, then its optimizer state buffers."""
    return [module.weights] + [getattr(module, state.name) for state in module.spec.optimizer.states]


def gloo_average(group, tensors: List[torch.Tensor]) -> None:
    """A ``DMPCollection.set_all_reduce_hook`` for gloo, which has no ``ReduceOp.AVG`` (the default path's
    op on NCCL): sum over the replica group, then divide."""
    for t in tensors:
        dist.all_reduce(t, group=group)
        t.div_(dist.get_world_size(group))


def _walk(module: nn.Module, seen: set) -> Iterable[nn.Module]:
    """``module`` and everything below it, lookups included: a sharded collection keeps its lookups in a
    plain ``_lookups`` list, not as child modules (TorchRec's own grouping walks it the same way)."""
    if id(module) in seen:
        return
    seen.add(id(module))
    yield module
    for lookup in getattr(module, "_lookups", None) or ():
        if isinstance(lookup, nn.Module):
            yield from _walk(lookup, seen)
    for child in module.children():
        yield from _walk(child, seen)


def triton_tbe_modules(root: nn.Module) -> List[TritonTBE]:
    """Every TritonTBE module under ``root`` (a DistributedModelParallel, a sharded collection), those
    behind a sharded collection's lookups included, which ``root.modules()`` does not reach."""
    return [m for m in _walk(root, set()) if isinstance(m, TritonTBE)]


def _add_ours(dmp: DMPCollection, contexts) -> None:
    root = dmp._dmp_wrapped_module
    claimed: set = set()
    groups = []
    for ctx in contexts[1:]:  # submodule contexts first, as TorchRec groups them
        mine = [m for outer in _walk(root, set()) if isinstance(outer, ctx.sharded_module)
                for m in triton_tbe_modules(outer) if id(m) not in claimed]
        claimed.update(id(m) for m in mine)
        groups.append((ctx, mine))
    if contexts:
        groups.insert(0, (contexts[0], [m for m in triton_tbe_modules(root) if id(m) not in claimed]))
    for ctx, modules in groups:
        weights = dict(ctx.weights_by_dtype or {})
        states = dict(ctx.optimizer_tensors_by_dtype or {})
        for module in modules:
            first, *rest = sync_tensors(module)
            weights.setdefault(first.dtype, []).append(first)
            for tensor in rest:
                states.setdefault(tensor.dtype, []).append(tensor)
        ctx.weights_by_dtype = weights
        ctx.optimizer_tensors_by_dtype = states
        ctx.triton_tbe_modules = modules


def _wrap(original):
    @functools.wraps(original)
    def _cache_sync_tensors(self, contexts) -> None:
        original(self, contexts)
        _add_ours(self, contexts)

    setattr(_cache_sync_tensors, _PATCHED, original)
    return _cache_sync_tensors


def install(cls: type = DMPCollection) -> None:
    """Wraps ``cls._cache_sync_tensors`` once (idempotent); ``cls`` is TorchRec's ``DMPCollection`` unless a
    caller hands in a subclass defining its own."""
    current = cls.__dict__["_cache_sync_tensors"]
    if not hasattr(current, _PATCHED):
        cls._cache_sync_tensors = _wrap(current)


def installed(cls: type = DMPCollection) -> bool:
    return hasattr(cls.__dict__["_cache_sync_tensors"], _PATCHED)


install()
