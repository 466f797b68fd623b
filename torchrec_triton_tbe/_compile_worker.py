"""A compile worker of ops/precompile.py, run as a script (``python _compile_worker.py``), never imported.

Why a script: a worker must start fast. Imported as part of the package it would import torch (the
package's __init__) and, started by multiprocessing, unpickle its task through that import too: a
second or more per worker before it compiles anything. As a script it imports Triton and the kernel
modules only, the way tools/compile_specs.py does: kernels/ imports nothing but triton and itself.

Protocol: stdin holds one pickled list of jobs, each a dict with the kernel's module and name and the
exact inputs Triton's JIT handed (or would hand) its compiler in the parent: the ASTSource's
signature, constexprs and attributes, the target's fields and the options dict. The worker compiles
each with ``triton.compile`` into the parent's Triton cache (TRITON_CACHE_DIR, set by the parent), so
the same inputs hash to the same cache entry and the parent's JIT later loads it instead of
compiling. stdout gets one pickled list: per job, (seconds, None) or (seconds, error text). A job that
fails is reported, not fatal: the parent's JIT compiles that one itself.
"""

import importlib
import os
import pickle
import sys
import time
import types


def _register_package() -> None:
    # The package and its kernels folder as bare packages: their __init__ files (torch) never run.
    root = os.path.dirname(os.path.abspath(__file__))
    for name, path in (("torchrec_triton_tbe", root), ("torchrec_triton_tbe.kernels", os.path.join(root, "kernels"))):
        mod = types.ModuleType(name)
        mod.__path__ = [path]
        sys.modules[name] = mod


def main() -> int:
    jobs = pickle.load(sys.stdin.buffer)
    _register_package()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    results = []
    for job in jobs:
        t0 = time.perf_counter()
        try:
            fn = getattr(importlib.import_module(job["module"]), job["name"])
            src = ASTSource(fn, job["signature"], job["constexprs"], job["attrs"])
            triton.compile(src, target=GPUTarget(*job["target"]), options=dict(job["options"]))
            results.append((time.perf_counter() - t0, None))
        except Exception as e:  # noqa: BLE001 - reported to the parent, which compiles it itself
            text = str(e).strip().splitlines()
            results.append((time.perf_counter() - t0, f"{type(e).__name__}: {text[-1] if text else ''}"[:500]))
    sys.stdout.buffer.write(pickle.dumps(results))
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
