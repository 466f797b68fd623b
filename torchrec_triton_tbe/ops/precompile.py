"""Compile a training step's kernels before the step, on several threads at once.

Why: a cold first step compiles every kernel specialization it launches, one after another, on the
thread that issues the step. tools/first_step.py counts 38 of them for prod_t40_b16k (one forward and
three backward kernels per D bucket, plus the run metadata and bounds checks): 12.2 s on one core of
the H200 host. The specializations do not depend on each other, and Triton's compiler releases the GIL
in its MLIR passes and in ptxas, so a thread pool overlaps them: 5.6 s on 16 threads there, where 16
processes took 1.7 s, because its Python front end still holds the GIL (docs/performance.md, "Time to
first step").

How:
1. Record. The step (forward, then backward with a ones gradient) is driven once with ``launch``
   recording instead of launching (ops/launch.py ``_PENDING``). The host code never waits for the GPU,
   so a step whose kernels never ran still issues every launch the real step will, with the same
   argument types, alignments, constexprs and warps. Host-side effects of the dry run are undone: the
   step counter it advanced, the last-run statistics; it runs on a graph cache of its own (a graph the
   module captured earlier would be replayed, and replays are not launches).
   Per-sample weights are cloned, so no gradient lands in the caller's tensor.
2. Compile. Each distinct specialization goes through Triton's own JIT (``JITFunction.warmup``: its
   binder, its cache key, its on-disk cache) on a thread pool, with the module's device current in each
   thread.
3. Hand over. Each compiled kernel goes into ``launch``'s cache under the key the real launch will look
   up (``launch.remember``), so the step finds it without Triton's per-call binding.

Under Triton's interpreter nothing is compiled: the report says so, and the step runs as it would.
What a precompiled step launches is exactly what it would have launched (the cache holds the kernels
Triton compiled for those arguments); only when the work happens changes.
"""

from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import torch

from torchrec_triton_tbe import _env
from torchrec_triton_tbe.ops import launch as launch_ops
from torchrec_triton_tbe.ops.graphs import BackwardGraphs


_KERNEL_WRITTEN = ("weights", "momentum1", "momentum2", "row_counter")


@dataclasses.dataclass(frozen=True)
class PrecompileReport:
    launches: int  # launches the recorded step issued
    specializations: int  # distinct ones among them: what was compiled
    kernels: tuple  # kernel names, one per specialization
    workers: int
    seconds: float  # wall time of the compile (0 under the interpreter)
    compiled: bool  # False under Triton's interpreter (nothing to compile)


def record_step(module, indices: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: Optional[torch.Tensor] = None,
                batch_size_per_feature_per_rank: Optional[list] = None) -> list:
    """The launches one training step of ``module`` on this batch issues, without running any of them
    (see the module docstring); the module's state is as before."""
    if launch_ops._PENDING is not None:
        raise RuntimeError("record_step: already recording (not re-entrant)")
    # Only kernels write the weights and the optimizer state (nothing ran); host ops may write the other
    # buffers (the step counter does: ops/backward.py), all of them small. Snapshot, restore after.
    small = {name: buf.clone() for name, buf in module.named_buffers() if name not in _KERNEL_WRITTEN}
    last_runs = module._last_runs
    # A fresh graph cache for the dry run: a graph the module already captured for this batch shape
    # would be replayed (real kernels, garbage gradients), not recorded. The cached LookupCall holds
    # the cache, so it is set aside too.
    graphs, cached_call = module._backward_graphs, module._cached_call
    module._backward_graphs, module._cached_call = BackwardGraphs(), None
    psw = None
    if per_sample_weights is not None:
        psw = per_sample_weights.detach().clone().requires_grad_(per_sample_weights.requires_grad)
    recorded: list = []
    launch_ops._PENDING = recorded
    try:
        with torch.enable_grad():
            kwargs = {}
            if batch_size_per_feature_per_rank is not None:
                kwargs["batch_size_per_feature_per_rank"] = batch_size_per_feature_per_rank
            out = module(indices, offsets, psw, **kwargs)
            out.backward(torch.ones_like(out))
    finally:
        launch_ops._PENDING = None
        with torch.no_grad():
            buffers = dict(module.named_buffers())
            for name, saved in small.items():
                buffers[name].copy_(saved)
        module._backward_graphs, module._cached_call = graphs, cached_call
        module._last_runs = last_runs
    return recorded


def _warmup(index: int) -> Callable:
    """Triton's JIT on a pool thread, on device ``index``: set_device needs an index (torch.device("cuda")
    has none), resolved by the caller on its own thread, whose current device the module's "cuda" means."""

    def compile_one(recorded: launch_ops.Launch):
        torch.cuda.set_device(index)  # CUDA's current device is per thread
        compiled = recorded.kernel.warmup(*recorded.args, grid=recorded.grid, **recorded.constexprs,
                                          num_warps=recorded.num_warps)
        # warmup stops at the cubin; the first launch would still load it and build the kernel's C
        # launcher (a C compiler run per signature, on an empty cache): do both here, in the pool.
        init = getattr(compiled, "_init_handles", None)
        if init is not None:
            init()
        return compiled

    return compile_one


def precompile(module, indices: torch.Tensor, offsets: torch.Tensor,
               per_sample_weights: Optional[torch.Tensor] = None,
               batch_size_per_feature_per_rank: Optional[list] = None,
               workers: Optional[int] = None, compile_fn: Optional[Callable] = None) -> PrecompileReport:
    """Records one training step of ``module`` on this batch (``record_step``) and compiles its distinct
    kernel specializations on ``workers`` threads (default: the CPUs this process may use).
    ``compile_fn(launch) -> compiled kernel`` replaces Triton's ``warmup`` (tests)."""
    recorded = record_step(module, indices, offsets, per_sample_weights, batch_size_per_feature_per_rank)
    device = module.current_device
    unique: dict = {}
    for r in recorded:
        unique.setdefault(r.site(device), r)
    chosen = list(unique.values())
    names = tuple(r.kernel.fn.__name__ if hasattr(r.kernel, "fn") else str(r.kernel) for r in chosen)
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = max(1, min(int(workers), len(chosen) or 1))
    if compile_fn is None and (_env.interpreting() or device.type != "cuda"):
        return PrecompileReport(len(recorded), len(chosen), names, workers, 0.0, compiled=False)
    cache_device = device
    if compile_fn is None:
        cache_device = _launch_device(device)  # launch's and Triton's device key: an index
        # Triton (3.6, 3.8) creates a kernel's per-device binder on first use: once here, not racing in
        # the pool.
        for r in chosen:
            caches = getattr(r.kernel, "device_caches", None)
            if caches is not None:
                caches[cache_device]
    compile_one = compile_fn or _warmup(cache_device)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers, thread_name_prefix="triton_tbe_precompile") as pool:
        kernels = list(pool.map(compile_one, chosen))
    seconds = time.perf_counter() - t0
    for r, compiled in zip(chosen, kernels):
        if compiled is not None:
            launch_ops.remember(r, cache_device, compiled)
    return PrecompileReport(len(recorded), len(chosen), names, workers, seconds, compiled=True)


def _launch_device(device: torch.device):
    """The device key ``launch`` uses (Triton's current device index)."""
    from triton.runtime import driver

    with torch.cuda.device(device):
        return driver.active.get_current_device()
