"""Compile a training step's kernels before the step: in worker processes, then load them on threads.

Why: a cold first step compiles every kernel specialization it launches, one after another, on the
thread that issues the step. tools/first_step.py counts 38 of them for prod_t40_b16k (one forward and
three backward kernels per D bucket, plus the run metadata and bounds checks): 12.2 s on one core of
the H200 host, 1.7 s on 16 processes. Threads alone reach 5.6 s there: Triton's compiler releases the
GIL in its MLIR passes and in ptxas, but its Python front end (AST to TTIR) holds it
(docs/performance.md, "Time to first step").

How:
1. Record. The step (forward, then backward with a ones gradient) is driven once with ``launch``
   recording instead of launching (ops/launch.py ``recording``, per thread). The host code never waits for the GPU,
   so a step whose kernels never ran still issues every launch the real step will, with the same
   argument types, alignments, constexprs and warps. It writes no buffer of the module (the step count
   included: its advance is a launch's, or skipped while recording) and keeps no last-run statistics; it
   runs on a lookup call and graph cache of its own (a graph the module captured earlier would be
   replayed, and replays are not launches), so other threads may train the module meanwhile.
   Per-sample weights are cloned, so no gradient lands in the caller's tensor.
2. Compile in processes (``pool="process"``, the default). The workers (``Workers``: the script
   torchrec_triton_tbe/_compile_worker.py, which imports Triton and the kernels, not torch) start
   before step 1, so their start-up overlaps the recording; or earlier, when the module is built
   (``start_workers``, the plugin's precompile option), so that it overlaps whatever the program does
   before its first step. For each distinct specialization, Triton's
   own JIT binds the recorded arguments and is stopped at its call into the compiler (``_jit_job``):
   what it would compile (the ASTSource's signature, constexprs and attributes, the target, the
   options, and the kernel's source hash as this process has it) is what a worker compiles, with
   ``triton.compile`` into this process's Triton cache, one job at a time per free worker. Same
   inputs, same cache key.
3. Load on threads. Each specialization then goes through the JIT for real (``JITFunction.warmup``:
   its binder, its cache key, its on-disk cache, now a hit; a job a worker failed is compiled here),
   with the kernel's module loaded and its launcher built (``_init_handles``), on a thread pool with
   the module's device current in each thread, as soon as its job is back from a worker. The report
   counts the loads that hit the cache and names the kernels that did not. ``pool="thread"`` skips
   step 2 and compiles on the threads.
4. Hand over. Each compiled kernel goes into ``launch``'s cache under the key the real launch will look
   up (``launch.remember``), so the step finds it without Triton's per-call binding.

Under Triton's interpreter nothing is compiled: the report says so, and the step runs as it would.
What a precompiled step launches is exactly what it would have launched (the cache holds the kernels
Triton compiled for those arguments); only when the work happens changes.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import torch

from torchrec_triton_tbe import _env
from torchrec_triton_tbe.ops import launch as launch_ops


@dataclasses.dataclass(frozen=True)
class PrecompileReport:
    launches: int  # launches the recorded step issued
    specializations: int  # distinct ones among them: what was compiled
    kernels: tuple  # kernel names, one per specialization
    workers: int
    # wall time from the workers' start to the last load: recording, compiles, loads (0 under the interpreter)
    seconds: float
    compiled: bool  # False under Triton's interpreter (nothing to compile)
    pool: str = "thread"  # "process": workers compiled, threads loaded; "thread": threads did both
    worker_seconds: float = 0.0  # the part of ``seconds`` until the workers' last job: the recording and the compiles
    worker_errors: tuple = ()  # "kernel: error" per job a worker failed (the thread phase compiled it)
    cache_hits: int = 0  # load-phase compiles that found their kernel in the Triton cache
    load_compiles: int = 0  # load-phase compiles that did not (a worker's miss: compiled on the threads)
    load_compiled: tuple = ()  # their kernels' names
    # The phases of ``seconds``: the dry run; the workers' jobs, made and compiled (each job's load runs
    # on the threads as soon as it is back); what is left of the loads after the last job (pool
    # "thread": the threads' compiles, all of them).
    record_seconds: float = 0.0
    compile_seconds: float = 0.0
    load_seconds: float = 0.0
    prestarted: bool = False  # the workers were started before this call (start_workers)
    load_threads: int = 0  # the threads that loaded (or, pool "thread", compiled) the kernels
    job_seconds: tuple = ()  # (kernel, seconds) per job a worker answered, in answer order, its own timing


def record_step(module, indices: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: Optional[torch.Tensor] = None,
                batch_size_per_feature_per_rank: Optional[list] = None) -> list:
    """The launches one training step of ``module`` on this batch issues, without running any of them
    (see the module docstring); the module's state is as before."""
    # The dry run writes no buffer of the module: kernels write the weights, the optimizer state, the step
    # count and the bounds check's count and scratch, and none runs; the host-op writers skip a recorded
    # call too (the step count's fallback where no kernel launches, ops/forward.advance_by_torch_ops; a
    # replayed backward's swap of a superseded learning rate, autograd.swapped_in). So there is nothing to
    # snapshot or restore. A restore raced with another thread's forward: it wrote back the count from
    # before that forward's advance.
    # Its call has a graph cache of its own and keeps no statistics (module._lookup_call): the module's
    # cache, graphs and statistics are left to other threads. Its forward does set the module's last
    # stream (module._follow_last_stream: its own, after waiting for the one before), left so: restoring
    # the one before would let a later forward on a third stream skip waiting for the writes of another
    # thread's forward in between.
    psw = None
    if per_sample_weights is not None:
        psw = per_sample_weights.detach().clone().requires_grad_(per_sample_weights.requires_grad)
    recorded: list = []
    with launch_ops.recording(recorded), torch.enable_grad():
        kwargs = {}
        if batch_size_per_feature_per_rank is not None:
            kwargs["batch_size_per_feature_per_rank"] = batch_size_per_feature_per_rank
        out = module(indices, offsets, psw, **kwargs)
        out.backward(torch.ones_like(out))
    return recorded


def _warmup(index: int) -> Callable:
    """Triton's JIT on a pool thread, on device ``index``: set_device needs an index (torch.device("cuda")
    has none), resolved by the caller on its own thread, whose current device the module's "cuda" means."""

    def compile_one(recorded: launch_ops.Launch):
        torch.cuda.set_device(index)  # CUDA's current device is per thread
        compiled = recorded.kernel.warmup(*recorded.args, grid=recorded.grid, **recorded.constexprs,
                                          **recorded.options)
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
               workers: Optional[int] = None, compile_fn: Optional[Callable] = None,
               pool: str = "process", job_fn: Optional[Callable] = None,
               procs: Optional["Workers"] = None) -> PrecompileReport:
    """Records one training step of ``module`` on this batch (``record_step``), compiles its distinct
    kernel specializations on ``workers`` processes and loads them on threads (``pool`` "process"), or
    compiles them on the threads (``pool`` "thread"). ``workers`` defaults to the CPUs this process may
    use over the job's processes on this host (``local_processes``: one per GPU sharing the host's
    cores), at most configs' ``precompile.max_workers``. ``compile_fn(launch) -> compiled kernel``
    replaces Triton's ``warmup`` and ``job_fn(launch) -> job`` the JIT's compile inputs (tests:
    aot.cubin_compiler, aot.cubin_job); a ``compile_fn`` without a ``job_fn`` compiles on the threads
    alone (the report says "thread").
    ``procs``: workers started earlier (``start_workers``), used instead of starting ``workers`` new
    ones and left open for their other users (they close when the last one lets go)."""
    if pool not in ("process", "thread"):
        raise ValueError(f"precompile: pool must be 'process' or 'thread', not {pool!r}")
    if compile_fn is not None and job_fn is None:
        pool = "thread"  # a replaced compile has no JIT inputs to hand the workers
    device = module.spec.device  # the tables' device (a move takes them along; current_device stays the constructor's)
    compiles = compile_fn is not None or not (_env.interpreting() or device.type != "cuda")
    prestarted = procs is not None and compiles and pool == "process" and not procs.closed
    if not prestarted:
        procs = None
    cap = module.spec.config.precompile.max_workers
    limit = len(procs.procs) if prestarted else default_workers(cap) if workers is None else max(1, int(workers))
    t0 = time.perf_counter()
    # Started first: their start-up (a Python, Triton and the kernels imported, the compiler warmed up
    # for this GPU) overlaps the recording.
    if compiles and pool == "process" and procs is None:
        procs = Workers(limit, warm_up=_target(device) if job_fn is None else getattr(job_fn, "target", None))
    try:
        recorded = record_step(module, indices, offsets, per_sample_weights, batch_size_per_feature_per_rank)
        t_recorded = time.perf_counter()
        unique: dict = {}
        for r in recorded:
            unique.setdefault(r.site(device), r)
        chosen = compile_order(list(unique.values()), module.spec.config.precompile.compile_first)
        names = tuple(_name(r) for r in chosen)
        workers = max(1, min(limit, len(chosen) or 1))
        # Loads are host work that mostly holds the GIL (the JIT's binding and cache lookup, the module
        # load, the launcher): more threads need not load faster. Threads that compile (no workers)
        # release it in the compiler's passes: one per worker.
        threads_n = workers
        if procs is not None and module.spec.config.precompile.load_threads:
            threads_n = max(1, min(module.spec.config.precompile.load_threads, workers))
        if not compiles:
            return PrecompileReport(len(recorded), len(chosen), names, workers, 0.0, compiled=False, pool=pool,
                                    prestarted=prestarted)
        cache_device = device
        if compile_fn is None:
            cache_device = _launch_device(device)  # launch's and Triton's device key: an index
            # Triton (3.6, 3.8) creates a kernel's per-device binder on first use: once here, not racing
            # in the pool.
            for r in chosen:
                caches = getattr(r.kernel, "device_caches", None)
                if caches is not None:
                    caches[cache_device]
        compile_one = compile_fn or _warmup(cache_device)
        worker_errors: tuple = ()
        hits: list = []
        pool_threads = ThreadPoolExecutor(threads_n, thread_name_prefix="triton_tbe_precompile")
        with _count_compiles(hits), pool_threads as threads:
            # Each kernel is loaded (through the JIT: a cache hit, its module loaded, its launcher
            # built) as soon as its job is back, on the threads, while the workers compile the rest:
            # the loads took 0.7 s of a 3.4 s precompile when they waited for the last job (H200,
            # prod_t40_b16k, session 29).
            loads: list = [None] * len(chosen)
            compile_times: list = []  # (kernel, seconds) per answered job, as the workers timed it

            def load(k: int) -> None:
                loads[k] = threads.submit(compile_one, chosen[k])

            if procs is not None:
                if job_fn is None:
                    with torch.cuda.device(device):
                        jobs = jit_jobs(recorded, chosen)
                else:
                    jobs = [job_fn(r) for r in chosen]
                sent = [k for k, job in enumerate(jobs) if job is not None]
                for k, job in enumerate(jobs):
                    if job is None:  # nothing for a worker to compile: load it now
                        load(k)

                def answered(i: int, job_seconds: float) -> None:
                    compile_times.append((_name(chosen[sent[i]]), job_seconds))
                    load(sent[i])

                worker_errors = procs.run([jobs[k] for k in sent], on_done=answered)
                if not prestarted:
                    procs.close()  # while the last loads run
            t_compiled = time.perf_counter()
            for k in range(len(chosen)):
                if loads[k] is None:
                    load(k)
            kernels = [f.result() for f in loads]
    finally:
        if procs is not None and not prestarted:
            procs.close()
    seconds = time.perf_counter() - t0
    worker_seconds = t_compiled - t0
    for r, compiled in zip(chosen, kernels):
        if compiled is not None:
            launch_ops.remember(r, cache_device, compiled)
    if worker_errors:
        # Said, not raised: the step runs the same kernels, the load phase compiled these in this process
        # (slower, which is what the plugin's default-on precompile is there to avoid).
        warnings.warn(f"precompile: {len(worker_errors)} of {len(chosen)} kernel specializations failed in the "
                      f"compile workers and were compiled in this process instead (first: {worker_errors[0]})",
                      RuntimeWarning, stacklevel=2)
    return PrecompileReport(len(recorded), len(chosen), names, workers, seconds, compiled=True, pool=pool,
                            worker_seconds=worker_seconds if procs is not None else 0.0,
                            worker_errors=worker_errors, cache_hits=sum(hit for hit, _ in hits),
                            load_compiles=sum(not hit for hit, _ in hits),
                            load_compiled=tuple(sorted(name for hit, name in hits if not hit)),
                            record_seconds=t_recorded - t0, compile_seconds=t_compiled - t_recorded,
                            load_seconds=seconds - worker_seconds, prestarted=prestarted, load_threads=threads_n,
                            job_seconds=tuple(compile_times))


def compile_order(launches: list, first: tuple) -> list:
    """The distinct launches in the order the workers take them: the kernels named in ``first``
    (configs' ``precompile.compile_first``: every kernel of a step, longest mean compile first) in that
    order, widest BLOCK_D first, then the rest as recorded. Why: jobs go to whichever worker is free,
    and a long compile handed out last leaves the others idle. On the H200 host (16 workers,
    prod_t40_b16k's 46 specializations, session 30) the compile phase took 1.36-1.41x the workers'
    summed job time / 16 with the three longest kernels first and the rest as recorded, 1.14-1.18x
    in this order (docs/performance.md "Precompile on by default")."""
    rank = {name: i for i, name in enumerate(first)}

    def key(item):
        i, r = item
        k = rank.get(_name(r), len(first))
        return (k, -int(r.constexprs.get("BLOCK_D", 0)) if k < len(first) else 0, i)

    return [r for _, r in sorted(enumerate(launches), key=key)]


def _target(device: torch.device) -> Optional[tuple]:
    """(backend, arch, warp_size) Triton compiles for on ``device``, None where it compiles nothing."""
    if device.type != "cuda" or _env.interpreting():
        return None
    from triton.runtime import driver

    with torch.cuda.device(device):
        target = driver.active.get_current_target()
    return (target.backend, target.arch, target.warp_size)


# What launchers say about the processes of one job on this host: torchrun, Open MPI, MPICH / Intel
# MPI, SLURM's srun (--ntasks-per-node; "8" or "8(x2)").
_LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")


def local_processes() -> int:
    """The processes this job runs on this host, from the first launcher variable that says (1 when
    none does): each of them may precompile at once, so they share the host's cores."""
    for name in _LOCAL_SIZE_VARS:
        value = os.environ.get(name, "").split("(")[0].split(",")[0].strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def default_workers(cap: int = 0) -> int:
    """The CPUs this process may use over the job's processes on this host (``local_processes``), at
    most ``cap`` (configs' ``precompile.max_workers``; 0: no cap)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = max(1, cpus // local_processes())
    return min(n, cap) if cap > 0 else n


def _name(r: launch_ops.Launch) -> str:
    return r.kernel.fn.__name__ if hasattr(r.kernel, "fn") else str(r.kernel)


class _Intercepted(Exception):
    pass


def jit_jobs(recorded: list, chosen: list) -> list:
    """``_jit_job`` of each of ``chosen`` (compile order), each kernel's source hashed in the order of
    ``recorded`` first. Why: Triton 3.6 folds into a kernel's source hash the global constants of only
    those of its callees this process hashed before it (``DependenciesFinder._update_hash`` merges a
    callee's globals before hashing it; 3.8 hashes the callee first), so three of our kernels hash
    differently by order (kernels/backward_long.py's apply and fused kernels and the small-table apply,
    both through ``_apply_run``). A step without precompile hashes each kernel when it first launches
    it, in the recorded order; hashing in that order here gives each kernel the hash, and the Triton
    cache entry, that step looks for, so a cache filled by one serves the other (on the H200, session
    29: a plain first step took 5.3 s on a cache a precompiled step had filled, which the precompiled
    step loaded in 0.9 s)."""
    for r in recorded:
        getattr(r.kernel, "cache_key", None)
    return [_jit_job(r) for r in chosen]


def _jit_job(recorded: launch_ops.Launch) -> Optional[dict]:
    """What Triton's JIT would hand ``triton.compile`` for this launch, as a worker job: the JIT binds
    the arguments and computes its key as for a real launch, and is stopped at its compiler call (the
    ``compile`` its binder stores on the kernel, Triton 3.6 and 3.8), before it caches anything. None
    when it does not get that far: the kernel is in the JIT's memory already, a jit_cache_hook took
    over, or Triton's async compile mode is on (its compile runs elsewhere)."""
    from triton.runtime import _async_compile

    kernel = recorded.kernel
    if "compile" not in getattr(kernel, "__dict__", {}) or _async_compile.active_mode.get() is not None:
        return None
    seen: list = []

    def intercept(src, target=None, options=None, **_):
        seen.append((src, target, options))
        raise _Intercepted

    own = kernel.__dict__["compile"]
    kernel.compile = intercept
    try:
        kernel.warmup(*recorded.args, grid=recorded.grid, **recorded.constexprs, **recorded.options)
    except _Intercepted:
        pass
    finally:
        kernel.compile = own
    if not seen:
        return None
    src, target, options = seen[0]
    # The kernel's source hash as this process has it: Triton 3.6 merges a callee's global constants
    # into it only if the callee was hashed before, so the hash depends on the order kernels were
    # first hashed in a process (3.8 hashes the callee first). The worker takes this one.
    return dict(module=kernel.fn.__module__, name=kernel.fn.__name__, signature=dict(src.signature),
                constexprs=dict(src.constants), attrs=dict(src.attrs),
                target=(target.backend, target.arch, target.warp_size), options=dict(options),
                cache_key=src.fn.cache_key)


WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_compile_worker.py")


class Workers:
    """``n`` compile processes running torchrec_triton_tbe/_compile_worker.py with this interpreter,
    into this process's Triton cache. Jobs go out one at a time to whichever worker is free (compile
    times differ tenfold between kernels: 0.03-0.4 s on the H200 host), as length-prefixed pickles
    over the pipes; ``run`` returns "kernel: error" per job that failed."""

    def __init__(self, n: int, warm_up: Optional[tuple] = None) -> None:
        """``warm_up``: the (backend, arch, warp_size) the jobs will compile for; each worker then warms
        its compiler up for it right after start-up (_compile_worker._warm_up), before any job."""
        from triton import knobs

        env = dict(os.environ, TRITON_CACHE_DIR=knobs.cache.dir, TRITON_INTERPRET="0")
        argv = [sys.executable, WORKER] + ([",".join(map(str, warm_up))] if warm_up else [])
        self.warm_up = warm_up
        self._logs = tempfile.TemporaryDirectory(prefix="triton_tbe_precompile_")
        self.procs = []
        # One run at a time: the workers of start_workers are shared by the modules of a process.
        self._lock = threading.Lock()
        # Closes the workers when this object goes (the last module holding started workers let go,
        # or the interpreter exits) if close() did not run before; holds no reference to self.
        self._finalizer = weakref.finalize(self, _close, self.procs, self._logs)
        try:
            for i in range(max(1, int(n))):
                err = open(os.path.join(self._logs.name, f"{i}.err"), "w+b")
                try:
                    proc = subprocess.Popen(argv, stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=err, env=env)
                except OSError as e:
                    err.close()
                    raise RuntimeError(
                        f"precompile: could not start compile worker {i + 1} of {max(1, int(n))} ({e}); the "
                        "plugin's precompile option (on by default) is turned off by "
                        "TritonTBEOptions(precompile=False), and kernels then compile as the step reaches them"
                    ) from e
                except BaseException:
                    err.close()
                    raise
                self.procs.append((proc, err))
        except BaseException:
            self.close()
            raise

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def run(self, jobs: list, on_done: Optional[Callable[[int, float], None]] = None) -> tuple:
        """Compiles ``jobs``; returns "kernel: error" per job that failed. ``on_done(i, seconds)`` is
        called on this thread as job ``i``'s answer arrives, success or error, with the seconds the
        worker spent on it (not for jobs that never got one: a worker died with them, or none was
        left); the caller then loads the kernel."""
        if self.closed:
            raise RuntimeError("Workers.run: the workers are closed")
        with self._lock:
            return self._run(jobs, on_done)

    def _run(self, jobs: list, on_done: Optional[Callable[[int, float], None]]) -> tuple:
        import selectors

        pending = list(reversed(range(len(jobs))))
        errors: list = []
        busy: dict = {}  # worker index -> the index of its job
        sel = selectors.DefaultSelector()

        def feed(i: int) -> None:
            while pending:
                k = pending.pop()
                try:
                    _send(self.procs[i][0].stdin, jobs[k])
                except (BrokenPipeError, OSError):
                    errors.append(f"{jobs[k]['name']}: {self._died(i)}")
                    return
                busy[i] = k
                sel.register(self.procs[i][0].stdout, selectors.EVENT_READ, i)
                return

        for i in range(len(self.procs)):
            feed(i)
        while busy:
            for key, _ in sel.select():
                i = key.data
                sel.unregister(key.fileobj)
                k = busy.pop(i)
                result = _receive(self.procs[i][0].stdout)
                if result is None:
                    errors.append(f"{jobs[k]['name']}: {self._died(i)}")
                    continue
                if result[1] is not None:
                    errors.append(f"{jobs[k]['name']}: {result[1]}")
                if on_done is not None:
                    on_done(k, result[0])
                feed(i)
        sel.close()
        # Every worker died: what is left is compiled by the load phase, and said here.
        errors += [f"{jobs[k]['name']}: no compile worker left" for k in reversed(pending)]
        return tuple(errors)

    def _died(self, i: int) -> str:
        proc, err = self.procs[i]
        rc = proc.wait()
        err.seek(0)
        tail = err.read().decode(errors="replace").strip().splitlines()[-1:]
        return f"worker exited {rc}: {' '.join(tail)[:300]}"

    def close(self) -> None:
        self._finalizer()


def _close(procs: list, logs: tempfile.TemporaryDirectory) -> None:
    """Ends ``Workers``' processes: each is told there are no more jobs (it exits), then waited for."""
    for proc, _ in procs:
        if proc.poll() is None:
            try:
                _send(proc.stdin, None)  # no more jobs
                proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
    for proc, err in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for f in (proc.stdout, proc.stdin, err):
            if f is not None and not f.closed:
                f.close()
    logs.cleanup()


# Workers started ahead of a precompile (start_workers), by target and count: alive while a module
# holds them, so the modules of one process built one after another share one set.
_STARTED: "weakref.WeakValueDictionary[tuple, Workers]" = weakref.WeakValueDictionary()
_STARTED_LOCK = threading.Lock()


def start_workers(device: torch.device, workers: Optional[int] = None, cap: int = 0) -> Optional[Workers]:
    """Compile workers for a precompile still to come on ``device``, started now: their start-up (a
    Python with Triton and the kernels imported, then the compiler's warm-up for this GPU: ~1 s on
    the H200 host, docs/performance.md "Time to first step") then runs beside whatever the program
    does before its first step, not inside it. While one set is alive, another call for the same
    target and count returns it (the modules of one model share it); it closes once nothing holds it.
    ``workers`` defaults as in ``precompile`` (``default_workers(cap)``). None where nothing would be
    compiled (not CUDA, or Triton's interpreter)."""
    if device.type != "cuda" or _env.interpreting():
        return None
    n = default_workers(cap) if workers is None else max(1, int(workers))
    key = (_target(device), n)
    with _STARTED_LOCK:
        procs = _STARTED.get(key)
        if procs is None or procs.closed:
            procs = Workers(n, warm_up=key[0])
            _STARTED[key] = procs
    return procs


# The workers started for a module's precompile (hold_workers), kept here rather than on the module,
# which copy.deepcopy and pickle must still take (a process handle is neither).
_HELD: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def hold_workers(module, workers: Optional[int] = None) -> bool:
    """Starts (or joins, ``start_workers``) the compile workers of ``module``'s first precompile and
    keeps them until it runs (``release_workers``) or the module goes; whether any were started."""
    procs = start_workers(module.spec.device, workers, module.spec.config.precompile.max_workers)
    if procs is not None:
        _HELD[module] = procs
    return procs is not None


def release_workers(module) -> Optional[Workers]:
    """The workers ``hold_workers`` started for ``module``, no longer held for it (None if none)."""
    return _HELD.pop(module, None)


def _send(pipe, obj) -> None:
    data = pickle.dumps(obj)
    pipe.write(len(data).to_bytes(8, "little") + data)
    pipe.flush()


def _receive(pipe):
    """The worker's next result, None when it died."""
    head = pipe.read(8)
    if len(head) < 8:
        return None
    return pickle.loads(pipe.read(int.from_bytes(head, "little")))


def compile_in_workers(jobs: list, workers: int) -> tuple:
    """``jobs`` compiled on up to ``workers`` processes (``Workers``); "kernel: error" per failure."""
    if not jobs:
        return ()
    procs = Workers(min(int(workers), len(jobs)))
    try:
        return procs.run(jobs)
    finally:
        procs.close()


class _count_compiles:
    """Appends to ``hits``, per ``triton.compile`` call while active, (whether it hit the cache, the
    kernel's name): Triton's compilation listener, chained to one already set. A kernel the JIT holds
    in memory already does not call it at all."""

    def __init__(self, hits: list) -> None:
        self.hits = hits

    def __enter__(self):
        from triton import knobs

        self.prev = knobs.compilation.listener

        def listener(*, cache_hit=False, **kwargs):
            src = kwargs.get("src")
            self.hits.append((bool(cache_hit), getattr(src, "name", "?")))
            if self.prev is not None:
                self.prev(cache_hit=cache_hit, **kwargs)

        knobs.compilation.listener = listener
        return self

    def __exit__(self, *exc):
        from triton import knobs

        knobs.compilation.listener = self.prev
        return False


def _launch_device(device: torch.device):
    """The device key ``launch`` uses (Triton's current device index)."""
    from triton.runtime import driver

    with torch.cuda.device(device):
        return driver.active.get_current_device()
