"""Compile specializations dumped by `python -m torchrec_triton_tbe.aot --dump-specs F` with whatever
Triton this interpreter has, without importing torch or FBGEMM: the way to check the kernels against
the GPU image's Triton (3.6) from a CPU machine whose main environment has another one.

    python -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0
    TRITON_INTERPRET=0 .venv/bin/python -m torchrec_triton_tbe.aot --dump-specs /tmp/specs.json
    /tmp/t36/bin/python tools/compile_specs.py /tmp/specs.json [--resources [--json out.json]]
        [--only KERNEL[,KERNEL...]] [--maxnreg N]

(tools/first_step.py --dump-specs writes one suite shape's step in the same format.) --only: those
kernels' specializations alone; --maxnreg: compile them with that cap on registers per thread instead
of the one recorded (configs' backward.max_registers; 0: none), to see from a CPU what a cap spills.

--resources: each compiled cubin's registers per thread, stack frame and local memory, read with the
cuobjdump that Triton's wheel carries (no GPU needed; torchrec_triton_tbe/_resources.py). A non-zero
stack frame or local memory is a register spill, a speed hazard that only this shows from a CPU; each
one is printed, then the most registers per kernel. Spills do not change the exit status: whether a
spilling specialization is slower than one that does not spill is for the GPU to say.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import sys
import types

ROOT = pathlib.Path(__file__).resolve().parent.parent
# What identifies a specialization in the report (the rest of its constexprs are layout details).
_KEY_CONSTEXPRS = ("BLOCK_D", "TILE", "GATHER", "LANES", "BAGS", "OPTIM", "WEIGHTED", "POOLING_MEAN", "EVEN_D")


def report(rows: list[dict]) -> str:
    """The spilling specializations, then the most registers (and any spill) per kernel."""
    from torchrec_triton_tbe._resources import spills

    lines = []
    spilled = [r for r in rows if spills(r["usage"])]
    for r in spilled:
        u = r["usage"]
        cap = f" maxnreg={r['maxnreg']}" if r.get("maxnreg") else ""
        lines.append(f"SPILL sm_{r['target']} {r['kernel']} {r['key']} warps={r['num_warps']}{cap}: "
                     f"{u['registers']} registers, stack {u['stack']} B, local {u['local']} B")
    per_kernel: dict[str, list[dict]] = {}
    for r in rows:
        per_kernel.setdefault(r["kernel"], []).append(r)
    lines.append("| kernel | specializations | most registers | spilling |")
    lines.append("|---|---|---|---|")
    for name in sorted(per_kernel):
        rs = per_kernel[name]
        lines.append(f"| {name} | {len(rs)} | {max(r['usage']['registers'] for r in rs)} | "
                     f"{sum(spills(r['usage']) for r in rs)} |")
    lines.append(f"{len(spilled)} of {len(rows)} specializations spill")
    return "\n".join(lines)


def _register_package() -> None:
    """The package and its kernels folder as bare modules, without running torchrec_triton_tbe/__init__.py
    (which imports torch): kernel modules and _resources import nothing but triton and each other."""
    for name, path in (("torchrec_triton_tbe", ""), ("torchrec_triton_tbe.kernels", "kernels")):
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__path__ = [str(ROOT / "torchrec_triton_tbe" / path)]
            sys.modules[name] = mod


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("specs")
    p.add_argument("--resources", action="store_true", help="registers, stack and local memory per cubin")
    p.add_argument("--json", default=None, help="with --resources: every specialization's usage")
    p.add_argument("--only", default=None, help="comma-separated kernel names")
    p.add_argument("--maxnreg", type=int, default=None, help="register cap for every specialization (0: none)")
    args = p.parse_args(argv)
    _register_package()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from torchrec_triton_tbe._resources import cubin_usage

    specs = json.load(open(args.specs))
    if args.only:
        specs = [sp for sp in specs if sp["kernel"] in set(args.only.split(","))]
    if args.maxnreg is not None:
        specs = [dict(sp, maxnreg=args.maxnreg or None) for sp in specs]
    failures, rows = 0, []
    for sp in specs:
        fn = getattr(importlib.import_module(sp["module"]), sp["kernel"])
        attrs = {(i,): [["tt.divisibility", 16]] for i in sp["divisible"]}
        try:
            compiled = triton.compile(
                ASTSource(fn=fn, signature=sp["signature"], constexprs=sp["constexprs"], attrs=attrs),
                target=GPUTarget("cuda", sp["target"], 32),
                options={"num_warps": sp["num_warps"], **({"maxnreg": sp["maxnreg"]} if sp.get("maxnreg") else {})},
            )
        except Exception as e:  # noqa: BLE001 - report every failure, then fail
            failures += 1
            print(f"FAIL sm_{sp['target']} {sp['kernel']} {sp['constexprs']} warps={sp['num_warps']}: "
                  f"{str(e).strip().splitlines()[-1][:300] if str(e).strip() else repr(e)}")
            continue
        if args.resources:
            rows.append({"kernel": sp["kernel"], "target": sp["target"], "num_warps": sp["num_warps"],
                         "maxnreg": sp.get("maxnreg"),
                         "key": {k: sp["constexprs"][k] for k in _KEY_CONSTEXPRS if k in sp["constexprs"]},
                         "usage": cubin_usage(compiled.asm["cubin"])})
    print(f"triton {triton.__version__}: {len(specs) - failures}/{len(specs)} specializations compiled")
    if args.resources:
        print(report(rows))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"triton": triton.__version__, "specializations": rows}, fh, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
