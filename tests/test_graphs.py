"""ops/graphs.py on the CPU: the padding a replay relies on changes no bit, the static lookup counts,
the cache's first-call / eviction bookkeeping, and the config knobs. Capture and replay themselves
need a GPU (tests/gpu/test_gpu_graphs.py)."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tbe_cases import EmbOptimType, SparseType, make_pair, skewed_batch
from torchrec_triton_tbe.config import KernelConfig, load_named
from torchrec_triton_tbe.ops import backward as bwd_ops
from torchrec_triton_tbe.ops.graphs import PAD_BITS, BackwardGraphs, padded_lookups

SPECS = [(30, 8), (20, 12)]
FTM = [0, 1, 1]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.integers(min_value=0, max_value=1 << 40))
def test_padded_lookups_bounds(n):
    p = padded_lookups(n)
    assert n <= p <= n + (n >> PAD_BITS)
    assert padded_lookups(p) == p  # a static count is its own static count


def test_padded_lookups_coalesce_nearby_sizes():
    # Batches whose N moves by +-5 % around 327,680 (FBGEMM's default shape) share a few static counts.
    sizes = {padded_lookups(n) for n in range(311_296, 344_065, 97)}
    assert len(sizes) <= 4, sorted(sizes)
    assert padded_lookups(327_680) == 327_680


def _train_step(module, batch, grad, pad_to=None, garbage=0):
    """One backward through ops/backward.backward_step on the module's state, ids optionally padded
    with `garbage` ids past the last bag (as a replay's static buffers are)."""
    idx, off, psw = batch.indices, batch.offsets, batch.per_sample_weights
    if pad_to is not None:
        extra = pad_to - idx.numel()
        idx = torch.cat([idx, torch.full((extra,), garbage, dtype=idx.dtype)])
        if psw is not None:
            psw = torch.cat([psw, torch.full((extra,), 7.0, dtype=psw.dtype)])
    module.iter.add_(1)  # as the forward does: the backward applies its forward's count
    state = module.optimizer_tensors()
    B = (off.numel() - 1) // module.T
    bwd_ops.backward_step(module.spec, state, None, idx, off, grad, psw, B)


@pytest.mark.parametrize("optimizer", [EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.ADAM,
                                       EmbOptimType.PARTIAL_ROWWISE_LAMB])
@pytest.mark.parametrize("weighted", [False, True])
def test_padding_past_the_last_bag_changes_no_bit(optimizer, weighted):
    """A replay runs on ids padded to padded_lookups(N) with whatever an earlier batch left there
    (lookups outside every bag): the result must equal the unpadded backward bit for bit."""
    results = []
    for pad in (False, True):
        ours, _ = make_pair(SPECS, FTM, oracle="reference", seed=3, optimizer=optimizer,
                            weights_precision=SparseType.FP16, learning_rate=0.2, eps=0.01)
        g = torch.Generator().manual_seed(4)
        for step in range(3):
            batch = skewed_batch([r for r, _ in SPECS], FTM, B=4, max_L=7, generator=g, weighted=weighted,
                                 hot_fraction=0.4, min_L=1)
            grad = torch.randn(4, ours.total_D, generator=g)
            n = batch.indices.numel()
            _train_step(ours, batch, grad, pad_to=n + 5 + step if pad else None, garbage=step % 2)
        results.append([ours.weights.clone(), ours.momentum1.clone(), ours.momentum2.clone(), ours.iter.clone()])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert int(results[0][-1]) == 3


def _spec_with(graph_cache: int, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD):
    m, _ = make_pair(SPECS, FTM, oracle="reference", seed=0, optimizer=optimizer)
    cfg = m.kernel_config.replace_backward(graph_cache=graph_cache)
    return m, dataclasses.replace(m.spec, config=cfg)


@pytest.mark.parametrize("optimizer", [EmbOptimType.ADAM, EmbOptimType.EXACT_ROWWISE_ADAGRAD])
def test_first_call_of_a_key_runs_eagerly_on_padded_static_copies(optimizer):
    m, spec = _spec_with(graph_cache=2, optimizer=optimizer)
    graphs = BackwardGraphs()
    state = m.optimizer_tensors()
    seen = []

    def body(st, i, o, g, w):
        seen.append((st, i, o, g, w))

    # Three keys (static counts 1024, 1536, 2304), then the first again: graph_cache=2 dropped it, so
    # it starts over with an eager call (a second call of a live key would capture: not on a CPU).
    for n in (1000, 1500, 2100, 1000):
        idx = torch.arange(n) % 20
        off = torch.tensor([0, n // 3, n // 2, n], dtype=torch.int64)
        grad = torch.randn(1, m.total_D)
        step = torch.tensor([n], dtype=torch.int64)  # the forward's own count (autograd.StepVersion)
        graphs.run(spec, state, idx, off, grad, None, step, 1, body)
        st, i, o, g, w = seen[-1]
        # The count is a static input as the ids: loaded into the key's own slot, not the module's iter;
        # only where the update reads it (spec.reads_step_count): row-wise Adagrad's slot stays 0, unread.
        loaded = step if spec.reads_step_count else torch.zeros_like(step)
        assert torch.equal(st.step, loaded) and st.step.data_ptr() not in (step.data_ptr(), state.step.data_ptr())
        assert st.weights is state.weights and st.learning_rate is state.learning_rate
        assert i.numel() == padded_lookups(n) and torch.equal(i[:n], idx)
        assert torch.equal(o, off) and w is None
        assert i.data_ptr() != idx.data_ptr() and o.data_ptr() != off.data_ptr()
        assert g is grad  # the gradient is read in place, not copied (ops/graphs.py)
    assert len(seen) == 4
    assert len(graphs) == 2 and graphs.captures == 0 and graphs.replays == 0


def test_gradient_slots_read_in_place_until_the_addresses_vary():
    """Which graph a gradient replays (ops/graphs.py _Entry.grad_slot): its own address's while a key
    has fewer than DIRECT_GRAPHS of them; an unaligned one, or one more address after that, the
    static copy's (None), whose buffer then holds the gradient's values."""
    from torchrec_triton_tbe.ops import graphs as graph_ops

    m, spec = _spec_with(graph_cache=2)
    idx, off = torch.arange(6) % 20, torch.tensor([0, 2, 4, 6])
    entry = graph_ops._Entry(spec, idx, off, None, torch.zeros(1, dtype=torch.int64), 8, None)
    held = []  # alive, so every gradient below has an address of its own
    for _ in range(graph_ops.DIRECT_GRAPHS):
        g = torch.randn(1, m.total_D)
        assert entry.grad_slot(g) == g.data_ptr()
        entry.graphs[g.data_ptr()] = object()  # what a capture leaves (a graph)
        assert entry.grad_slot(g) == g.data_ptr()  # its own graph again
        held.append(g)
    newcomer = torch.randn(1, m.total_D)
    assert entry.grad_slot(newcomer) is None  # DIRECT_GRAPHS addresses taken: the copy
    unaligned = torch.randn(m.total_D + 1)[1:].view(1, -1)
    assert unaligned.data_ptr() % 16 != 0
    assert entry.grad_slot(unaligned) is None
    copy = entry.static_grad(newcomer)
    assert torch.equal(copy, newcomer) and copy.data_ptr() != newcomer.data_ptr()
    assert entry.static_grad(unaligned).data_ptr() == copy.data_ptr()  # one buffer, reused
    assert torch.equal(copy, unaligned)


def test_graphs_never_apply_on_cpu_or_when_disabled():
    m, spec = _spec_with(graph_cache=8)
    assert not BackwardGraphs.applies(spec, 100, torch.device("cpu"))
    off = dataclasses.replace(spec, config=spec.config.replace_backward(graph_max_lookups=0))
    assert not BackwardGraphs.applies(off, 100, torch.device("cpu"))
    assert load_named("interpreter").backward.graph_max_lookups == 0
    assert load_named("sm90").backward.graph_max_lookups > 0


def test_graph_knobs_are_validated():
    d = {
        "target": "x",
        "forward": {"bags_per_program": 1, "gather": 4, "num_warps": 1},
        "transpose": {"bags_per_program": 4, "lookups_per_step": 4, "num_warps": 1},
        "backward": {"short_threshold": 4, "long_chunk": 3, "tile": 4, "num_warps": 1, "graph_max_lookups": 5,
                     "graph_cache": 3},
    }
    cfg = KernelConfig.from_dict(d)
    assert (cfg.backward.graph_max_lookups, cfg.backward.graph_cache) == (5, 3)
    with pytest.raises(ValueError, match="graph_cache"):
        KernelConfig.from_dict({**d, "backward": {**d["backward"], "graph_cache": 0}})
    with pytest.raises(ValueError, match="graph_max_lookups"):
        KernelConfig.from_dict({**d, "backward": {**d["backward"], "graph_max_lookups": -1}})


def test_copies_of_a_module_start_without_graphs():
    import copy
    import pickle

    graphs = BackwardGraphs()
    graphs.captures = 3
    assert copy.deepcopy(graphs).captures == 0
    assert pickle.loads(pickle.dumps(graphs)).captures == 0


def test_a_capture_that_runs_out_of_memory_is_retried_once_after_freeing_the_cache(monkeypatch):
    """During a capture the caching allocator does not free its cached blocks to retry (an eager
    allocation does), so _capture frees the cache once the failed attempt (and the graph pool its
    traceback holds) is gone, and tries again; a second failure is raised, and so is a first one whose
    capture could not be ended. The capture itself needs a GPU (tests/gpu/test_gpu_graphs.py); here its
    attempts are stand-ins."""
    import weakref

    from torchrec_triton_tbe.ops import graphs as graphs_ops

    class Pool:  # stands for the failed graph and the blocks its pool got
        pass

    held, alive_at_release, outcomes = [], [], []

    def attempt(self, body, statics, device, stream):
        outcome = outcomes.pop(0)
        if outcome.startswith("oom"):
            pool = Pool()
            held.append(weakref.ref(pool))
            error = torch.OutOfMemoryError("CUDA out of memory (simulated)")
            if outcome == "oom-not-ended":
                error.add_note(f"{graphs_ops._NOT_ENDED}: RuntimeError('capture invalidated')")
            raise error
        return outcome

    monkeypatch.setattr(BackwardGraphs, "_capture_once", attempt)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: alive_at_release.append(held[-1]() is not None))
    graphs = BackwardGraphs()
    outcomes[:] = ["graph"]
    assert graphs._capture(None, (), torch.device("cpu"), None) == "graph"
    assert graphs.capture_retries == 0 and alive_at_release == []
    outcomes[:] = ["oom", "graph"]
    assert graphs._capture(None, (), torch.device("cpu"), None) == "graph"
    assert graphs.capture_retries == 1 and alive_at_release == [False]
    outcomes[:] = ["oom", "oom"]
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        graphs._capture(None, (), torch.device("cpu"), None)
    assert graphs.capture_retries == 2 and alive_at_release == [False, False]
    # A failed capture that could not be ended is not retried (its pool may still take allocations).
    outcomes[:] = ["oom-not-ended", "graph"]
    with pytest.raises(torch.OutOfMemoryError, match="simulated") as raised:
        graphs._capture(None, (), torch.device("cpu"), None)
    assert graphs.capture_retries == 2 and outcomes == ["graph"]
    assert any("ending the failed capture failed too" in note for note in raised.value.__notes__)


def test_a_key_first_call_makes_the_streams_its_capture_will_use(monkeypatch):
    """The capture's side stream and the backward's bucket side streams are made on a key's first call
    (ops/graphs.py _make_streams): creating a stream takes driver memory, which a later capture could not
    free the cache for (launch.new_stream). Made once: a second key makes none."""
    from torchrec_triton_tbe.ops import launch as launch_ops

    m, spec = _spec_with(graph_cache=2)
    asked = []
    graphs = BackwardGraphs()
    monkeypatch.setattr(graphs, "_make_streams", lambda device, n=1: asked.append((device.type, n)))
    for n in (1000, 1500):  # two keys, each on its first call
        off = torch.tensor([0, n // 3, n // 2, n], dtype=torch.int64)
        graphs.run(spec, m.optimizer_tensors(), torch.arange(n) % 20, off, torch.randn(1, m.total_D), None,
                   torch.tensor([1]), 1, lambda *statics: None)
    assert asked == [("cpu", spec.config.backward.bucket_streams)] * 2

    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: made.append(device) or f"stream{len(made)}")
    monkeypatch.setattr(launch_ops, "_SIDE_STREAMS", {})
    graphs = BackwardGraphs()
    cuda = torch.device("cuda", 0)
    graphs._make_streams(cuda, 4)
    assert graphs._side == "stream1" and launch_ops._SIDE_STREAMS[0] == ["stream2", "stream3", "stream4"]
    graphs._make_streams(cuda, 4)
    graphs._make_streams(cuda)  # what _capture asks for: the side stream only
    assert len(made) == 4
    graphs._make_streams(torch.device("cpu"), 4)  # off CUDA: nothing
    assert len(made) == 4
