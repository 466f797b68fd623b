"""Kernel launches without Triton's per-call argument binding.

Why: on small batches the host issues kernels slower than the GPU runs them (FBGEMM's default shape:
0.77-0.89 ms to issue a backward whose kernels take ~0.25 ms on the H200, tools/host_profile.py), and
much of a ``kernel[grid](...)`` call is Triton re-deriving every argument's specialization through its
generated binder and hashing it into a cache key (27 + 3 µs for the 31-argument short kernel on our
2-core CPU machine, Triton 3.8). ``launch`` keys
the compiled kernel on the same properties, computed in one pass over the arguments, and calls the
compiled kernel's launcher directly on a hit; a miss goes through ``kernel[grid]`` (compiling if
needed) and caches what it returns.

The key is at least as fine as Triton's specialization, so a hit never reuses a kernel compiled
under other assumptions: per tensor its dtype and whether its address is 16-byte aligned; per int
whether it is 1, whether it divides by 16 and whether it fits 32 bits (bools and floats by type);
the constexprs, num_warps and maxnreg as given; the current device. Under Triton's interpreter (no GPU)
``kernel[grid]`` returns no compiled kernel and every call takes the normal path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
from typing import Any, Iterator, Optional, Sequence

import torch
from triton import knobs
from triton.runtime import driver

from torchrec_triton_tbe import _env

_Tensor = torch.Tensor
_I32_MIN, _I32_MAX, _I64_MAX = -(2**31), 2**31 - 1, 2**63 - 1

# Fixed at import, like Triton's own choice between compiled and interpreted kernels (_env).
_INTERPRETED = _env.interpreting()

# (id(kernel), device, num_warps, maxnreg, constexprs, argument key) -> (compiled kernel, constexpr
# values in signature order after the positional arguments)
_COMPILED: dict = {}


class _Recording(threading.local):
    """Per thread: the list precompile's dry run (ops/precompile.py) records this thread's launches into
    while it drives a step without running it (None: launches run). Per thread, not per process: another
    thread's forward during the dry run must run, not be recorded and dropped (its output would be left
    uninitialised). The dry run's backward runs on autograd's thread for the device: the forward's
    autograd node carries the list there (autograd.TBEFunction)."""

    pending: Optional[list] = None


_RECORDING = _Recording()


def recording_into() -> Optional[list]:
    """The list this thread's launches are being recorded into, or None."""
    return _RECORDING.pending


@contextlib.contextmanager
def recording(into: list) -> Iterator[list]:
    """Within: launch() on this thread appends a Launch to ``into`` and launches nothing."""
    if _RECORDING.pending is not None:
        raise RuntimeError("record_step: already recording (not re-entrant)")
    _RECORDING.pending = into
    try:
        yield into
    finally:
        _RECORDING.pending = None


@dataclasses.dataclass(frozen=True)
class Launch:
    """One recorded launch: what ``launch`` was called with."""

    kernel: Any
    grid: tuple
    args: tuple
    constexprs: dict
    num_warps: int
    maxnreg: Optional[int] = None

    @property
    def options(self) -> dict:
        """The launch options Triton compiles on, as ``kernel[grid](..., **options)`` takes them."""
        return launch_options(self.num_warps, self.maxnreg)

    def site(self, device) -> tuple:
        """``launch``'s cache key for this launch on ``device``."""
        return (id(self.kernel), device, self.num_warps, self.maxnreg, tuple(self.constexprs.items()),
                arg_key(self.args))


def launch_options(num_warps: int, maxnreg: Optional[int] = None) -> dict:
    """``num_warps``, and ``maxnreg`` (a cap on registers per thread that ptxas may spill to meet) only
    when set: left out, Triton compiles exactly what it did before the knob existed."""
    return {"num_warps": num_warps} if maxnreg is None else {"num_warps": num_warps, "maxnreg": maxnreg}


def remember(recorded: Launch, device, compiled) -> None:
    """Puts a kernel compiled for ``recorded`` (e.g. ahead of time, ops/precompile.py) where ``launch``
    looks first, so the real launch neither binds arguments through Triton nor compiles."""
    _COMPILED[recorded.site(device)] = (compiled, _tail(recorded.kernel, len(recorded.args), recorded.constexprs))


def _tail(kernel, num_args: int, constexprs: dict) -> tuple:
    """The values of ``kernel``'s parameters after its ``num_args`` positional ones, in signature
    order: ``constexprs``' or the parameter's default (what the launcher is handed after the args)."""
    if hasattr(kernel, "params"):
        params = [(p.name, p.default) for p in kernel.params]
    else:  # an InterpretedFunction (no GPU): its Python signature
        params = [(p.name, p.default) for p in inspect.signature(kernel.fn).parameters.values()]
    return tuple(constexprs.get(name, default) for name, default in params[num_args:])


# device index -> side streams, taken on first use and shared by every module on that device: the same streams
# on every call (torch.cuda.Stream() hands out PyTorch's pooled streams in turn, so streams taken per call or
# per module would land on one another's after 32).
_SIDE_STREAMS: dict = {}


def side_streams(device: torch.device, n: int) -> list:
    """``n`` side streams of ``device`` (CUDA), the same ones on every call."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    have = _SIDE_STREAMS.setdefault(index, [])
    while len(have) < n:
        have.append(new_stream(index))
    return have[:n]


def new_stream(device) -> torch.cuda.Stream:
    """A CUDA stream of ``device`` (``torch.cuda.Stream()``: one of PyTorch's pooled streams). The process's
    first request of a device creates the pool (c10's getStreamFromPool: 32 streams per priority at once),
    which takes memory from the driver, outside PyTorch's caching allocator: it fails with CUDA's
    out-of-memory error in a process whose cache holds the card (the H100, session 52: under 20 MiB free,
    the rest cached), where a tensor allocation would free the cached blocks and try again. This does the
    same: it frees the cache once (torch.cuda.empty_cache, which syncs the device: on this path only) and
    tries again (the pool's creation is retried: a failed one is not marked done); a second failure is
    raised. Not inside a capture on the current stream, where freeing memory is not allowed: there the
    error is raised at once (the graph path takes its streams before it captures, ops/graphs.py)."""
    try:
        return torch.cuda.Stream(device=device)
    except RuntimeError as error:  # torch.AcceleratorError (torch 2.9+) or OutOfMemoryError: both RuntimeErrors
        if "out of memory" not in str(error) or torch.cuda.is_current_stream_capturing():
            raise
    torch.cuda.empty_cache()
    return torch.cuda.Stream(device=device)


# Events that order side streams after / before the caller's stream, per thread and device: reused
# from call to call (Stream.wait_stream creates one per wait; with the torch.cuda.stream switches this
# replaced, about half of a 7-bucket forward's host time on the H200, docs/performance.md). Reuse is
# safe because a stream wait binds to the event's latest record at the time of the wait call, so
# re-recording it later moves no wait already queued; per thread, because two threads recording one
# event between each other's record and wait would order a side stream after the wrong work.
_EVENTS = threading.local()


def fork_join_events(device: torch.device, n: int) -> list:
    """``n`` events of ``device`` for this thread, the same ones on every call."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    per_device = getattr(_EVENTS, "by_device", None)
    if per_device is None:
        per_device = _EVENTS.by_device = {}
    have = per_device.setdefault(index, [])
    while len(have) < n:
        have.append(torch.cuda.Event())
    return have[:n]


def bucket_streams(cfg, num_launches: int, num_lookups: int, device: torch.device) -> list:
    """The streams a call's D-bucket launches go round: [caller's, side streams...], forked from the
    caller's stream (each side stream waits for the work queued before this call, so it sees the
    ids, offsets, gradient and buffers allocated there); [] keeps every launch on the caller's stream.
    ``cfg``: config.ForwardConfig or config.BackwardConfig (their ``bucket_streams`` and
    ``bucket_streams_min_lookups``). From host ints only; a stream fork inside a CUDA graph capture
    becomes parallel branches of the graph."""
    n = min(cfg.bucket_streams, num_launches)
    if n < 2 or num_lookups < cfg.bucket_streams_min_lookups or device.type != "cuda":
        return []
    main = torch.cuda.current_stream(device)
    streams = [main, *side_streams(device, n - 1)]
    fork = fork_join_events(device, n)[0]
    fork.record(main)
    for s in streams[1:]:
        s.wait_event(fork)
    return streams


def join_streams(streams: list, device: torch.device) -> None:
    """The caller's stream waits for every side stream: whatever it runs next (the consumers, and any
    reuse of memory freed after this call) is ordered after the side launches, so no tensor needs
    record_stream."""
    events = fork_join_events(device, len(streams))
    for s, e in zip(streams[1:], events[1:]):
        e.record(s)
        streams[0].wait_event(e)


_NO_STREAMS = contextlib.nullcontext()


def joined(streams: list, device: torch.device) -> contextlib.AbstractContextManager:
    """Joins ``streams`` (bucket_streams) after the block, also when it raises: kernels already queued
    on the side streams read tensors the failing call frees, and only the join orders the reuse of that
    memory. A join that fails after the block raised (a sticky CUDA error, a broken capture) is noted
    on the block's error, which stays the one raised. Without side streams, a reused no-op context
    (a generator context costs a launch-bound forward ~1.4 µs of host time)."""
    return _joined(streams, device) if streams else _NO_STREAMS


@contextlib.contextmanager
def _joined(streams: list, device: torch.device) -> Iterator[None]:
    try:
        yield
    except BaseException as error:
        try:
            join_streams(streams, device)
        except Exception as join_error:  # noqa: BLE001 - reported on the error that caused it
            error.add_note(f"joining the side streams after this error failed too: {join_error!r}")
        raise
    join_streams(streams, device)


MAX_GRID_Y = 65535  # CUDA's limit on grid dimensions 1 and 2


def grid_y_chunks(n: int) -> list[tuple[int, int]]:
    """(first entry, entries) of the launches that cover ``n`` grid-y entries (features), at most
    MAX_GRID_Y each: one launch, (0, n), up to the limit. FBGEMM's kernels take any feature count (1-D
    grids over B * T). More start at multiples of 16 entries where the limit allows (65,520), so a
    slice of a plan tensor keeps its 16-byte alignment and its launches the first slice's kernel: Triton
    specializes pointers on it."""
    if n <= MAX_GRID_Y:
        return [(0, n)]
    step = MAX_GRID_Y - MAX_GRID_Y % 16 if MAX_GRID_Y >= 16 else MAX_GRID_Y
    return [(t0, min(n - t0, step)) for t0 in range(0, n, step)]


def grid_y_slices(features: torch.Tensor) -> list[torch.Tensor]:
    """``features`` (a 1-D list a kernel reads its grid-y entries through) in slices of at most
    MAX_GRID_Y: ``[features]`` itself where it fits (no view per call)."""
    n = features.numel()
    return [features] if n <= MAX_GRID_Y else [features[t0:t0 + m] for t0, m in grid_y_chunks(n)]


def cdiv(a: int, b: int) -> int:
    """Host-side grid arithmetic. triton.cdiv / next_power_of_2 are constexpr functions in Triton 3.6
    (each host call unwraps its arguments: ~2 µs, several per launch)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 0


def mean_bag_pow2(num_lookups: int, num_bags: int) -> int:
    """The mean bag length rounded up to a power of two (at least 1), from host ints (len(indices),
    B*T): what the kernels that tile bags by ids-per-step shrink their step to, without a sync."""
    return next_pow2(max(cdiv(num_lookups, max(num_bags, 1)), 1))


def arg_key(args: Sequence[Any]) -> tuple:
    """The properties of ``args`` Triton specializes a kernel on (see the module docstring)."""
    key = []
    for a in args:
        cls = a.__class__
        if cls is int:
            key.append(4 if a == 1 else ((a & 15) == 0) | ((_I32_MIN <= a <= _I32_MAX) << 1) | ((a > _I64_MAX) << 3))
        elif isinstance(a, _Tensor):
            key.append((a.dtype, (a.data_ptr() & 15) == 0))
        else:
            key.append(cls)
    return tuple(key)


def _bind_and_launch(kernel, grid, args, constexprs, num_warps, maxnreg, stream):
    """Triton's own path (binds, compiles if needed, launches on the current stream): ``stream`` made
    current for this call only."""
    options = launch_options(num_warps, maxnreg)
    if stream is None:
        return kernel[grid](*args, **constexprs, **options)
    with torch.cuda.stream(stream):
        return kernel[grid](*args, **constexprs, **options)


def launch(
    kernel,
    grid: tuple,
    args: Sequence[Any],
    constexprs: dict,
    num_warps: int,
    key: Optional[tuple] = None,
    stream: Optional[torch.cuda.Stream] = None,
    maxnreg: Optional[int] = None,
):
    """``kernel[grid](*args, **constexprs, num_warps=num_warps[, maxnreg=maxnreg])``; returns the compiled
    kernel (None under the interpreter). ``args`` are the leading positional parameters, ``constexprs``
    every parameter after them; ``key``: ``arg_key(args)`` when the caller has it already; ``stream``: the
    CUDA stream to launch on (None: the current one), without making it current (entering
    ``torch.cuda.stream`` and leaving it again costs more host time than the launch itself); ``maxnreg``:
    Triton's cap on registers per thread (None: the compiler's choice)."""
    pending = _RECORDING.pending
    if pending is not None:
        pending.append(Launch(kernel, tuple(grid), tuple(args), dict(constexprs), num_warps, maxnreg))
        return None
    if _INTERPRETED or _env.RECORD_LAUNCHES:
        return _bind_and_launch(kernel, grid, args, constexprs, num_warps, maxnreg, stream)
    cx = tuple(constexprs.items())
    if key is None:
        key = arg_key(args)
    device = driver.active.get_current_device()
    # id(): the kernels are module globals (they outlive the cache); hashing a JITFunction goes through
    # its source hash under a lock.
    site = (id(kernel), device, num_warps, maxnreg, cx, key)
    hit = _COMPILED.get(site)
    if hit is None:
        compiled = _bind_and_launch(kernel, grid, args, constexprs, num_warps, maxnreg, stream)
        # Not kept for a stream of another device: Triton compiled and loaded it there (the stream's
        # context), and a hit would launch it from this device's.
        if (hasattr(compiled, "packed_metadata") and getattr(compiled, "function", None) is not None
                and (stream is None or stream.device_index == device)):
            _COMPILED[site] = (compiled, _tail(kernel, len(args), constexprs))
        return compiled
    compiled, tail = hit
    full = (*args, *tail)
    stream = driver.active.get_current_stream(device) if stream is None else stream.cuda_stream
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    # Exactly the tail of Triton's JITFunction.run (3.6 and 3.8): launch hooks and their metadata
    # (profilers such as Proton attach there) see this launch as they would any other.
    compiled.run(
        grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata,
        compiled.launch_metadata(grid, stream, *full),
        knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *full,
    )
    return compiled
