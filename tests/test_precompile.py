"""Precompiling a step's kernels (TritonTBE.precompile, ops/precompile.py), on the CPU: the dry run
records every launch the real step issues and changes no state (weights, optimizer state, step counter,
graph cache, the caller's per-sample weights); the distinct specializations are compiled on a thread
pool and handed to launch's cache under the keys the real launches look up. Under the interpreter
nothing is compiled and the report says so. tests/gpu/test_gpu_training.py checks on the GPU that a
precompiled step compiles nothing and trains bit for bit as one that was not."""

import threading

import pytest
import torch

from tbe_cases import BoundsCheckMode, EmbOptimType, PoolingMode, SparseType, skewed_batch
from torchrec_triton_tbe.module import TritonTBE
from torchrec_triton_tbe.ops import launch as launch_ops
from torchrec_triton_tbe.ops.precompile import record_step

SPECS = [(50, 8), (30, 16), (20, 24), (40, 128)]
FTM = [0, 1, 1, 2, 3]


def _module(**kwargs) -> TritonTBE:
    m = TritonTBE(SPECS, feature_table_map=FTM, device="cpu", learning_rate=0.1, **kwargs)
    m.init_embedding_weights_uniform(-1, 1)
    return m


def _batch(weighted=False, seed=0):
    return skewed_batch([r for r, _ in SPECS], FTM, B=8, max_L=6, generator=torch.Generator().manual_seed(seed),
                        weighted=weighted)


def _state(m) -> dict:
    return {name: buf.clone() for name, buf in m.named_buffers()}


def _real_launches(m, indices, offsets, psw=None, vbe=None) -> list:
    """What launch() is asked during a real step (spied; the step runs)."""
    seen = []
    original = launch_ops.launch

    def spy(kernel, grid, args, constexprs, num_warps, key=None, stream=None, maxnreg=None):
        seen.append(launch_ops.Launch(kernel, tuple(grid), tuple(args), dict(constexprs), num_warps, maxnreg))
        return original(kernel, grid, args, constexprs, num_warps, key, stream, maxnreg)

    modules = [mod for mod in _launch_users()]
    for mod in modules:
        mod.launch = spy
    try:
        extra = {} if vbe is None else {"batch_size_per_feature_per_rank": vbe}
        out = m(indices, offsets, psw, **extra)
        out.backward(torch.ones_like(out))
    finally:
        for mod in modules:
            mod.launch = original
    return seen


def _launch_users() -> list:
    import sys

    return [mod for name, mod in sys.modules.items()
            if name.startswith("torchrec_triton_tbe.ops.") and getattr(mod, "launch", None) is launch_ops.launch]


@pytest.mark.parametrize("kwargs,weighted", [
    (dict(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD), False),
    (dict(optimizer=EmbOptimType.ADAM, weights_precision=SparseType.FP32, pooling_mode=PoolingMode.MEAN), True),
    (dict(optimizer=EmbOptimType.EXACT_SGD, hoist_transpose=True, fused_bounds_check=True), False),
], ids=["rowwise", "adam-mean-weighted", "sgd-hoist-fused-bounds"])
def test_dry_run_records_the_real_steps_launches_and_changes_nothing(kwargs, weighted):
    m = _module(**kwargs)
    batch = _batch(weighted)
    psw = None if batch.per_sample_weights is None else batch.per_sample_weights.clone().requires_grad_(True)
    before = _state(m)
    recorded = record_step(m, batch.indices, batch.offsets, psw)
    after = _state(m)
    assert sorted(before) == sorted(after)
    for name in before:
        assert torch.equal(before[name], after[name]), f"the dry run changed {name}"
    assert len(m._backward_graphs) == 0 and m._last_runs is None and m._cached_call is None
    assert psw is None or psw.grad is None, "the dry run left a gradient in the caller's per-sample weights"
    real = _real_launches(m, batch.indices, batch.offsets, psw)
    # The real step after the dry run is the first step (SGD's forward, as FBGEMM's, counts nothing).
    assert int(m.iter) == int(m.spec.advances_step_count)
    device = m.current_device
    assert [r.site(device) for r in recorded] == [r.site(device) for r in real]
    assert [r.grid for r in recorded] == [r.grid for r in real]


def test_precompile_compiles_each_specialization_once_on_a_pool_and_hands_it_to_launch():
    from torchrec_triton_tbe.ops.precompile import precompile

    m = _module(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    batch = _batch()
    threads, compiled = set(), []
    lock = threading.Lock()

    def fake_compile(recorded):
        with lock:
            threads.add(threading.current_thread().name)
            compiled.append(recorded.site(m.current_device))
        return ("compiled", recorded.kernel.fn.__name__)

    sites_before = set(launch_ops._COMPILED)
    try:
        report = precompile(m, batch.indices, batch.offsets, workers=3, compile_fn=fake_compile)
        assert report.compiled and report.workers == 3
        assert report.specializations == len(compiled) == len(set(compiled)) <= report.launches
        assert all(name.startswith("triton_tbe_precompile") for name in threads)
        for site in compiled:
            held, tail = launch_ops._COMPILED[site]
            assert held[0] == "compiled"
        assert set(report.kernels) >= {"_pooled_forward_kernel", "_backward_short_kernel", "_linearize_kernel"}
    finally:
        for site in set(launch_ops._COMPILED) - sites_before:
            del launch_ops._COMPILED[site]
    assert int(m.iter) == 0


def test_precompile_under_the_interpreter_compiles_nothing_and_says_so():
    m = _module(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    batch = _batch()
    report = m.precompile(batch.indices, batch.offsets)
    assert not report.compiled and report.seconds == 0.0 and report.specializations > 0
    out = m(batch.indices, batch.offsets)  # the step runs as it would
    out.backward(torch.ones_like(out))
    assert int(m.iter) == 1


def test_record_step_is_not_reentrant():
    m = _module()
    batch = _batch()
    with launch_ops.recording([]):
        with pytest.raises(RuntimeError, match="not re-entrant"):
            record_step(m, batch.indices, batch.offsets)


def test_recording_is_per_thread_and_follows_the_step_into_its_backward():
    """The dry run records the launches of its own thread only: another thread's forward meanwhile runs
    (its output equals the same module's outside any recording), where a process-wide switch recorded
    and dropped its launches and left its output uninitialised. The recorded forward's backward records
    into the same list on whichever thread autograd runs it (on the GPU, autograd's device thread), and
    runs nothing."""
    batch = _batch()
    recorder, busy, twin = _module(), _module(), _module()
    twin.load_state_dict(busy.state_dict())
    want = twin(batch.indices, batch.offsets)
    got, before = {}, _state(recorder)
    with launch_ops.recording([]) as recorded:
        worker = threading.Thread(target=lambda: got.update(out=busy(batch.indices, batch.offsets)))
        worker.start()
        worker.join()
        out = recorder(batch.indices, batch.offsets)
    assert torch.equal(got["out"], want), "another thread's forward was recorded instead of run"
    forward_launches = len(recorded)
    assert forward_launches > 0
    backward = threading.Thread(target=lambda: out.backward(torch.ones_like(out)))
    backward.start()
    backward.join()
    assert len(recorded) > forward_launches, "the recorded step's backward ran instead of being recorded"
    assert launch_ops.recording_into() is None
    for name, buf in recorder.named_buffers():
        if name in ("weights", "momentum1"):
            assert torch.equal(buf, before[name]), name


def test_precompile_first_step_runs_once_on_the_first_training_forward(monkeypatch):
    """The plugin's precompile option: module.precompile_first_step makes the first forward with grad
    enabled call precompile on its batch (once); an earlier no_grad forward does not use it up; training
    is what it would be without the flag."""
    from torchrec_triton_tbe.ops import precompile as pre

    calls = []
    original = pre.precompile

    def counted(module, *args, **kwargs):
        calls.append(module)
        return original(module, *args, **kwargs)

    monkeypatch.setattr(pre, "precompile", counted)
    flagged, plain = _module(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD), _module(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    with torch.no_grad():
        plain.weights.copy_(flagged.weights)
    flagged.precompile_first_step = True
    with torch.no_grad():
        for m in (flagged, plain):
            m(_batch().indices, _batch().offsets)  # an eval forward: counts a step, as FBGEMM's does
    assert calls == []
    for seed in range(3):
        batch = _batch(seed=seed)
        for m in (flagged, plain):
            out = m(batch.indices, batch.offsets)
            out.backward(torch.ones_like(out))
    assert calls == [flagged]
    assert torch.equal(flagged.weights, plain.weights) and torch.equal(flagged.momentum1, plain.momentum1)
    assert int(flagged.iter) == int(plain.iter) == 4


@pytest.mark.parametrize("small", [False, True], ids=["first-launch", "small-tables-torch-ops"])
def test_another_thread_trains_the_module_during_the_dry_run(small):
    """The dry run writes no buffer of the module (no kernel runs; the step count's torch-op fallback, where
    every table is on the small-table path, skips a recorded call) and keeps its own lookup call, graph cache
    and statistics, so it restores nothing. Another thread's training step in the middle of it (started from a
    hook on the dry run's forward; recording is per thread, so its kernels run) leaves the module exactly as
    that step alone would: the same buffers bit for bit (a write-back of the count undid its advance), its
    own cached call and statistics. The module's last stream stays as a forward after the dry run's own set
    it (it was restored to the dry run's)."""
    import copy

    from torchrec_triton_tbe.config import load_named

    kw = dict(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, weights_precision=SparseType.FP16, stochastic_rounding=True)
    if small:
        specs, ftm = [(9, 8), (5, 4)], [0, 1]
        cfg = load_named("interpreter").replace_small_table(max_rows=64, bags=16, groups=2)
        m = TritonTBE(specs, feature_table_map=ftm, device="cpu", learning_rate=0.1, kernel_config=cfg, **kw)
        m.init_embedding_weights_uniform(-1, 1)
        assert all(bucket.small for bucket in m.spec.plan.buckets)
    else:
        specs, ftm, m = SPECS, FTM, _module(**kw)
    assert m.spec.advances_step_count
    m.collect_backward_stats = True
    batch = _batch() if not small else skewed_batch([9, 5], ftm, B=8, max_L=6,
                                                    generator=torch.Generator().manual_seed(2))

    def step(module):
        out = module(batch.indices, batch.offsets)
        out.backward(torch.ones_like(out))

    twin = copy.deepcopy(m)
    step(twin)
    other, started = object(), []

    def another_thread_trains(module, args):  # returns None: the call's arguments stay as they are
        if not started:
            started.append(threading.Thread(target=step, args=(module,)))
            started[0].start()
            started[0].join()

    def another_forward_after(module, args, out):
        if launch_ops.recording_into() is not None:  # the dry run's forward, once it has set its own stream
            module._last_stream.stream = other

    hooks = [m.register_forward_pre_hook(another_thread_trains), m.register_forward_hook(another_forward_after)]
    try:
        record_step(m, batch.indices, batch.offsets)
    finally:
        for hook in hooks:
            hook.remove()
    assert started and m._last_stream.stream is other
    m._last_stream.stream = None
    assert int(m.iter) == int(twin.iter) == 1
    mine, theirs = _state(m), _state(twin)
    assert sorted(mine) == sorted(theirs)
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), f"{name} differs from one real step's"
    assert m.backward_stats() == twin.backward_stats()
    assert m._cached_call is not None and m._cached_call[1].graphs is m._backward_graphs
    for _ in range(2):
        step(m)
    assert int(m.iter) == 3


def test_dry_run_leaves_the_modules_graph_cache_and_lookup_call_alone():
    """A dry run after training has begun: it must not enter (on a GPU: replay) the module's own
    backward-graph cache, and the module's cached LookupCall comes back as it was."""
    m = _module(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    batch = _batch()
    out = m(batch.indices, batch.offsets)
    out.backward(torch.ones_like(out))
    graphs, call = m._backward_graphs, m._cached_call
    assert call is not None
    before = _state(m)
    recorded = record_step(m, batch.indices, batch.offsets)
    assert m._backward_graphs is graphs and m._cached_call is call
    assert all(torch.equal(before[k], v) for k, v in _state(m).items())
    real = _real_launches(m, batch.indices, batch.offsets)
    assert [r.site(m.current_device) for r in recorded] == [r.site(m.current_device) for r in real]
    assert int(m.iter) == 2


_REAL_COMPILE = r"""
import json, sys
from torchrec_triton_tbe import _env
_env.RECORD_LAUNCHES = True   # compiled kernels (no interpreter) while the module lives on CPU tensors
import torch
from torchrec_triton_tbe import aot
from torchrec_triton_tbe._fbgemm import EmbOptimType
from torchrec_triton_tbe.module import TritonTBE
from torchrec_triton_tbe.ops.precompile import precompile
m = TritonTBE([(50, 8), (30, 16), (20, 24), (40, 128)], feature_table_map=[0, 1, 1, 2, 3], device="cpu",
              optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
lengths = torch.tensor([1, 3, 0, 2] * 10)
offsets = torch.zeros(41, dtype=torch.int64)
offsets[1:] = lengths.cumsum(0)
indices = torch.arange(int(offsets[-1])) % 20
report = precompile(m, indices, offsets, workers=2, compile_fn=aot.cubin_compiler(90))
print(json.dumps({"compiled": report.compiled, "specializations": report.specializations, "workers": report.workers,
                  "kernels": sorted(set(report.kernels)), "iter": int(m.iter)}))
"""


def test_precompile_compiles_real_cubins_on_two_threads(tmp_path):
    """The whole of precompile but Triton's warmup (which needs a GPU driver): a step recorded with
    compiled kernels, every specialization lowered to an sm_90 cubin on a pool of two threads."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", _REAL_COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["compiled"] and report["workers"] == 2 and report["iter"] == 0
    assert report["specializations"] >= 10
    assert {"_pooled_forward_kernel", "_backward_short_kernel", "_linearize_kernel"} <= set(report["kernels"])


def _recorded_equals_real(m, indices, offsets, vbe=None):
    before = _state(m)
    recorded = record_step(m, indices, offsets, batch_size_per_feature_per_rank=vbe)
    assert all(torch.equal(before[k], v) for k, v in _state(m).items())
    seen = _real_launches(m, indices, offsets, vbe=vbe)
    assert recorded and [r.site(m.current_device) for r in recorded] == [r.site(m.current_device) for r in seen]


def test_dry_run_of_sequence_and_variable_batch_steps():
    """PoolingMode.NONE (one D for every table) and a variable batch per feature (VBE)."""
    seq = TritonTBE([(50, 16), (30, 16)], feature_table_map=[0, 1, 1], device="cpu", pooling_mode=PoolingMode.NONE,
                    optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    batch = skewed_batch([50, 30], [0, 1, 1], B=4, max_L=5, generator=torch.Generator().manual_seed(1))
    _recorded_equals_real(seq, batch.indices, batch.offsets)
    vbe = _module(optimizer=EmbOptimType.EXACT_SGD)
    sizes = [[3], [5], [2], [4], [1]]  # one rank, a batch size per feature
    lengths = torch.tensor([1, 2, 0, 3, 1, 2, 2, 0, 1, 1, 3, 1, 2, 1, 1])
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    indices = torch.arange(int(offsets[-1])) % 20
    _recorded_equals_real(vbe, indices, offsets, vbe=sizes)
    # FATAL: the dry run records the check's launches but takes no verdict from the padded offsets, which
    # its recorded layout kernel never wrote (the check synced on them and refused the garbage).
    fatal = _module(optimizer=EmbOptimType.EXACT_SGD, bounds_check_mode=BoundsCheckMode.FATAL)
    _recorded_equals_real(fatal, indices, offsets, vbe=sizes)


def test_dry_run_records_the_register_cap():
    """backward.max_registers: the dry run records the capped short-kernel launches exactly as the real
    step makes them (same launch keys), so a precompiled cubin is the one the step's launch finds."""
    from torchrec_triton_tbe.config import KnobTable, load_named

    cfg = load_named("interpreter").replace_backward(max_registers=KnobTable(0, ((128, 96),)))  # SPECS' widest
    m = _module(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, kernel_config=cfg)
    batch = _batch()
    _recorded_equals_real(m, batch.indices, batch.offsets)
    recorded = record_step(m, batch.indices, batch.offsets)
    caps = {r.maxnreg for r in recorded if r.kernel.__name__ == "_backward_short_kernel"}
    assert caps == {96, None}  # the narrower tables' buckets keep the compiler's choice
    assert all(r.maxnreg is None for r in recorded if r.kernel.__name__ != "_backward_short_kernel")


_SMALL_STEP = r"""
import json
from torchrec_triton_tbe import _env
_env.RECORD_LAUNCHES = True   # compiled kernels (no interpreter) while the module lives on CPU tensors
import torch
from torchrec_triton_tbe._fbgemm import EmbOptimType
from torchrec_triton_tbe.module import TritonTBE
m = TritonTBE([(50, 8), (40, 128)], feature_table_map=[0, 1, 1], device="cpu",
              optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
lengths = torch.tensor([1, 3, 0] * 10)
offsets = torch.zeros(31, dtype=torch.int64)
offsets[1:] = lengths.cumsum(0)
indices = torch.arange(int(offsets[-1])) % 40
"""

_PROCESS_COMPILE = _SMALL_STEP + r"""
from torchrec_triton_tbe import aot
from torchrec_triton_tbe.ops.precompile import precompile
report = precompile(m, indices, offsets, workers=2, compile_fn=aot.cubin_compiler(90), pool="process",
                    job_fn=aot.cubin_job(90))
print(json.dumps({"specializations": report.specializations, "cache_hits": report.cache_hits,
                  "load_compiles": report.load_compiles, "pool": report.pool,
                  "worker_errors": list(report.worker_errors), "worker_seconds": report.worker_seconds,
                  "seconds": report.seconds, "iter": int(m.iter)}))
"""


def _real(errors: list) -> list:
    """Worker errors, less Triton 3.6's launcher builds on a machine without the CUDA driver library
    (3.6 builds a C launcher per signature and links it against libcuda; the kernels are compiled and
    cached either way, and 3.8 builds none)."""
    import ctypes.util

    if ctypes.util.find_library("cuda") is not None:
        return list(errors)
    return [e for e in errors if ": launcher " not in e]


def test_precompile_workers_fill_the_cache_the_load_phase_hits(tmp_path):
    """pool="process" on a CPU: the worker processes (torchrec_triton_tbe/_compile_worker.py) compile
    every specialization into the Triton cache, and the thread phase, compiling the same inputs,
    finds every one there (Triton's compilation listener says cache hit)."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", _PROCESS_COMPILE], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["pool"] == "process" and _real(report["worker_errors"]) == [] and report["iter"] == 0
    assert report["specializations"] >= 8
    assert report["cache_hits"] == report["specializations"] and report["load_compiles"] == 0, report
    assert 0 < report["worker_seconds"] <= report["seconds"]


_PRESTARTED = _SMALL_STEP + r"""
import gc
from torchrec_triton_tbe import aot
from torchrec_triton_tbe.ops.precompile import Workers, precompile
import dataclasses
cfg = m.spec.config  # the same module with one load thread (config precompile.load_threads)
m = TritonTBE([(50, 8), (40, 128)], feature_table_map=[0, 1, 1], device="cpu",
              optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
              kernel_config=dataclasses.replace(cfg, precompile=dataclasses.replace(cfg.precompile, load_threads=1)))
job_fn = aot.cubin_job(90)
procs = Workers(2, warm_up=job_fn.target)   # as start_workers does, before the module's first step
report = precompile(m, indices, offsets, compile_fn=aot.cubin_compiler(90), pool="process", job_fn=job_fn,
                    procs=procs)
open_after = not procs.closed
children = [p for p, _ in procs.procs]
del procs
gc.collect()
print(json.dumps({"specializations": report.specializations, "cache_hits": report.cache_hits,
                  "load_compiles": report.load_compiles, "prestarted": report.prestarted,
                  "workers": report.workers, "load_threads": report.load_threads,
                  "job_seconds": [list(j) for j in report.job_seconds], "kernels": list(report.kernels),
                  "worker_errors": list(report.worker_errors),
                  "phases": [report.record_seconds, report.compile_seconds, report.load_seconds],
                  "seconds": report.seconds, "open_after": open_after,
                  "exit_codes": [p.poll() for p in children]}))
"""


def test_precompile_on_workers_started_before_it_leaves_them_to_their_holder(tmp_path):
    """Workers started ahead of the step (the plugin starts them with the module) compile its jobs as
    workers started by precompile would: every load is a cache hit. precompile leaves them open (other
    modules may share them, ops/precompile.start_workers); they end when the last reference goes. The
    report's phases add up to its total; the config's precompile.load_threads sets the load threads."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", _PRESTARTED], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["prestarted"] and report["workers"] == 2 and _real(report["worker_errors"]) == [], report
    assert report["load_threads"] == 1, report
    # one time per job, each a kernel of the step: every specialization went to a worker here
    assert sorted(n for n, _ in report["job_seconds"]) == sorted(report["kernels"]), report
    assert all(t > 0 for _, t in report["job_seconds"]), report
    assert report["cache_hits"] == report["specializations"] >= 8 and report["load_compiles"] == 0, report
    assert report["open_after"] and report["exit_codes"] == [0, 0], report
    assert all(t > 0 for t in report["phases"]) and sum(report["phases"]) == pytest.approx(report["seconds"]), report


def test_default_workers_share_the_host_between_the_jobs_processes(monkeypatch):
    """One compile worker per CPU share: the CPUs over the job's processes on this host, as torchrun,
    Open MPI, MPICH or srun says (the first that does), at most the config's max_workers."""
    import os

    from torchrec_triton_tbe.ops import precompile as pre

    for name in pre._LOCAL_SIZE_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert pre.local_processes() == 1 and pre.default_workers() == 64 and pre.default_workers(16) == 16
    for name, value, local in (("SLURM_NTASKS_PER_NODE", "8(x2)", 8), ("MPI_LOCALNRANKS", "4", 4),
                               ("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 2), ("LOCAL_WORLD_SIZE", "16", 16)):
        monkeypatch.setenv(name, value)  # each set on top of the last: the earlier names win
        assert pre.local_processes() == local, name
        assert pre.default_workers() == 64 // local and pre.default_workers(3) == min(3, 64 // local), name
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a count")  # unreadable: the next launcher's word
    assert pre.local_processes() == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert pre.default_workers() == 1  # never none


def test_started_workers_are_shared_while_held_and_end_when_let_go(monkeypatch):
    """start_workers: one set per (target, count) while something holds it, a new set after it went;
    nothing started where nothing compiles (a CPU module, Triton's interpreter): hold_workers says so."""
    import gc

    from torchrec_triton_tbe.ops import precompile as pre

    assert pre.start_workers(torch.device("cpu")) is None
    m = _module()
    assert m.start_precompile_workers() is False and pre.release_workers(m) is None
    monkeypatch.setattr(pre, "_target", lambda device: ("cuda", 90, 32))
    monkeypatch.setattr(pre._env, "interpreting", lambda: False)
    first = pre.start_workers(torch.device("cuda"), workers=1)
    assert pre.start_workers(torch.device("cuda"), workers=1) is first
    assert pre.start_workers(torch.device("cuda"), workers=2) is not first
    gc.collect()  # the two-worker set is held by nothing: gone
    child = first.procs[0][0]
    assert first.warm_up == ("cuda", 90, 32) and child.poll() is None
    del first
    gc.collect()
    assert child.wait(timeout=60) == 0  # told there are no more jobs when its last holder went
    again = pre.start_workers(torch.device("cuda"), workers=1)
    assert again.procs[0][0] is not child
    again.close()
    assert again.closed and again.procs[0][0].poll() == 0
    with pytest.raises(RuntimeError, match="closed"):
        again.run([])


# A job no worker can compile (no such kernel in the module): a worker answers it with an error, fast.
_BAD_JOB = dict(module="torchrec_triton_tbe.kernels.transpose", name="_no_such_kernel", signature={}, constexprs={},
                attrs={}, target=("cuda", 90, 32), options={"num_warps": 1})


def test_compile_workers_report_a_failed_job_by_its_kernel(tmp_path, monkeypatch):
    """A job a worker cannot compile comes back as an error naming the kernel (the thread phase then
    compiles that one itself), not as a crash."""
    from torchrec_triton_tbe.ops.precompile import compile_in_workers

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    bad = dict(_BAD_JOB)
    errors = compile_in_workers([bad, dict(bad, name="_nor_this_one")], workers=1)
    assert [e.split(":")[0] for e in errors] == ["_no_such_kernel", "_nor_this_one"], errors
    assert all("AttributeError" in e for e in errors)


def test_compile_workers_call_back_as_each_answer_arrives(tmp_path, monkeypatch):
    """Workers.run's on_done(i, seconds) comes once per answered job, failed ones too, before run
    returns, with the worker's time on it: precompile loads each kernel from it while the other jobs
    still compile, and reports the times."""
    from torchrec_triton_tbe.ops.precompile import Workers

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    bad = dict(_BAD_JOB)
    jobs = [dict(bad, name=f"_no_kernel_{i}") for i in range(4)]
    done = []
    procs = Workers(2)
    try:
        errors = procs.run(jobs, on_done=lambda i, seconds: done.append((i, seconds)))
    finally:
        procs.close()
    assert sorted(i for i, _ in done) == [0, 1, 2, 3] and all(s >= 0 for _, s in done), done
    assert sorted(e.split(":")[0] for e in errors) == [j["name"] for j in jobs], errors


def test_compile_workers_warm_up_for_the_target_outside_the_cache(tmp_path, monkeypatch):
    """Workers given a target compile a trivial kernel for it before their first job (its log says how
    long), into a scratch cache: the caller's Triton cache gets none of it. (Triton 3.6 also builds its
    launcher, which needs the CUDA driver library: logged apart, not asserted here.)"""
    from torchrec_triton_tbe.ops.precompile import Workers

    cache = tmp_path / "cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    bad = dict(_BAD_JOB)
    procs = Workers(1, warm_up=("cuda", 90, 32))
    try:
        errors = procs.run([bad])  # answered after the warm-up
        log = procs.procs[0][1]
        log.seek(0)
        text = log.read().decode()
    finally:
        procs.close()
    assert [e.split(":")[0] for e in errors] == ["_no_such_kernel"], errors
    assert "warm-up failed" not in text and "warm-up " in text, text
    assert not any("_warm_up_kernel" in p.name for p in cache.rglob("*")), sorted(cache.rglob("*"))


def test_compile_order_hands_out_the_named_kernels_first_widest_first():
    from types import SimpleNamespace

    from torchrec_triton_tbe.ops.precompile import compile_order

    def launch(name, **constexprs):
        return SimpleNamespace(kernel=SimpleNamespace(fn=SimpleNamespace(__name__=name)), constexprs=constexprs)

    recorded = [launch("_check"), launch("_fwd", BLOCK_D=16), launch("_bwd", BLOCK_D=8), launch("_meta"),
                launch("_bwd", BLOCK_D=128), launch("_fwd", BLOCK_D=64), launch("_other", BLOCK_D=256)]
    ordered = compile_order(recorded, ("_bwd", "_fwd"))
    assert [(r.kernel.fn.__name__, r.constexprs.get("BLOCK_D")) for r in ordered] == [
        ("_bwd", 128), ("_bwd", 8), ("_fwd", 64), ("_fwd", 16), ("_check", None), ("_meta", None), ("_other", 256)]
    assert compile_order(recorded, ()) == recorded


def test_precompile_refuses_an_unknown_pool():
    from torchrec_triton_tbe.ops.precompile import precompile

    with pytest.raises(ValueError, match="pool must be"):
        precompile(None, None, None, pool="fork")


_JIT_JOBS = _SMALL_STEP + r"""
from triton.backends.compiler import GPUTarget
from triton.runtime import driver


class CPUDriver:  # what Triton's JIT asks a driver for up to its compiler call (no GPU here)
    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def is_active(self):
        return True


driver.set_active(CPUDriver())
from torchrec_triton_tbe.ops import precompile as P
unique = {}
for r in P.record_step(m, indices, offsets):
    unique.setdefault(r.site(m.current_device), r)
chosen = list(unique.values())
for r in chosen:
    r.kernel.device_caches[0]
jobs = [P._jit_job(r) for r in chosen]
errors = P.compile_in_workers([j for j in jobs if j is not None], 2)
hits = []
with P._count_compiles(hits):
    for r in chosen:  # the load phase without _init_handles (that loads onto a GPU)
        r.kernel.warmup(*r.args, grid=r.grid, **r.constexprs, **r.options)
# A job carries the parent's source hash of its kernel, and the worker compiles under it (Triton 3.6
# hashes a kernel differently depending on which callees a process hashed first).
import hashlib, os
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.runtime.cache import get_cache_key, get_cache_manager
job = dict(jobs[0], cache_key="f" * 64)
kernel = chosen[0].kernel
own, kernel.hash = kernel.hash, job["cache_key"]
src = ASTSource(kernel, job["signature"], job["constexprs"], job["attrs"])
backend = make_backend(GPUTarget(*job["target"]))
from triton.compiler.compiler import get_cache_invalidating_env_vars  # Triton 3.6 and 3.8
key = get_cache_key(src, backend, backend.parse_options(dict(job["options"])), get_cache_invalidating_env_vars())
kernel.hash = own
pinned_dir = get_cache_manager(hashlib.sha256(key.encode()).hexdigest()).cache_dir
pinned_errors = P.compile_in_workers([job], 1)
print(json.dumps({"chosen": len(chosen), "jobs": sum(j is not None for j in jobs), "errors": list(errors),
                  "hits": [h for h, _ in hits], "missed": [n for h, n in hits if not h],
                  "pinned": os.path.isdir(pinned_dir), "pinned_errors": list(pinned_errors)}))
"""


def test_workers_compile_exactly_what_the_jit_then_looks_up(tmp_path):
    """The real JIT path of pool="process" up to the GPU: Triton's JIT (a stand-in driver answering its
    device, stream and target questions) binds each recorded launch and is stopped at its compiler call
    (ops/precompile._jit_job); the workers compile those jobs; the JIT's own warmup of every launch then
    finds each kernel in the Triton cache, none compiled twice. And a worker compiles under the
    kernel source hash the job carries, the parent's (Triton 3.6 hashes kernels order-dependently)."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", _JIT_JOBS], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert _real(report["errors"]) == [] and report["jobs"] == report["chosen"] >= 8, report
    assert report["missed"] == [] and report["hits"] and all(report["hits"]), report
    assert report["pinned"] and _real(report["pinned_errors"]) == [], report


_HASHES = _JIT_JOBS[:_JIT_JOBS.index("jobs = [P._jit_job(r) for r in chosen]")] + r"""
import sys
if sys.argv[1] == "precompile":
    # Jobs made in an order that reaches the long path's apply kernel before the short kernel (both
    # call _apply_run): the order Triton 3.6 would otherwise hash them in.
    jobs = P.jit_jobs(P.record_step(m, indices, offsets), chosen[::-1])
    hashes = {j["name"]: j["cache_key"] for j in jobs}
else:  # a plain step: each kernel hashed as the JIT first binds it, in launch order
    for r in chosen:
        r.kernel.warmup(*r.args, grid=r.grid, **r.constexprs, **r.options)
    hashes = {r.kernel.fn.__name__: r.kernel.cache_key for r in chosen}
print(json.dumps(hashes))
"""


def test_precompile_jobs_carry_the_hashes_a_plain_step_computes(tmp_path):
    """Each job carries its kernel's source hash as a step without precompile computes it in a fresh
    process, whatever order the jobs go out in: a Triton cache filled by either finds the other's
    kernels (Triton 3.6 hashes three kernels by the order a process first hashed them in)."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"))
    runs = {}
    for mode in ("precompile", "plain"):
        proc = subprocess.run([sys.executable, "-c", _HASHES, mode], env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "_backward_long_apply_kernel" in runs["plain"] and "_backward_short_kernel" in runs["plain"], runs
    assert runs["precompile"] == runs["plain"]


@pytest.fixture
def dying_workers(tmp_path, monkeypatch):
    """Compile workers that exit at start (status 3, "no compiler here" on stderr)."""
    from torchrec_triton_tbe.ops import precompile as precompile_ops

    dying = tmp_path / "dying_worker.py"
    dying.write_text("import sys\nsys.stderr.write('no compiler here\\n')\nsys.exit(3)\n")
    monkeypatch.setattr(precompile_ops, "WORKER", str(dying))
    return precompile_ops


def _stub_job(name: str) -> dict:
    """A worker job that names a kernel and compiles nothing (for workers that never get to it)."""
    return dict(module="m", name=name, signature={}, constexprs={}, attrs={}, target=("cuda", 90, 32), options={})


def test_dead_compile_workers_leave_no_job_unreported(dying_workers):
    """Workers that die (here: exit at start) fail their jobs by name; jobs no worker is left for are
    reported too, so the report accounts for every job the load phase then compiles itself."""
    precompile_ops = dying_workers
    jobs = [_stub_job(f"k{i}") for i in range(5)]
    errors = precompile_ops.compile_in_workers(jobs, workers=2)
    assert sorted(e.split(":")[0] for e in errors) == [f"k{i}" for i in range(5)], errors
    assert any("worker exited 3: no compiler here" in e for e in errors), errors


def test_precompile_warns_when_workers_fail_and_the_step_still_trains(dying_workers):
    """With precompile on by default in the plugin, a worker failure must not pass unseen: precompile
    warns with the count and the first error, the load phase compiles what failed (here: a stand-in
    compile_fn that records what it was handed), and the step then trains as without precompile."""
    precompile_ops = dying_workers
    flagged, plain = _module(optimizer=EmbOptimType.EXACT_SGD), _module(optimizer=EmbOptimType.EXACT_SGD)
    with torch.no_grad():
        plain.weights.copy_(flagged.weights)
    batch = _batch()
    loaded = []

    def compile_fn(r):
        loaded.append(r.kernel.__name__)
        return None  # nothing handed to launch's cache: the step compiles (interprets) as without precompile

    with pytest.warns(RuntimeWarning, match=r"precompile: (\d+) of \1 kernel specializations failed in the compile "
                                            r"workers .*worker exited 3: no compiler here"):
        report = precompile_ops.precompile(flagged, batch.indices, batch.offsets, workers=2, compile_fn=compile_fn,
                                           pool="process", job_fn=lambda r: _stub_job(r.kernel.__name__))
    assert report.pool == "process" and len(report.worker_errors) == report.specializations > 0, report
    assert sorted(loaded) == sorted(report.kernels), (loaded, report.kernels)
    for m in (flagged, plain):
        out = m(batch.indices, batch.offsets)
        out.backward(torch.ones_like(out))
    assert torch.equal(flagged.weights, plain.weights) and int(flagged.iter) == int(plain.iter)


_LOOKUP_COUNTS = r"""
import json
import torch
from torchrec_triton_tbe import aot
from torchrec_triton_tbe._fbgemm import EmbOptimType, SparseType
from torchrec_triton_tbe.module import TritonTBE

specs = [(300, 16), (200, 64), (400, 8)]
with aot.recording():
    m = TritonTBE(specs, kernel_config="sm90", optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, device="cpu",
                  weights_precision=SparseType.FP16)


def step(n):
    B = 64
    lengths = torch.full((len(specs) * B,), n // (len(specs) * B))
    lengths[: n - int(lengths.sum())] += 1
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    with aot.recording() as seen:
        out = m(torch.arange(n) % 8, offsets)
        out.backward(torch.ones_like(out))
    return sorted(map(repr, seen))


# Lookup counts 16,001 / 16,389 / 18,437 (none a multiple of 16): 16 / 17 / 19 metadata programs of
# 1,024 slots, whose scratch row 1 started 68 / 72 / 80 bytes in before it was padded.
print(json.dumps([step(16001), step(16389), step(18437)]))
"""


def test_batches_of_other_lookup_counts_launch_the_same_specializations():
    """Triton specializes int arguments on divisibility by 16: a per-batch count passed to a kernel that
    does not need it would compile that kernel again for later batches (after a precompiled first
    step, too). Three batches of one shape whose lookup counts are not multiples of 16 (and whose
    metadata program counts and scratch offsets differ in divisibility) launch exactly the same
    specializations (compiled kernels, launches recorded, no GPU)."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", _LOOKUP_COUNTS], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second, third = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(first) >= 15, first  # forward, bounds, metadata and backward kernels were recorded
    assert first == second == third, sorted(set(first) ^ set(second) | set(first) ^ set(third))
