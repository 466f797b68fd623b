"""Ahead-of-time gate: lower the kernels the module launches to cubin for GPUs this machine lacks.

    TRITON_INTERPRET=0 python -m torchrec_triton_tbe.aot [--targets 90,100] [--full] [--json out.json]

How the specializations are found: the module itself is driven (forward + backward, on CPU tensors)
over the product of its options — weights/output/index/per-sample-weight dtypes, SUM/MEAN, EXACT_SGD
and EXACT_ROWWISE_ADAGRAD, stochastic rounding, every bounds-check mode with and without the fused check, the
transpose hoist, and two table layouts whose widths cover every BLOCK_D from 4 to 2048 with and
without padding; then sequence (NONE) modules of each width, variable batches (VBE), and every other
optimizer variant (``optimizer_variants``) with each weights dtype; plus a forward on bags as long as the widest gather knob — while
``JITFunction.run`` is replaced by a recorder. Each launch yields one specialization: kernel,
argument types, constexpr values, num_warps and maxnreg (what Triton compiles on).

What is compiled: by default a covering set — every kernel (the forward's bag-lanes body counted as a
kernel of its own) with every value of every argument type, constexpr and num_warps at least once
(about a hundred specializations per target), with the module driven over the full product of its
dtype/pooling/optimizer/rounding options and a rotating slice of the bounds/fused/hoist/index/psw
options. ``--full`` drives the full option product and compiles every
distinct specialization recorded (about twenty thousand; many hours on two cores).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from torchrec_triton_tbe import _env, _resources
from torchrec_triton_tbe.ops.launch import launch_options

_TORCH_TO_TRITON = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.bool: "i1",
    torch.int8: "i8",
}


def _arg_type(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TORCH_TO_TRITON[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"unexpected kernel argument {value!r}")


def specialization(fn, args, kwargs) -> tuple:
    """(signature, constexprs, divisible argument indices, num_warps, maxnreg) of ``fn(*args, **kwargs)``
    as the JIT specializes it: ints equal to 1 become constants, 16-aligned pointers and ints divisible
    by 16 carry tt.divisibility (the compiler vectorises on it); parameters the kernel marks
    ``do_not_specialize`` get neither (Triton 3.6 and 3.8). maxnreg: None unless the launch capped
    registers."""
    kwargs = dict(kwargs)
    num_warps = kwargs.pop("num_warps", 4)
    maxnreg = kwargs.pop("maxnreg", None)
    params = list(fn.params)
    bound = dict(zip([p.name for p in params], args))
    bound.update(kwargs)
    signature, constexprs, divisible = {}, {}, []
    for i, p in enumerate(params):
        value = bound[p.name] if p.name in bound else p.default  # a parameter left at its default
        plain = getattr(p, "do_not_specialize", False)
        if p.is_constexpr or (not plain and isinstance(value, int) and not isinstance(value, bool) and value == 1):
            signature[p.name] = "constexpr"
            constexprs[p.name] = getattr(value, "value", value)
        else:
            signature[p.name] = _arg_type(value)
            if isinstance(value, torch.Tensor) and value.data_ptr() % 16 == 0:
                divisible.append(i)
            elif not plain and isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0:
                divisible.append(i)
    return signature, constexprs, tuple(divisible), num_warps, maxnreg


def lower(fn, signature: dict, constexprs: dict, divisible, num_warps: int, target: int, maxnreg=None):
    """One specialization of ``fn`` compiled for sm_``target`` with ``triton.compile`` (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    job = _job(fn, signature, constexprs, divisible, num_warps, target, maxnreg)
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=job["attrs"]),
                          target=GPUTarget(*job["target"]), options=job["options"])


def _cuda_target(target: int) -> tuple:
    return ("cuda", target, 32)  # GPUTarget's fields: backend, compute capability, warp size


def _job(fn, signature: dict, constexprs: dict, divisible, num_warps: int, target: int, maxnreg=None) -> dict:
    # What ``lower`` hands triton.compile, as ops/precompile.py's compile workers take it.
    return dict(module=fn.fn.__module__, name=fn.fn.__name__, signature=signature, constexprs=constexprs,
                attrs={(i,): [["tt.divisibility", 16]] for i in divisible}, target=_cuda_target(target),
                options=launch_options(num_warps, maxnreg))


def cubin_compiler(target: int):
    """A ``compile_fn`` for ``ops/precompile.precompile`` that lowers a recorded launch to a ``target``
    cubin (``lower``)."""

    def compile_one(recorded):
        *spec, maxnreg = specialization(recorded.kernel, recorded.args, {**recorded.constexprs, **recorded.options})
        return lower(recorded.kernel, *spec, target, maxnreg)

    return compile_one


def cubin_job(target: int):
    """A ``job_fn`` for ``ops/precompile.precompile``: the compile job of a recorded launch for a
    ``target`` cubin, exactly what ``cubin_compiler(target)`` compiles (so a worker's result is its
    cache hit)."""

    def job_of(recorded):
        *spec, maxnreg = specialization(recorded.kernel, recorded.args, {**recorded.constexprs, **recorded.options})
        # The kernel's source hash as this process has it, as ops/precompile._jit_job's jobs carry it
        # (Triton 3.6 hashes a kernel by the order its callees were first hashed in a process).
        return dict(_job(recorded.kernel, *spec, target, maxnreg), cache_key=recorded.kernel.cache_key)

    job_of.target = _cuda_target(target)  # what precompile's workers warm up for
    return job_of


@contextmanager
def recording() -> Iterator[dict]:
    """Replace kernel launches by a record of (kernel, signature, constexprs, divisible, num_warps, maxnreg)."""
    from triton.runtime.jit import JITFunction

    seen: dict = {}
    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        signature, constexprs, divisible, num_warps, maxnreg = specialization(self, args, kwargs)
        key = (self.fn.__name__, tuple(signature.items()), tuple(sorted(constexprs.items())), divisible, num_warps,
               maxnreg)
        seen.setdefault(key, (self, signature, constexprs, divisible, num_warps, maxnreg))

    JITFunction.run = record
    previous = _env.RECORD_LAUNCHES
    _env.RECORD_LAUNCHES = True
    try:
        yield seen
    finally:
        JITFunction.run = original
        _env.RECORD_LAUNCHES = previous


def _layouts() -> list[list[tuple[int, int]]]:
    pow2 = [4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
    odd = [3, 6, 12, 20, 36, 72, 160, 320, 640, 1280]
    return [[(7, d) for d in pow2], [(7, d) for d in odd]]


def drive_module(exhaustive: bool = False, kernel_config=None) -> dict:
    """Run forward + backward of the module under every option combination, recording launches.
    ``kernel_config`` (a target name such as "sm90") sets the knobs the launches use."""
    from torchrec_triton_tbe._fbgemm import BoundsCheckMode, EmbOptimType, PoolingMode, SparseType
    from torchrec_triton_tbe.config import LONG_PATHS, load_config
    from torchrec_triton_tbe.module import TritonTBE

    dtypes = [SparseType.FP32, SparseType.FP16, SparseType.BF16]
    optims = [EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ROWWISE_ADAGRAD]
    bounds = [BoundsCheckMode.FATAL, BoundsCheckMode.WARNING, BoundsCheckMode.IGNORE, BoundsCheckMode.NONE]
    psw_dtypes = [None, torch.float32, torch.float16, torch.bfloat16]
    # The forward's lanes path shrinks GATHER to the mean bag length (ops/forward.lanes_gather), so the
    # short bags below would never record the configured widths: a second, forward-only batch has bags
    # as long as the widest gather knob.
    base = load_config(torch.device("cpu"), kernel_config)
    # B = 16 below is a small batch (config forward.small_batch): the regular forward tables are
    # recorded through a copy without the small-batch ones, alternated with the shipped config.
    bases = [base] if base.forward.small_batch == 0 else [base, base.replace_forward(small_batch=0)]
    # Both long-path schedules are shipped (config backward.long_path): alternate them over the options.
    long_paths = [b.replace_backward(long_path=p) for p in LONG_PATHS for b in bases]
    tables = [base.forward.gather] + ([base.forward.gather_small] if base.forward.gather_small else [])
    long_L = max(v for t in tables for v in [t.default, *(v for _, v in t.by_block_d)])
    with recording() as seen:
        for layout in _layouts():
            T = len(layout)
            B = 16  # a multiple of 16, as real batches are: the JIT then specializes B as divisible
            lengths = torch.tensor([1, 2] * (T * B // 2))
            offsets = torch.zeros(T * B + 1, dtype=torch.int64)
            offsets[1:] = lengths.cumsum(0)
            indices = torch.tensor([0, 1, 2] * (T * B // 2), dtype=torch.int64)
            long_offsets = torch.arange(T * B + 1, dtype=torch.int64) * long_L
            long_indices = torch.arange(T * B * long_L, dtype=torch.int64) % 3
            outer = list(
                itertools.product(dtypes, dtypes, optims, [PoolingMode.SUM, PoolingMode.MEAN], [False, True])
            )
            inner = list(
                itertools.product(bounds, [False, True], [False, True], [torch.int64, torch.int32], psw_dtypes)
            )
            for i, (wp, od, opt, pm, sr) in enumerate(outer):
                # Every option pair of the outer product meets a rotating slice of the inner one (the
                # whole of it at i == 0); ``exhaustive`` runs the full product instead.
                mine = inner if exhaustive or i == 0 else [inner[(i * 7 + j) % len(inner)] for j in range(8)]
                for j, (bc, fused, hoist, idx_t, psw_t) in enumerate(mine):
                    m = TritonTBE(
                        layout,
                        weights_precision=wp,
                        output_dtype=od,
                        optimizer=opt,
                        pooling_mode=pm,
                        stochastic_rounding=sr,
                        bounds_check_mode=bc,
                        device="cpu",
                        fused_bounds_check=fused,
                        hoist_transpose=hoist,
                        embedding_table_index_type=idx_t,
                        kernel_config=long_paths[(i + j) % len(long_paths)],
                    )
                    psw = None if psw_t is None else torch.ones(indices.numel(), dtype=psw_t, requires_grad=True)
                    try:
                        out = m(indices.clone(), offsets.clone(), psw)
                    except ValueError:
                        continue  # FATAL reads uninitialised kernel outputs while recording
                    out.backward(torch.ones_like(out))
                    long_psw = None if psw_t is None else torch.ones(long_indices.numel(), dtype=psw_t)
                    try:
                        with torch.no_grad():
                            m(long_indices.clone(), long_offsets.clone(), long_psw)
                    except ValueError:
                        continue  # as above
            # Sequence lookups (PoolingMode.NONE: one D per module), each width of the layout, with 1, 2, 3
            # and T features (the feature search's step counts, bit lengths of features + 1: Triton 3.6 failed at
            # two steps, one to three features, once).
            for v, (wp, d) in enumerate(itertools.product(dtypes, sorted({d for _, d in layout}))):
                features = (T, 1, 2, 3)[v % 4]
                m = TritonTBE([(7, d)] * features, weights_precision=wp, output_dtype=dtypes[v % 3], device="cpu",
                              pooling_mode=PoolingMode.NONE, optimizer=optims[v % 2],
                              embedding_table_index_type=[torch.int64, torch.int32][v % 2],
                              kernel_config=long_paths[v % len(long_paths)])
                seq_offsets = offsets[: features * B + 1].clone()
                out = m(indices[: int(seq_offsets[-1])].clone(), seq_offsets)
                out.backward(torch.ones_like(out))
            # Variable batch per feature (VBE: the per-bag output table), pooled modes, weighted or not.
            sizes = [[B // 2, B // 4]] * T
            for v, (wp, pm) in enumerate(itertools.product(dtypes, [PoolingMode.SUM, PoolingMode.MEAN])):
                m = TritonTBE(layout, weights_precision=wp, output_dtype=dtypes[v % 3], pooling_mode=pm, device="cpu",
                              optimizer=optims[v % 2], kernel_config=long_paths[v % len(long_paths)])
                n_bags = T * (B // 2 + B // 4)
                vbe_offsets = offsets[: n_bags + 1].clone()
                vbe_indices = indices[: int(vbe_offsets[-1])].clone()
                psw = torch.ones(vbe_indices.numel(), requires_grad=True) if v % 2 else None
                out = m(vbe_indices, vbe_offsets, psw, batch_size_per_feature_per_rank=sizes)
                out.backward(torch.ones_like(out))
            # Every other optimizer variant (the update's constexprs), with each weights precision.
            for v, (wp, (opt, extra)) in enumerate(itertools.product(dtypes, optimizer_variants())):
                m = TritonTBE(layout, weights_precision=wp, optimizer=opt, stochastic_rounding=v % 2 == 0,
                              device="cpu", kernel_config=long_paths[v % len(long_paths)], **extra)
                out = m(indices.clone(), offsets.clone())
                out.backward(torch.ones_like(out))
            # The small-table path (config small_table), switched on for every batch and table: the
            # layout's tables at 7 rows (E_PAD 16) and the widest reach (64 rows), every precision,
            # pooling, per-sample weights, optimizer. Both passes: the shipped backward-only choice keeps
            # the small tables in the generic buckets, which compiles the same kernels.
            small = [b.replace_small_table(max_rows=64, forward=1, backward=1, backward_min_bag=0,
                                           backward_min_batch=0) for b in long_paths]
            small_layout = [(7 if k % 2 else 64, d) for k, (_, d) in enumerate(layout)]
            variants = [(o, {}) for o in optims] + optimizer_variants()
            for v, (wp, pm, weighted) in enumerate(itertools.product(dtypes, [PoolingMode.SUM, PoolingMode.MEAN],
                                                                     [False, True])):
                for u, (opt, extra) in enumerate(variants if v == 0 else variants[v % 2: v % 2 + 1]):
                    m = TritonTBE(small_layout, weights_precision=wp, optimizer=opt, pooling_mode=pm, device="cpu",
                                  output_dtype=dtypes[(v + u) % 3], stochastic_rounding=(v + u) % 2 == 0,
                                  kernel_config=small[(v + u) % len(small)], **extra)
                    psw = torch.ones(indices.numel(), requires_grad=True) if weighted else None
                    out = m(indices.clone(), offsets.clone(), psw)
                    out.backward(torch.ones_like(out))
    return seen


def optimizer_variants() -> list[tuple]:
    """(optimizer, extra constructor keywords) for every update specialization besides the plain
    EXACT_SGD / EXACT_ROWWISE_ADAGRAD ones (weight decay modes, max_norm, bias correction, bf16 state)."""
    from torchrec_triton_tbe._fbgemm import EmbOptimType, SparseType, UserEnabledConfigDefinition, WeightDecayMode

    rwa = EmbOptimType.EXACT_ROWWISE_ADAGRAD
    return [
        (rwa, dict(weight_decay=0.01, weight_decay_mode=WeightDecayMode.L2)),
        (rwa, dict(weight_decay=0.01, weight_decay_mode=WeightDecayMode.DECOUPLE, max_norm=1.0)),
        (EmbOptimType.EXACT_ADAGRAD, {}),
        (EmbOptimType.ADAM, {}),
        (EmbOptimType.ADAM, dict(extra_optimizer_config=UserEnabledConfigDefinition(use_rowwise_bias_correction=True))),
        (EmbOptimType.PARTIAL_ROWWISE_ADAM, {}),
        (EmbOptimType.PARTIAL_ROWWISE_ADAM,
         dict(optimizer_state_dtypes={"momentum1": SparseType.BF16, "momentum2": SparseType.BF16})),
        (EmbOptimType.LAMB, {}),
        (EmbOptimType.PARTIAL_ROWWISE_LAMB, {}),
        (EmbOptimType.LARS_SGD, {}),
    ]


def _code_path(name: str, consts: tuple) -> str:
    """The forward's bag-lanes mode (LANES > 1) is a second body of the same kernel behind a constexpr:
    covered as a kernel of its own, so each of its options is compiled on the lanes path too."""
    if name == "_pooled_forward_kernel" and dict(consts).get("LANES", 1) > 1:
        return name + "[lanes]"
    return name


def covering_set(seen: dict) -> list:
    """Specializations such that every (kernel path, axis, value) recorded appears at least once."""
    chosen, covered = [], set()
    for key, spec in sorted(seen.items(), key=lambda kv: repr(kv[0])):
        name, sig, consts, _divisible, warps, maxnreg = key
        name = _code_path(name, consts)
        items = {(name, "sig", a, t) for a, t in sig} | {(name, "const", a, repr(v)) for a, v in consts}
        items |= {(name, "num_warps", warps), (name, "maxnreg", maxnreg)}
        if not items <= covered:
            chosen.append(spec)
            covered |= items
    return chosen


def compile_all(specs: list, targets: list[int]) -> list[dict]:
    results = []
    for fn, signature, constexprs, divisible, num_warps, maxnreg in specs:
        for cc in targets:
            t0 = time.time()
            compiled = lower(fn, signature, constexprs, divisible, num_warps, cc, maxnreg)
            ptx = compiled.asm["ptx"]
            results.append(
                {
                    "kernel": fn.fn.__name__,
                    "target": f"sm_{cc}",
                    "constexprs": {k: v if isinstance(v, (int, bool)) else repr(v) for k, v in constexprs.items()},
                    "signature": {k: v for k, v in signature.items() if v != "constexpr"},
                    "num_warps": num_warps,
                    "maxnreg": maxnreg,
                    "cubin_bytes": len(compiled.asm["cubin"]),
                    "atomics_in_ptx": ptx.count("atom.global") + ptx.count("red.global"),
                    # Registers, stack frame, local memory (a stack or local memory: spilled registers).
                    **_resources.cubin_usage(compiled.asm["cubin"]),
                    "seconds": round(time.time() - t0, 2),
                }
            )
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default="90,100", help="compute capabilities, comma separated")
    ap.add_argument("--full", action="store_true", help="compile every recorded specialization")
    ap.add_argument("--json", help="write the per-kernel report here")
    ap.add_argument("--dump-specs", help="write the chosen specializations (JSON) instead of compiling, for "
                    "tools/compile_specs.py under another Triton version")
    args = ap.parse_args(argv)
    if _env.interpreting():
        print("aot: run with TRITON_INTERPRET=0 (kernels must be compiled, not interpreted)", file=sys.stderr)
        return 2
    if args.dump_specs:
        dumped = []
        for cc in [int(x) for x in args.targets.split(",")]:
            for fn, sig, consts, divisible, warps, maxnreg in covering_set(drive_module(kernel_config=f"sm{cc}")):
                dumped.append({"target": cc, "module": fn.fn.__module__, "kernel": fn.fn.__name__, "signature": sig,
                               "constexprs": consts, "divisible": list(divisible), "num_warps": warps,
                               "maxnreg": maxnreg})
        with open(args.dump_specs, "w") as fh:
            json.dump(dumped, fh)
        print(f"aot: wrote {len(dumped)} specializations to {args.dump_specs}")
        return 0
    t0 = time.time()
    results = []
    for cc in [int(x) for x in args.targets.split(",")]:
        # Each target's launches use that target's tuned knobs (configs/sm<cc>.yaml).
        seen = drive_module(exhaustive=args.full, kernel_config=f"sm{cc}")
        specs = list(seen.values()) if args.full else covering_set(seen)
        print(f"aot: sm_{cc}: {len(seen)} distinct specializations recorded; compiling {len(specs)}", flush=True)
        results += compile_all(specs, [cc])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    by_kernel: dict = {}
    for r in results:
        k = by_kernel.setdefault((r["kernel"], r["target"]), [0, 0, 0, 0])
        k[0] += 1
        k[1] = max(k[1], r["atomics_in_ptx"])
        k[2] = max(k[2], r["registers"])
        k[3] += _resources.spills(r)
    for (kernel, target), (n, atomics, regs, spilled) in sorted(by_kernel.items()):
        print(f"{target:7s} {kernel:34s} {n:4d} cubins   max atomics in ptx: {atomics}   max registers: {regs}"
              f"   spilling: {spilled}")
    print(f"aot: {len(results)} cubins in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
