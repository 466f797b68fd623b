"""A compile worker of ops/precompile.py, run as a script (``python _compile_worker.py [TARGET]``), never
imported.

Why a script: a worker must start fast. Imported as part of the package it would import torch (the
package's __init__) and, started by multiprocessing, unpickle its task through that import too: a
second or more per worker before it compiles anything. As a script it imports Triton and the kernel
modules only, the way tools/compile_specs.py does: kernels/ imports nothing but triton and itself.
It imports them before it reads anything, so that start-up overlaps the parent's recorded step; given
a target (``cuda,90,32``) it then warms the compiler up for it (``_warm_up``), overlapping that too.

Protocol (ops/precompile.Workers): stdin carries frames (8-byte little-endian length, then a pickle),
each a job or None (no more jobs). A job is a dict with the kernel's module and name and the exact
inputs Triton's JIT would hand its compiler in the parent: the ASTSource's signature, constexprs and
attributes, the target's fields and the options dict, and (from the JIT) the kernel's source hash.
The worker compiles it with ``triton.compile``
into the parent's Triton cache (TRITON_CACHE_DIR, set by the parent): the same inputs hash to the
same cache entry, so the parent's JIT then loads it instead of compiling. Where Triton builds a C
launcher per signature (3.6: a C compiler run on first launch, also cached by its source), that is
built here too. Each job is answered with one frame: (seconds, None) or (seconds, error text). A job
that fails is reported, not fatal: the parent compiles that one itself.
"""

import importlib
import os
import pickle
import sys
import time
import types


def _register_package() -> str:
    # The package and its kernels folder as bare packages: their __init__ files (torch) never run.
    root = os.path.dirname(os.path.abspath(__file__))
    for name, path in (("torchrec_triton_tbe", root), ("torchrec_triton_tbe.kernels", os.path.join(root, "kernels"))):
        mod = types.ModuleType(name)
        mod.__path__ = [path]
        sys.modules[name] = mod
    return os.path.join(root, "kernels")


def _read(stream):
    head = stream.read(8)
    if len(head) < 8:
        return None
    return pickle.loads(stream.read(int.from_bytes(head, "little")))


def _write(stream, obj) -> None:
    data = pickle.dumps(obj)
    stream.write(len(data).to_bytes(8, "little") + data)
    stream.flush()


def _text(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:500]


def _warm_up(target: tuple, build_launcher) -> None:
    """Compiles a trivial kernel for ``target`` into a throw-away cache: a process's first compile pays
    once for what every later one reuses (the compiler's libraries and contexts, the first ptxas run).
    On the CPU machine (Triton 3.8) a first compile took 0.55 s longer than the same compile after this
    0.65 s warm-up; done before the first job, while the parent records its step, it is off the
    critical path. Best effort: a failure is logged (stderr) and the jobs compile as they would."""
    import tempfile

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def _warm_up_kernel(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 2.0 + 1.0, mask=mask)

    previous = os.environ.get("TRITON_CACHE_DIR")
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="triton_tbe_warm_up_") as scratch:
            os.environ["TRITON_CACHE_DIR"] = scratch  # Triton reads it on every cache access
            src = ASTSource(_warm_up_kernel, {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 128})
            compiled = triton.compile(src, target=GPUTarget(*target))
            if build_launcher is not None:
                try:  # needs the CUDA driver library, as the jobs' launchers do
                    build_launcher(src, compiled.metadata)
                except Exception as e:  # noqa: BLE001 - timing only
                    sys.stderr.write(f"warm-up launcher failed: {_text(e)}\n")
    except Exception as e:  # noqa: BLE001 - timing only: the jobs compile the same either way
        sys.stderr.write(f"warm-up failed: {_text(e)}\n")
    finally:
        if previous is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = previous
    sys.stderr.write(f"warm-up {time.perf_counter() - t0:.3f} s\n")


def main() -> int:
    # The frames go to a duplicate of stdout; anything printed (Python or C, Triton's or ptxas's) goes
    # to stderr instead of into the frames.
    frames = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    kernels = _register_package()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for name in sorted(os.listdir(kernels)):
        if name.endswith(".py") and name != "__init__.py":
            importlib.import_module(f"torchrec_triton_tbe.kernels.{name[:-3]}")
    try:  # Triton 3.6: a C launcher per signature; 3.8 has one generic launcher (nothing to build)
        from triton.backends.nvidia import driver as nvidia_driver

        build_launcher = nvidia_driver.CudaLauncher if hasattr(nvidia_driver, "make_launcher") else None
    except ImportError:
        build_launcher = None
    if len(sys.argv) > 1:  # the target to warm up for: "backend,arch,warp_size" (ops/precompile.Workers)
        backend, arch, warp_size = sys.argv[1].split(",")
        _warm_up((backend, int(arch), int(warp_size)), build_launcher)
    stdin = sys.stdin.buffer
    while True:
        job = _read(stdin)
        if job is None:
            return 0
        t0 = time.perf_counter()
        error = None
        try:
            fn = getattr(importlib.import_module(job["module"]), job["name"])
            if job.get("cache_key"):
                # The parent's source hash of this kernel, not this process's: under Triton 3.6 a
                # kernel's hash depends on which of its callees were hashed before it in a process,
                # and the jobs reach each worker in another order (ops/precompile._jit_job).
                fn.hash = job["cache_key"]
            src = ASTSource(fn, job["signature"], job["constexprs"], job["attrs"])
            compiled = triton.compile(src, target=GPUTarget(*job["target"]), options=dict(job["options"]))
        except Exception as e:  # noqa: BLE001 - reported to the parent, which compiles it itself
            error = _text(e)
        else:
            if build_launcher is not None:
                try:  # needs the CUDA driver library (present on a GPU host); the kernel is cached either way
                    build_launcher(src, compiled.metadata)
                except Exception as e:  # noqa: BLE001 - reported; the parent builds it on first launch
                    error = "launcher " + _text(e)
        _write(frames, (time.perf_counter() - t0, error))


if __name__ == "__main__":
    sys.exit(main())
