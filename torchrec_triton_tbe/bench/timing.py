"""Timing with device events, reported as median / p20 / p80 (``triton.testing.do_bench``'s quantiles).

Why not ``do_bench`` itself: the backward must be timed alone, with a fresh forward before every
iteration *outside* the timed region (FBGEMM's ``bwd_only``), and inputs must rotate over several
generated batches; ``do_bench`` times one closure as a whole. The loop below is FBGEMM's
``benchmark_requests`` (an event pair around each call, optional L2 flush before the start event)
with do_bench's statistics instead of FBGEMM's default mean (the mean is kept in the record too).

On CPU (Triton's interpreter) the same loop runs with wall-clock time; those numbers measure the
interpreter, not kernels, and every record says so (``meaningful: false``).

``host_median_ms``: the median wall-clock time the host spent issuing one timed call (between its two
event records, no sync inside). Where it comes near ``median_ms`` the call is host-bound: the GPU waits
for launches, and a faster kernel would not show.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import torch

TIMED_BY_EVENTS = "cuda events, median of per-iteration times"
TIMED_BY_WALL_CLOCK = "cpu wall clock (Triton interpreter: not kernel time)"

# step(i) runs what must stay outside the timed region for iteration i (for the backward: the forward)
# and returns the call to time.
Step = Callable[[int], Callable[[], object]]


@dataclasses.dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    mean_ms: float
    iters: int
    warmup: int
    method: str
    host_median_ms: Optional[float] = None

    @property
    def meaningful(self) -> bool:
        return self.method == TIMED_BY_EVENTS

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "meaningful": self.meaningful}


def _quantiles(times_ms: list[float], warmup: int, iters: int, method: str, host_ms: list[float]) -> Timing:
    t = torch.tensor(times_ms, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.5, 0.2, 0.8], dtype=torch.float64)).tolist()
    host = float(torch.tensor(host_ms, dtype=torch.float64).median())
    return Timing(q[0], q[1], q[2], float(t.mean()), iters, warmup, method, host)


def time_steps(step: Step, iters: int, warmup: int, device: torch.device, flush_gpu_cache_size_mb: int = 0) -> Timing:
    """Run ``warmup`` untimed iterations, then ``iters`` timed ones; iteration i calls ``step(i)``.

    Warm-up iterations walk the batches from the first one on (FBGEMM warms on the first batch only):
    with at least as many warm-up runs as batches, every batch has been seen once before timing, so
    a Triton kernel specialised on some batch-dependent integer cannot compile inside the timed loop.
    """
    for i in range(warmup):
        step(i)()
    if device.type != "cuda":
        times = []
        for i in range(iters):
            timed = step(i)
            start = time.perf_counter()
            timed()
            times.append((time.perf_counter() - start) * 1e3)
        return _quantiles(times, warmup, iters, TIMED_BY_WALL_CLOCK, times)

    torch.cuda.synchronize(device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    flush: Optional[torch.Tensor] = None
    host = []
    for i in range(iters):
        timed = step(i)
        if flush_gpu_cache_size_mb:
            # FBGEMM's flush: write a fresh buffer of that size just before the start event.
            flush = torch.rand(flush_gpu_cache_size_mb * 1024 * 1024 // 4, dtype=torch.float, device=device)
        starts[i].record()
        t0 = time.perf_counter()
        timed()
        host.append((time.perf_counter() - t0) * 1e3)
        ends[i].record()
    torch.cuda.synchronize(device)
    del flush
    return _quantiles([s.elapsed_time(e) for s, e in zip(starts, ends)], warmup, iters, TIMED_BY_EVENTS, host)


def measure_copy_bandwidth(nbytes: int = 2 * 10**9, reps: int = 20, device: Optional[torch.device] = None) -> dict:
    """Device-to-device copy of ``nbytes`` (default ~2 GB): (read + write bytes) / median time.

    A practical ceiling for a memory-bound kernel on this GPU, measured in the same process as the
    benchmark (so at the same clocks), for reading the GB/s columns.
    """
    device = device or torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        raise RuntimeError("measure_copy_bandwidth needs a CUDA device")
    n = nbytes // 4
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)

    def step(_i: int):
        return lambda: dst.copy_(src)

    timing = time_steps(step, reps, warmup=3, device=device)
    moved = 2 * n * 4
    del src, dst
    torch.cuda.empty_cache()
    return {
        "bytes_copied": n * 4,
        "bytes_moved": moved,
        "median_ms": timing.median_ms,
        "p20_ms": timing.p20_ms,
        "p80_ms": timing.p80_ms,
        "gbps": moved / (timing.median_ms * 1e-3) / 1e9,
    }
