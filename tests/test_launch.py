"""ops/launch.py: the cached launch path keys compiled kernels on every property Triton specializes
on, replays a hit through the compiled kernel's launcher with the constexprs in signature order, and
recompiles (through kernel[grid]) whenever a property changes. On CPU the GPU side is faked; the GPU
tests run every kernel through the real thing (each launch after the first is a cache hit)."""

import types

import pytest
import torch

from torchrec_triton_tbe.ops import launch as launch_mod


def test_arg_key_separates_what_triton_specializes_on():
    buf = torch.zeros(64, dtype=torch.float32)
    keys = [
        launch_mod.arg_key((x,))
        for x in (1, 2, 16, 32, -16, 2**31, True, 1.0, None, buf, buf[4:], buf[1:], buf.to(torch.float16))
    ]
    # 16, 32 and -16 share a key (divisible by 16, 32-bit), as buf and buf[4:] do (16-byte aligned).
    assert keys[2] == keys[3] == keys[4] and keys[9] == keys[10]
    distinct = [k for i, k in enumerate(keys) if i not in (3, 4, 10)]
    assert len(set(distinct)) == len(distinct)
    # A value in the key changes only with what Triton looks at: not 2 -> 3, not one aligned buffer -> another.
    assert launch_mod.arg_key((2, buf)) == launch_mod.arg_key((3, torch.ones(8)))


class _FakeCompiled:
    def __init__(self, calls):
        self.calls = calls
        self.function = "fn"
        self.packed_metadata = "meta"

    def launch_metadata(self, grid, stream, *args):
        return ("lm", grid)

    def run(self, *args):
        self.calls.append(("run", args))


class _FakeKernel:
    """Parameters (a, b, N, BLOCK: constexpr, MODE: constexpr = 7)."""

    def __init__(self):
        self.calls = []
        self.params = [types.SimpleNamespace(name=n, default=d) for n, d in
                       (("a", None), ("b", None), ("N", None), ("BLOCK", None), ("MODE", 7))]

    def __getitem__(self, grid):
        def compile_and_run(*args, **kwargs):
            self.calls.append(("jit", grid, args, kwargs))
            return _FakeCompiled(self.calls)

        return compile_and_run


@pytest.fixture
def fake_gpu(monkeypatch):
    driver = types.SimpleNamespace(
        active=types.SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 1234)
    )
    monkeypatch.setattr(launch_mod, "driver", driver)
    monkeypatch.setattr(launch_mod, "_INTERPRETED", False)
    monkeypatch.setattr(launch_mod, "_COMPILED", {})


def test_hit_replays_through_the_compiled_launcher(fake_gpu):
    kernel = _FakeKernel()
    a, b = torch.zeros(8), torch.zeros(8, dtype=torch.int32)
    first = launch_mod.launch(kernel, (5,), (a, b, 32), dict(BLOCK=64), 2)
    assert kernel.calls == [("jit", (5,), (a, b, 32), dict(BLOCK=64, num_warps=2))]
    kernel.calls.clear()
    a2, b2 = torch.ones(8), torch.ones(8, dtype=torch.int32)
    assert launch_mod.launch(kernel, (3, 2), (a2, b2, 48), dict(BLOCK=64), 2) is first
    (tag, args), = first.calls[-1:]
    assert tag == "run"
    # grid (x, y, z), stream, function, packed metadata, launch metadata, two hooks, then every
    # parameter in signature order: the runtime ones, BLOCK, MODE's default.
    assert args[:6] == (3, 2, 1, 1234, "fn", "meta")
    assert args[6] == ("lm", (3, 2))
    assert args[9:11] == (a2, b2) and args[11:] == (48, 64, 7)
    assert [c[0] for c in kernel.calls] == ["run"]


def test_a_given_stream_is_launched_on_without_becoming_current(fake_gpu, monkeypatch):
    # forward.py's bucket launches: a hit hands the stream's handle to the launcher directly; a miss
    # compiles and launches through kernel[grid] with the stream made current for that call only.
    entered = []

    class _Ctx:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            entered.append(self.stream)

        def __exit__(self, *exc):
            entered.append("exit")

    monkeypatch.setattr(launch_mod.torch.cuda, "stream", _Ctx)
    side = types.SimpleNamespace(cuda_stream=777, device_index=0)
    kernel = _FakeKernel()
    a, b = torch.zeros(8), torch.zeros(8, dtype=torch.int32)
    first = launch_mod.launch(kernel, (5,), (a, b, 32), dict(BLOCK=64), 2, stream=side)
    assert entered == [side, "exit"]
    assert [c[0] for c in kernel.calls] == ["jit"]
    entered.clear()
    assert launch_mod.launch(kernel, (5,), (a, b, 32), dict(BLOCK=64), 2, stream=side) is first
    assert entered == []
    assert first.calls[-1][1][3] == 777
    launch_mod.launch(kernel, (5,), (a, b, 32), dict(BLOCK=64), 2)
    assert first.calls[-1][1][3] == 1234 and entered == []
    # A stream of another device: compiled under that device's context, so never kept for a hit here.
    other = types.SimpleNamespace(cuda_stream=888, device_index=1)
    kernel2 = _FakeKernel()
    for _ in range(2):
        launch_mod.launch(kernel2, (5,), (a, b, 32), dict(BLOCK=64), 2, stream=other)
    assert [c[0] for c in kernel2.calls] == ["jit", "jit"] and entered == [other, "exit"] * 2


@pytest.mark.parametrize(
    "change",
    [
        lambda a, b, n, cx, w: (a[1:], b, n, cx, w),  # misaligned pointer
        lambda a, b, n, cx, w: (a.double(), b, n, cx, w),  # dtype
        lambda a, b, n, cx, w: (a, b, 33, cx, w),  # no longer divisible by 16
        lambda a, b, n, cx, w: (a, b, 1, cx, w),  # equal to 1
        lambda a, b, n, cx, w: (a, b, 2**40, cx, w),  # 64-bit
        lambda a, b, n, cx, w: (a, b, n, dict(BLOCK=128), w),  # constexpr
        lambda a, b, n, cx, w: (a, b, n, cx, 4),  # num_warps
        lambda a, b, n, cx, w: (a, b, n, cx, (w, 96)),  # a register cap
    ],
)
def test_any_specialization_change_recompiles(fake_gpu, change):
    kernel = _FakeKernel()
    base = (torch.zeros(8), torch.zeros(8, dtype=torch.int32), 32, dict(BLOCK=64), 2)
    launch_mod.launch(kernel, (1,), base[:3], base[3], base[4])
    a, b, n, cx, w = change(*base)
    kernel.calls.clear()
    w, maxnreg = w if isinstance(w, tuple) else (w, None)
    launch_mod.launch(kernel, (1,), (a, b, n), cx, w, maxnreg=maxnreg)
    assert [c[0] for c in kernel.calls] == ["jit"]


def test_register_cap_reaches_triton_only_when_set(fake_gpu):
    # Left out when None: Triton then compiles (and caches) exactly what it did before the knob.
    kernel = _FakeKernel()
    args = (torch.zeros(8), torch.zeros(8, dtype=torch.int32), 32)
    launch_mod.launch(kernel, (1,), args, dict(BLOCK=64), 2)
    launch_mod.launch(kernel, (1,), args, dict(BLOCK=64), 2, maxnreg=96)
    assert [c[3] for c in kernel.calls if c[0] == "jit"] == [dict(BLOCK=64, num_warps=2),
                                                             dict(BLOCK=64, num_warps=2, maxnreg=96)]
    with launch_mod.recording([]) as pending:
        launch_mod.launch(kernel, (1,), args, dict(BLOCK=64), 2, maxnreg=96)
    assert pending[0].options == {"num_warps": 2, "maxnreg": 96}
    assert pending[0].site(0) != launch_mod.Launch(kernel, (1,), args, dict(BLOCK=64), 2).site(0)


def test_interpreter_always_goes_through_the_jit(monkeypatch):
    kernel = _FakeKernel()
    monkeypatch.setattr(launch_mod, "_INTERPRETED", True)
    for _ in range(2):
        launch_mod.launch(kernel, (1,), (torch.zeros(8), torch.zeros(8), 16), dict(BLOCK=8), 1)
    assert [c[0] for c in kernel.calls] == ["jit", "jit"]


def test_host_grid_arithmetic_matches_triton():
    import triton

    for a in range(0, 3000, 7):
        assert launch_mod.next_pow2(a) == triton.next_power_of_2(a)
        for b in (1, 2, 3, 16, 1024):
            assert launch_mod.cdiv(a, b) == triton.cdiv(a, b)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_grid_y_slices_cover_every_entry_once_and_keep_the_specialization(dtype):
    """Up to CUDA's 65,535 a feature list is one launch, itself (no view); past it, slices of at most
    that many, each but the last 65,520 (a multiple of 16 entries), so every slice's pointer keeps the
    whole list's 16-byte alignment and its arg_key: one compiled kernel for all slices."""
    assert launch_mod.grid_y_chunks(0) == [(0, 0)] and launch_mod.grid_y_chunks(65535) == [(0, 65535)]
    whole = torch.arange(65535, dtype=dtype)
    assert launch_mod.grid_y_slices(whole)[0] is whole
    for n in (65536, 2 * 65535 + 3):
        features = torch.arange(n, dtype=dtype)
        slices = launch_mod.grid_y_slices(features)
        assert torch.equal(torch.cat(slices), features)
        assert all(s.numel() <= launch_mod.MAX_GRID_Y for s in slices)
        assert {launch_mod.arg_key((s,)) for s in slices} == {launch_mod.arg_key((features,))}


class _Streams:
    """torch.cuda.Stream stand-in: raises the queued errors first, then makes "streams"; counts the cache frees."""

    def __init__(self, monkeypatch, errors, capturing=False):
        self.errors, self.made, self.freed = list(errors), [], 0
        monkeypatch.setattr(torch.cuda, "Stream", self.stream)
        monkeypatch.setattr(torch.cuda, "empty_cache", self.empty_cache)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)

    def stream(self, device=None):
        if self.errors:
            raise self.errors.pop(0)
        self.made.append(device)
        return f"stream{len(self.made)}"

    def empty_cache(self):
        self.freed += 1


# CUDA's out-of-memory error as PyTorch raised it from the stream pool's cudaStreamCreate when the cache held the
# card (the H100, session 52): torch.AcceleratorError, a RuntimeError (where this torch has it).
_OOM = getattr(torch, "AcceleratorError", RuntimeError)(
    "CUDA error: out of memory\nSearch for `cudaErrorMemoryAllocation' in https://docs.nvidia.com"
)


def test_a_stream_that_finds_no_memory_frees_the_cache_once_and_is_made(monkeypatch):
    fake = _Streams(monkeypatch, [_OOM])
    assert launch_mod.new_stream(3) == "stream1"
    assert (fake.made, fake.freed) == ([3], 1)


def test_a_second_out_of_memory_is_raised(monkeypatch):
    fake = _Streams(monkeypatch, [_OOM, _OOM])
    with pytest.raises(RuntimeError, match="out of memory"):
        launch_mod.new_stream(0)
    assert (fake.made, fake.freed) == ([], 1)


@pytest.mark.parametrize(
    "error, capturing", [(_OOM, True), (RuntimeError("CUDA error: invalid device ordinal"), False)]
)
def test_no_cache_free_inside_a_capture_or_for_other_errors(monkeypatch, error, capturing):
    """Freeing memory during a capture is not allowed, and other errors have nothing to do with memory:
    raised as they are, the cache untouched."""
    fake = _Streams(monkeypatch, [error], capturing=capturing)
    with pytest.raises(RuntimeError) as raised:
        launch_mod.new_stream(0)
    assert raised.value is error and (fake.made, fake.freed) == ([], 0)


def test_side_streams_are_made_once_per_device_and_shared(monkeypatch):
    fake = _Streams(monkeypatch, [_OOM])
    monkeypatch.setattr(launch_mod, "_SIDE_STREAMS", {})
    device = torch.device("cuda", 1)
    assert launch_mod.side_streams(device, 2) == ["stream1", "stream2"]
    assert launch_mod.side_streams(device, 3) == ["stream1", "stream2", "stream3"]
    assert launch_mod.side_streams(device, 1) == ["stream1"]
    assert (fake.made, fake.freed) == ([1, 1, 1], 1)
