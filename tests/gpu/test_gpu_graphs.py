"""Backward CUDA graphs (ops/graphs.py) on the GPU: replays are bit-identical to the eager backward
(batches of varying size, learning-rate, hyper-parameter and step changes between replays, forwards between a
forward and its backward, stochastic rounding,
per-sample weights with their gradient, eviction), capture and replay never sync the host, and a capture
that runs out of memory frees the cache and captures again."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gpu_cases import DEV, FTM, SPECS, batch

from torchrec_triton_tbe._fbgemm import EmbOptimType, SparseType
from torchrec_triton_tbe.config import load_config
from torchrec_triton_tbe.module import TritonTBE
from torchrec_triton_tbe.ops.graphs import BackwardGraphs

ROOT = Path(__file__).resolve().parents[2]


def two_modules(optimizer, graph_cache=8):
    cfg = load_config(DEV)
    assert cfg.backward.graph_max_lookups > 0
    kw = dict(feature_table_map=FTM, device=DEV, optimizer=optimizer, weights_precision=SparseType.FP16,
              stochastic_rounding=True, learning_rate=0.05, eps=0.1)
    graphed = TritonTBE(SPECS, kernel_config=cfg.replace_backward(graph_cache=graph_cache), **kw)
    eager = TritonTBE(SPECS, kernel_config=cfg.replace_backward(graph_max_lookups=0), **kw)
    torch.manual_seed(0)
    graphed.init_embedding_weights_uniform(-0.5, 0.5)
    eager.weights.copy_(graphed.weights)
    return graphed, eager


@pytest.mark.parametrize("optimizer", [EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.ADAM,
                                       EmbOptimType.PARTIAL_ROWWISE_LAMB])
@pytest.mark.parametrize("weighted", [False, True])
def test_replays_match_the_eager_backward_bitwise(optimizer, weighted):
    graphed, eager = two_modules(optimizer, graph_cache=2)
    # Seeds repeat (keys reach capture and replay); B changes (new keys, evictions with graph_cache=2).
    plan = [(0, 512), (1, 512), (0, 512), (1, 512), (2, 256), (0, 512), (3, 128), (2, 256), (2, 256), (0, 512)]
    for step, (seed, B) in enumerate(plan):
        idx, off, psw = batch(seed, weighted=weighted, nb=B, psw_grad=True)
        grads = []
        for m in (graphed, eager):
            w = psw.detach().clone().requires_grad_(True) if weighted else None
            out = m(idx, off, w)
            if step in (4, 8):
                # Changed between the forward and its backward: the replay (step 8) and the eager first
                # call of its key (step 4) apply the forward's rate, as the eager module does.
                m.set_learning_rate(0.02 if step == 4 else 0.005)
            out.backward(torch.randn(out.shape, device=DEV, generator=torch.Generator(DEV).manual_seed(step)))
            grads.append(w.grad if weighted else None)
        if weighted:
            assert torch.equal(grads[0], grads[1])
        if step == 3:
            for m in (graphed, eager):
                m.set_learning_rate(0.01)  # device-resident: replays read it
        if step == 6:
            for m in (graphed, eager):
                m.set_optimizer_step(100)  # stochastic rounding (and bias correction) read the step counter
                m.update_hyper_parameters({"eps": 0.05, "beta1": 0.8})  # device-resident too
    torch.cuda.synchronize()
    g = graphed._backward_graphs
    assert g.captures >= 2 and g.replays >= 3, (g.captures, g.replays)
    assert len(g) <= 2
    assert eager._backward_graphs.captures == 0
    assert torch.equal(graphed.weights, eager.weights)
    assert torch.equal(graphed.momentum1, eager.momentum1)
    assert torch.equal(graphed.momentum2, eager.momentum2)
    assert torch.equal(graphed.iter, eager.iter)
    assert float(graphed.learning_rate_tensor) == float(eager.learning_rate_tensor) == pytest.approx(0.005)


def test_replays_apply_their_forwards_step_count():
    """Each forward advances the step count and its backward applies that count (autograd.StepVersion):
    with an eval forward and a second training forward before each backward (TorchRec's semi-synchronous
    order), a replay loads its forward's copy of the count into the graph's slot as the eager module
    passes it, bit for bit."""
    graphed, eager = two_modules(EmbOptimType.ADAM)
    for step in range(6):
        first, second = batch(step % 2, nb=512)[:2], batch(2 + step % 2, nb=512)[:2]
        gen = torch.Generator(DEV).manual_seed(step)
        grads = [torch.randn(512, graphed.total_D, device=DEV, generator=gen) for _ in range(2)]
        for m in (graphed, eager):
            out = m(*first)
            with torch.no_grad():
                m(*second)
            later = m(*second)
            out.backward(grads[0])
            later.backward(grads[1])
    torch.cuda.synchronize()
    assert graphed._backward_graphs.replays >= 2, graphed._backward_graphs.replays
    assert int(graphed.iter) == int(eager.iter) == 18
    for name in ("weights", "momentum1", "momentum2"):
        assert torch.equal(getattr(graphed, name), getattr(eager, name)), name


def test_forwards_on_other_streams_apply_their_own_step_count():
    """A pipeline's lookups on a side stream (their backwards run there too, autograd's rule), then eval
    forwards on the default stream, then lookups on the side stream again in semi-synchronous order: the
    count each backward applies and the weights equal those of the same calls all on one stream (each
    backward applies its forward's own copy of the count; forwards on another stream than the last one
    wait for it before advancing the count, TritonTBE._follow_last_stream)."""
    graphed, eager = two_modules(EmbOptimType.ADAM)
    grads = [torch.randn(512, eager.total_D, device=DEV, generator=torch.Generator(DEV).manual_seed(s))
             for s in range(4)]
    side = torch.cuda.Stream(DEV)
    side.wait_stream(torch.cuda.current_stream(DEV))  # the weights' initialisation and the gradients
    for m, stream in ((graphed, side), (eager, torch.cuda.current_stream(DEV))):
        for step in range(4):
            with torch.cuda.stream(stream):
                out = m(*batch(step % 2, nb=512)[:2])
                later = m(*batch(2, nb=512)[:2]) if step >= 2 else None  # semi-synchronous order
                out.backward(grads[step])
                if later is not None:
                    later.backward(grads[3 - step])
            with torch.no_grad():
                m(*batch(3, nb=512)[:2])  # an eval forward on the default stream
    torch.cuda.synchronize()
    assert int(graphed.iter) == int(eager.iter) == 4 + 2 + 4
    for name in ("weights", "momentum1", "momentum2"):
        assert torch.equal(getattr(graphed, name), getattr(eager, name)), name


def test_an_eval_forward_on_another_stream_before_a_replayed_backward():
    """A training forward on a side stream, an eval forward on the default stream with no wait between
    them, then the training forward's backward replayed on the side stream: the replay loads its
    forward's own count into the graph's slot and never touches the module's ``iter``, which the eval
    forward advances meanwhile (review of session 38: the count used to be swapped into ``iter`` for
    the replay). Counts and weights as the same calls on one stream; the module deep-copies after
    forwards on CUDA streams (the last one's stream is not copied)."""
    import copy

    graphed, eager = two_modules(EmbOptimType.ADAM)
    grads = [torch.randn(512, eager.total_D, device=DEV, generator=torch.Generator(DEV).manual_seed(s))
             for s in range(5)]
    side = torch.cuda.Stream(DEV)
    side.wait_stream(torch.cuda.current_stream(DEV))
    for m, stream in ((graphed, side), (eager, torch.cuda.current_stream(DEV))):
        for step in range(5):
            with torch.cuda.stream(stream):
                out = m(*batch(step % 2, nb=512)[:2])
            with torch.no_grad():
                m(*batch(3, nb=512)[:2])  # eval, default stream
            with torch.cuda.stream(stream):
                out.backward(grads[step])
    torch.cuda.synchronize()
    assert graphed._backward_graphs.replays >= 2, graphed._backward_graphs.replays
    assert int(graphed.iter) == int(eager.iter) == 10
    for name in ("weights", "momentum1", "momentum2"):
        assert torch.equal(getattr(graphed, name), getattr(eager, name)), name
    twin = copy.deepcopy(graphed)
    assert torch.equal(twin.weights, graphed.weights) and twin._last_stream.stream is None


def test_capture_and_replay_do_not_sync():
    graphed, _ = two_modules(EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    idx, off, _ = batch(0)
    grad = torch.randn(512, graphed.total_D, device=DEV)
    graphed(idx, off).backward(grad)  # first call of the key: eager (compiles, learns the grids)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):  # capture + replay, then replays
            graphed(idx, off).backward(grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    g = graphed._backward_graphs
    assert (g.captures, g.replays) == (1, 3)


def test_each_stream_gets_its_own_graphs():
    """Static inputs and pool scratch are reused call after call, which stream order protects only on
    one stream: a backward on another stream gets its own key (and pool), and results stay bitwise."""
    graphed, eager = two_modules(EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    side = torch.cuda.Stream()
    idx, off, _ = batch(0)
    for step in range(6):  # main stream on even steps, the side stream on odd ones: 3 calls each
        for m in (graphed, eager):
            grad = torch.randn(512, m.total_D, device=DEV, generator=torch.Generator(DEV).manual_seed(step))
            if step % 2:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    m(idx, off).backward(grad)
                torch.cuda.current_stream().wait_stream(side)
            else:
                m(idx, off).backward(grad)
    torch.cuda.synchronize()
    g = graphed._backward_graphs
    assert len(g) == 2 and (g.captures, g.replays) == (2, 4)
    assert torch.equal(graphed.weights, eager.weights)
    assert torch.equal(graphed.momentum1, eager.momentum1)


def test_gradient_read_in_place_then_copied_when_its_address_varies():
    """ops/graphs.py reads the output gradient in place: a key's graph replays only for a gradient at
    the address it was captured on. Four gradients cycled (four addresses): two graphs in place
    (DIRECT_GRAPHS), then one on a static copy that serves every other address; bitwise as eager."""
    from torchrec_triton_tbe.ops.graphs import DIRECT_GRAPHS

    graphed, eager = two_modules(EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    idx, off, _ = batch(0)
    gen = torch.Generator(DEV).manual_seed(5)
    grads = [torch.randn(512, graphed.total_D, device=DEV, generator=gen) for _ in range(4)]
    for step in range(10):
        for m in (graphed, eager):
            m(idx, off).backward(grads[step % 4])
    torch.cuda.synchronize()
    g = graphed._backward_graphs
    assert len(g) == 1
    entry = next(iter(g._entries.values()))
    assert sorted(k is None for k in entry.graphs) == [False] * DIRECT_GRAPHS + [True]
    assert entry.grad_out is not None
    assert (g.captures, g.replays) == (DIRECT_GRAPHS + 1, 9)
    assert torch.equal(graphed.weights, eager.weights)
    assert torch.equal(graphed.momentum1, eager.momentum1)


@pytest.fixture(autouse=True)
def _give_the_cache_back():
    """A test that filled the cache (_cache_the_card) leaves it to the driver for the next one."""
    yield
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _cache_the_card(side_stream=None, small_bytes: int = 1 << 19) -> None:
    """Leave under 20 MiB of the card free, the rest in PyTorch's cache (one cached block of the current
    stream), so an allocation that needs a new large segment (20 MiB or more) finds none unless the cache
    is freed. The cache is emptied first: a fill that had to free cached blocks itself would leave them
    free. A small block is cached beside it on the current stream and one on ``side_stream`` (the
    capture's: the cache keeps blocks per stream, and the capture's start allocates the default
    generator's state on that stream before the capture begins): eager allocations under 1 MiB find room
    there instead of failing, freeing every cached block (the allocator's last resort outside a capture)
    and undoing the fill. Session 52's H100 run showed that: with a small block on the current stream
    only, each capture found memory after one such retry."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    primers = [torch.empty(small_bytes, dtype=torch.uint8, device=DEV)]
    if side_stream is not None:
        with torch.cuda.stream(side_stream):
            primers.append(torch.empty(small_bytes, dtype=torch.uint8, device=DEV))
    free, _ = torch.cuda.mem_get_info()
    for margin in (2 << 20, 4 << 20, 8 << 20, 16 << 20):
        try:
            hog = torch.empty(free - margin, dtype=torch.uint8, device=DEV)
            break
        except torch.OutOfMemoryError:
            continue
    else:
        pytest.fail(f"could not fill the card's {free} free bytes to within 16 MiB")
    del hog, primers  # cached, not returned to the driver
    left = torch.cuda.mem_get_info()[0]
    assert left < 20 << 20, f"{left} bytes free: a new 20 MiB segment fits"


def _allocator_counts() -> dict:
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k) for k in ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free")}


def test_a_capture_gets_the_memory_the_cache_holds():
    """BackwardGraphs._capture on a body that needs a new 64 MiB segment while the card's free memory is all
    in PyTorch's cache: a capture cannot take cached blocks (the allocator frees none for it), so the first
    attempt runs out of memory, as the bench's prod_t40_b16k_sigma did on the H200 after another shape had
    filled the cache (session 50); the second, after the cache is freed, captures. The replay computes what
    the body does. Between the fill and the capture only the capture's own start allocates (see the module
    test below), from the cached small block."""
    graphs = BackwardGraphs()
    src = torch.arange(1 << 24, dtype=torch.float32, device=DEV)  # 64 MiB
    dst = torch.zeros_like(src)
    stream = torch.cuda.current_stream(DEV).stream_id

    def body(x, y):
        y.copy_(x * 2 + 1)  # x * 2: 64 MiB of the capture's pool

    # A first capture, of a body that allocates nothing, makes the side stream captures run on while the
    # card is free (a module makes it on a key's first call): were it the process's first stream, made after
    # the fill, it would free the cache itself (launch.new_stream; the test below).
    graphs._capture(lambda y: y.zero_(), (dst,), DEV, stream)
    _cache_the_card(graphs._side)
    before = _allocator_counts()
    graph = graphs._capture(body, (src, dst), DEV, stream)
    graph.replay()
    torch.cuda.synchronize()
    assert (graphs.captures, graphs.capture_retries) == (2, 1), (before, _allocator_counts())
    assert torch.equal(dst, src * 2 + 1)


def _in_a_fresh_process(script: str, tmp_path) -> str:
    """Runs ``script`` in a new Python process from the repository root, from a file (Triton reads a kernel's
    source from its file) with the root on its path as ``python -c`` would have it, and returns its stdout
    once it has exited cleanly."""
    path = tmp_path / "fresh.py"
    path.write_text(script)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


# Run in a fresh process: what needs driver memory is the process's first stream request of the device, which
# creates PyTorch's stream pool (c10's getStreamFromPool: 32 streams per priority, made at once); later
# torch.cuda.Stream() calls hand out pool streams and allocate nothing.
_FIRST_STREAM = r"""
import sys

import torch

sys.path.insert(0, "tests/gpu")
from test_gpu_graphs import DEV, _cache_the_card  # noqa: E402  (no stream: the current one only)

from torchrec_triton_tbe.ops import launch  # noqa: E402

_cache_the_card()
frees = []
empty_cache = torch.cuda.empty_cache
torch.cuda.empty_cache = lambda: (frees.append(torch.cuda.mem_get_info()[0]), empty_cache())
side = launch.new_stream(DEV)
with torch.cuda.stream(side):
    x = torch.full((1 << 20,), 3.0, device=DEV) * 2
side.synchronize()
assert torch.equal(x, torch.full_like(x, 6.0))
print("cache frees:", len(frees))
"""


def test_the_first_stream_is_made_when_the_cache_holds_the_card(tmp_path):
    """A process's first CUDA stream (PyTorch's stream pool, above) takes driver memory outside PyTorch's
    cache: with the cache holding the card it failed with CUDA's out-of-memory error (the H100, session 52:
    the first version of the capture tests above met it in the capture's side stream, then in the bucket
    streams). launch.new_stream frees the cache once and makes it; work queued on it runs. One free: the
    first attempt failed, as on the H100 (if a card ever fits the pool in the fill's margin, this says so)."""
    out = _in_a_fresh_process(_FIRST_STREAM, tmp_path)
    assert "cache frees: 1" in out, f"the pool was made without freeing the cache: {out!r}"


# Also a fresh process: a kernel's module is loaded once per process, at its first launch.
_FIRST_LOAD = r"""
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "tests/gpu")
from test_gpu_graphs import DEV, _cache_the_card  # noqa: E402

from torchrec_triton_tbe.ops import launch  # noqa: E402


@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + o, tl.load(x_ptr + o, mask=o < n) + 1.0, mask=o < n)


x = torch.zeros(1 << 16, device=DEV)
launch.new_stream(DEV)  # the stream pool first: only the module load is left to need driver memory
_add_one.warmup(x, x.numel(), BLOCK=256, grid=(1,))  # compiled into Triton's cache, not loaded
_cache_the_card()
print("free before the load:", torch.cuda.mem_get_info()[0])
launch.launch(_add_one, (x.numel() // 256,), (x, x.numel()), dict(BLOCK=256), 4)
torch.cuda.synchronize()
assert torch.equal(x, torch.ones_like(x))
print("loaded and ran")
"""


def test_a_kernel_first_launched_when_the_cache_holds_the_card_loads_and_runs(tmp_path):
    """A kernel's first launch in a process loads its module (cuModuleLoadData), which takes driver memory
    outside PyTorch's cache, as the stream pool does. With the cache holding the card (a new batch shape late
    in a run) the kernel still loads and computes: on the H100 (session 53) with 2.2 MB free, where the stream
    pool had failed. Nothing retries a failed load (docs/reliability.md says why); this test is the evidence
    that none is needed at the fill's margin, and fails if a driver or Triton ever needs more."""
    out = _in_a_fresh_process(_FIRST_LOAD, tmp_path)
    assert "loaded and ran" in out, out


def test_a_module_backward_captures_when_the_cache_holds_the_card():
    """The same through a module: the cache holds the card when a key's second backward captures; the
    capture is retried once and the replayed step equals the eager module's bit for bit. The cached small
    block matters here: the capture's start allocates the default generator's graph state (two int64[1]
    tensors, PyTorch's CUDAGraph::capture_begin), and with no room for their 2 MiB segment that eager
    allocation would fail and free every cached block, the fill included (the likely reason the first
    version of this test, without it, saw no retry on the H100 in session 51). The key's first call, step 0,
    made the capture's streams (ops/graphs.py), before the fill."""
    graphed, eager = two_modules(EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    idx, off, _ = batch(0, nb=8192)  # ~470 k lookups: the capture's scratch needs new 20 MiB segments
    for step in range(2):
        outs = [m(idx, off) for m in (graphed, eager)]
        grad = torch.randn(outs[0].shape, device=DEV, generator=torch.Generator(DEV).manual_seed(step))
        if step == 1:
            _cache_the_card(graphed._backward_graphs._side)
            before = _allocator_counts()
        for m, out in enumerate(outs):
            out.backward(grad)
            if step == 1 and m == 0:
                after = _allocator_counts()  # the graphed module's backward only, before the eager one's
    torch.cuda.synchronize()
    g = graphed._backward_graphs
    # The counts tell a capture that never ran out of memory from a fill undone before it (an eager
    # allocation's failure frees every cached block: num_alloc_retries and num_device_free move).
    assert (g.captures, g.capture_retries) == (1, 1), (before, after)
    assert torch.equal(graphed.weights, eager.weights)
    assert torch.equal(graphed.momentum1, eager.momentum1)
