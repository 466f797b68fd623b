"""Compile specializations dumped by `python -m torchrec_triton_tbe.aot --dump-specs F` with whatever
Triton this interpreter has, without importing torch or FBGEMM: the way to check the kernels against
the GPU image's Triton (3.6) from a CPU machine whose main environment has another one.

    python -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0
    TRITON_INTERPRET=0 .venv/bin/python -m torchrec_triton_tbe.aot --dump-specs /tmp/specs.json
    /tmp/t36/bin/python tools/compile_specs.py /tmp/specs.json
"""

import importlib
import json
import pathlib
import sys
import types

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main() -> int:
    # Register the package and its kernels folder without running torchrec_triton_tbe/__init__.py
    # (which imports torch): kernel modules import nothing but triton and each other.
    for name, path in (("torchrec_triton_tbe", ""), ("torchrec_triton_tbe.kernels", "kernels")):
        mod = types.ModuleType(name)
        mod.__path__ = [str(ROOT / "torchrec_triton_tbe" / path)]
        sys.modules[name] = mod
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    specs = json.load(open(sys.argv[1]))
    failures = 0
    for sp in specs:
        fn = getattr(importlib.import_module(sp["module"]), sp["kernel"])
        attrs = {(i,): [["tt.divisibility", 16]] for i in sp["divisible"]}
        try:
            triton.compile(
                ASTSource(fn=fn, signature=sp["signature"], constexprs=sp["constexprs"], attrs=attrs),
                target=GPUTarget("cuda", sp["target"], 32),
                options={"num_warps": sp["num_warps"]},
            )
        except Exception as e:  # noqa: BLE001 - report every failure, then fail
            failures += 1
            print(f"FAIL sm_{sp['target']} {sp['kernel']} {sp['constexprs']} warps={sp['num_warps']}: "
                  f"{str(e).strip().splitlines()[-1][:300] if str(e).strip() else repr(e)}")
    print(f"triton {triton.__version__}: {len(specs) - failures}/{len(specs)} specializations compiled")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
