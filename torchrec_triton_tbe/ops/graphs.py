"""The backward of small batches, replayed as a CUDA graph.

Why: a small batch's backward is launch-bound. On FBGEMM's default shape (B=512, T=32, L=20) its
kernels take ~0.25 ms on the H200, but issuing them (autograd, ``torch.sort``, ten Triton launches,
a dozen allocations) took 0.56-0.89 ms of host time (tools/host_profile.py), and a TorchRec step pays
that once per TBE module. Everything the backward does after the per-sample-weight gradient (run
metadata, fused update) is sync-free with buffers sized from N, so it can be captured
once per shape and replayed for the price of two input copies and one graph launch: 0.13 ms of
host time, 0.27 ms event-timed on that shape (docs/performance.md).

What a capture bakes in, and therefore keys a graph: the spec (tables, config), B, the padded lookup
count, the dtypes of ids / offsets / gradient / per-sample weights, the addresses of the weights,
optimizer state, learning rate and hyper-parameter tensors (read at replay time: ``set_learning_rate``
and ``update_hyper_parameters`` are seen; a forward whose values moved since swaps its own in,
autograd.swapped_in). The step count is the forward's own copy (autograd.StepVersion), a static input
loaded like the ids: the replay never reads or writes the module's ``iter``, which forwards on other
streams may be advancing meanwhile.

The output gradient is read where it lies, not copied. It is the largest input (B x total_D, 4 bytes
an element: 0.87 GB at 65,536 bags of 26 x 128 columns), and a copy into a static buffer cost as much
GPU time as the backward's own read of it (dlrm_t26_l1 0.63 -> 1.03 ms, hot_zipf15_l1 1.14 -> 2.15 ms on
the H200, docs/performance.md "Extended suite, 2026-12-01 evening"). A graph captured on a gradient
at address A replays only for a gradient at A (same shape and dtype: part of the key), so it reads the
caller's live tensor. In a training loop the caching allocator hands autograd the same block step
after step, so one graph serves; a key captures at most ``DIRECT_GRAPHS`` such graphs, and once its
gradient has turned up at more addresses than that, it captures one more graph on a static copy
(the old way) and replays that for every address it has no graph of.

Varying batch sizes: N is rounded up to a multiple of 2**(bit_length(N) - 1 - PAD_BITS), so a workload
whose N moves by a few percent replays a handful of graphs instead of capturing one per batch. Slots
past the real N are lookups outside every bag (positions >= offsets[T*B]): the transpose gives them
the sentinel key, so they sort last, fall outside every bucket and change no result; the replay is
bit-identical to the eager backward (tests/gpu/test_gpu_graphs.py, tests/test_graphs.py).

Lifecycle of a key: the first call runs eagerly on the key's static ids and offsets (compiles every
specialization and learns the persistent grids, which a capture must not do); the second captures
and replays; later calls replay, or capture once more for a new gradient address (above). A
module's live graphs of one stream share one memory pool; everything allocated inside a capture is
scratch of that replay only. At most
``backward.graph_cache`` keys per module (least recently used dropped); each holds static copies of
its ids, offsets and per-sample weights (8 + 4 bytes per lookup at most: 3.9 MB at FBGEMM's default
shape), the gradient's only once it falls back to a copy, and the pool the scratch of the largest
capture. Keys are per stream. Capture runs on a side stream ordered after the current
one with stream waits, never a host sync (but for a capture that ran out of memory: it frees the memory
cache, which syncs, and tries once more, ``BackwardGraphs._capture``); inside somebody else's capture (a
user graphing the whole step) the backward runs eagerly into that capture.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
from typing import Callable, Optional

import torch

from torchrec_triton_tbe import _env
from torchrec_triton_tbe.ops import launch as launch_ops

# N rounds up to 1/2**PAD_BITS of its leading power of two (at most 12.5 % padding, which is sorted
# and skipped: a few microseconds on the batches that take this path).
PAD_BITS = 3
# Graphs per key that read the gradient in place, one per address it was seen at (see above).
DIRECT_GRAPHS = 2
# The note a capture's error carries when ending the failed capture failed too (BackwardGraphs._capture).
_NOT_ENDED = "ending the failed capture failed too"


def padded_lookups(n: int) -> int:
    """The static lookup count a batch of ``n`` lookups replays with (>= n)."""
    if n <= 1 << PAD_BITS:
        return n
    step = 1 << (n.bit_length() - 1 - PAD_BITS)
    return -(-n // step) * step


class _Entry:
    """One key's static inputs and, from its second call on, its graphs."""

    def __init__(self, spec, indices, offsets, psw, step, n_static: int, stream) -> None:
        self.spec = spec  # keeps id(spec) in the key unique while the entry lives
        self.stream = stream  # the stream its copies and replays go on (None on a CPU)
        self.indices = torch.zeros(n_static, dtype=indices.dtype, device=indices.device)
        self.offsets = torch.empty_like(offsets)
        self.psw = torch.zeros(n_static, dtype=psw.dtype, device=psw.device) if psw is not None else None
        self.step = torch.zeros_like(step)
        self.grad_out: Optional[torch.Tensor] = None  # the static copy, made once the addresses vary
        # Gradient address -> graph reading it in place; None -> the graph reading self.grad_out.
        self.graphs: "dict[Optional[int], torch.cuda.CUDAGraph]" = {}
        self.calls = 0

    def load(self, indices, offsets, psw, step) -> None:
        # Slots [N, n_static) keep whatever an earlier batch left: they are outside every bag.
        self.indices[: indices.numel()].copy_(indices)
        self.offsets.copy_(offsets)
        if psw is not None:
            self.psw[: psw.numel()].copy_(psw)
        if self.spec.reads_step_count:  # otherwise no kernel reads the slot: a copy less per replay
            self.step.copy_(step)

    def grad_slot(self, grad_out: torch.Tensor) -> Optional[int]:
        """The graph this gradient replays: its address's, or None (the static copy's)."""
        ptr = grad_out.data_ptr()
        direct = sum(k is not None for k in self.graphs)
        if ptr in self.graphs or (direct < DIRECT_GRAPHS and ptr % 16 == 0 and grad_out.is_contiguous()):
            return ptr
        return None

    def static_grad(self, grad_out: torch.Tensor) -> torch.Tensor:
        if self.grad_out is None:
            self.grad_out = torch.empty_like(grad_out, memory_format=torch.contiguous_format)
        self.grad_out.copy_(grad_out)
        return self.grad_out


class BackwardGraphs:
    """A module's captured backwards (see the module docstring)."""

    def __init__(self) -> None:
        self._entries: "collections.OrderedDict[tuple, _Entry]" = collections.OrderedDict()
        self._side: Optional[torch.cuda.Stream] = None
        self.captures = 0  # graphs captured so far (tests, diagnostics)
        self.capture_retries = 0  # captures tried again after running out of memory (_capture)
        self.replays = 0

    def __deepcopy__(self, memo) -> "BackwardGraphs":
        # Graphs belong to the tensors they were captured on; a copied module captures its own.
        return BackwardGraphs()

    def __reduce__(self):  # every pickle protocol: an empty cache
        return (BackwardGraphs, ())

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    @staticmethod
    def applies(spec, num_lookups: int, device: torch.device) -> bool:
        """Whether a backward of this size on this device takes the graph path."""
        limit = spec.config.backward.graph_max_lookups
        return (
            0 < num_lookups <= limit
            and device.type == "cuda"
            and not _env.interpreting()
            and not torch.cuda.is_current_stream_capturing()
        )

    def run(
        self,
        spec,
        state,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        grad_out: torch.Tensor,
        per_sample_weights: Optional[torch.Tensor],
        step: torch.Tensor,
        B: int,
        body: Callable[..., None],
    ) -> None:
        """``body(state, indices, offsets, grad_out, per_sample_weights)`` on static copies of the inputs
        (``state`` with the static copy of ``step``, the forward's count): eagerly on a key's first
        call, captured on its second, replayed from then on."""
        n_static = padded_lookups(indices.numel())
        psw_dtype = per_sample_weights.dtype if per_sample_weights is not None else None
        device = grad_out.device
        # Per stream: a key's static buffers (and a pool's scratch) are reused by the next call, which
        # stream order protects only on the same stream.
        stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else None
        key = (
            id(spec), B, n_static, indices.dtype, offsets.dtype, grad_out.dtype, tuple(grad_out.shape), psw_dtype,
            *(t.data_ptr() for t in state.kernel_args()[:-1]), device, stream,  # not the step: a static input
        )
        entry = self._entries.get(key)
        if entry is None:
            # The streams a capture uses, taken now, before any capture: the process's first stream takes
            # driver memory (PyTorch's stream pool), and a capture in a process whose cache has since grown
            # to hold the card could not free the cache for it (launch.new_stream); a key's first call comes
            # early, often at the first step.
            self._make_streams(device, spec.config.backward.bucket_streams)
            entry = _Entry(spec, indices, offsets, per_sample_weights, step, n_static, stream)
            self._entries[key] = entry
            while len(self._entries) > max(1, spec.config.backward.graph_cache):
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        entry.load(indices, offsets, per_sample_weights, step)
        slot = entry.grad_slot(grad_out)
        # A graph of this slot reads the gradient in place; the copy's graph reads the static buffer.
        grad = grad_out if slot is not None else entry.static_grad(grad_out)
        statics = (dataclasses.replace(state, step=entry.step), entry.indices, entry.offsets, grad, entry.psw)
        entry.calls += 1
        if not entry.graphs and entry.calls == 1:
            body(*statics)
            return
        graph = entry.graphs.get(slot)
        if graph is None:
            graph = entry.graphs[slot] = self._capture(body, statics, device, stream)
        graph.replay()
        self.replays += 1

    def _make_streams(self, device: torch.device, bucket_streams: int = 1) -> None:
        """The capture's side stream and the bucket side streams its body may fork to (shared by every
        module of the device, launch.side_streams), where this has none yet. None off CUDA (the CPU
        tests drive the bookkeeping only)."""
        if device.type != "cuda":
            return
        if self._side is None:
            self._side = launch_ops.new_stream(device)
        launch_ops.side_streams(device, bucket_streams - 1)

    def _capture(self, body, statics, device: torch.device, stream) -> torch.cuda.CUDAGraph:
        """A graph of ``body`` on ``statics``; once more after freeing the memory cache if the capture ran
        out of memory. While a capture is underway PyTorch's caching allocator gets the graph pool's memory
        from the driver and does not free the blocks it keeps cached for other tensors to retry, as an eager
        allocation does (c10's CUDACachingAllocator, malloc): a process whose cache holds most of the card
        could fail here where the same backward run eagerly fits (seen in the bench on the H200, session
        50). The retry frees the cache (torch.cuda.empty_cache, which syncs the device: on this path
        only); a second failure is raised. Not where the failed capture could not be ended: the allocator
        may still route this thread's allocations to its pool, and no retry helps."""
        self._make_streams(device)
        try:
            return self._capture_once(body, statics, device, stream)
        except torch.OutOfMemoryError as error:
            if any(note.startswith(_NOT_ENDED) for note in getattr(error, "__notes__", ())):
                raise
        # Outside the except block: until it ends, the error's traceback keeps the failed capture's graph,
        # and with it the blocks its pool got, alive (the collection: frames in reference cycles).
        gc.collect()
        torch.cuda.empty_cache()
        self.capture_retries += 1
        return self._capture_once(body, statics, device, stream)

    def _capture_once(self, body, statics, device: torch.device, stream) -> torch.cuda.CUDAGraph:
        current = torch.cuda.current_stream(device)
        # Share the memory pool of a live graph of this module replayed on the same stream (everything
        # in it is per-replay scratch, and replays on one stream never overlap). With none left, a new
        # pool: a pool whose graphs were all dropped cannot be joined again (PyTorch asserts on its
        # zero use count).
        live = next((g for e in self._entries.values() if e.stream == stream for g in e.graphs.values()), None)
        graph = torch.cuda.CUDAGraph()
        # Stream order, not a host sync: the side stream starts after the static copies above.
        self._side.wait_stream(current)
        with torch.cuda.stream(self._side):
            # thread_local: other threads (a data loader, NCCL watchdogs) may use CUDA meanwhile.
            graph.capture_begin(pool=live.pool() if live is not None else None, capture_error_mode="thread_local")
            try:
                body(*statics)
            except BaseException as error:
                try:
                    graph.capture_end()
                except Exception as end_error:  # noqa: BLE001 - the capture is void: the body's error is raised
                    error.add_note(f"{_NOT_ENDED}: {end_error!r}")
                raise
            graph.capture_end()
        current.wait_stream(self._side)
        self.captures += 1
        return graph
