"""One case: build TritonTBE (and FBGEMM's TBE) with identical weights, check, time, log.

Constructor arguments are those FBGEMM's ``device`` command passes (``learning_rate=0.1``, ``eps=0.1``,
``feature_table_map=range(T)``, the case's precisions, pooling, bounds check and rounding). Forward is
optimizer-independent, so it is timed once per case (with the first optimizer's modules); the
backward is timed per optimizer. Both kernels update weights in place during the backward runs, as
in FBGEMM's benchmark; that changes values, not the work done.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch

from torchrec_triton_tbe._fbgemm import (
    BoundsCheckMode,
    CacheAlgorithm,
    ComputeDevice,
    EmbeddingLocation,
    EmbOptimType,
    PoolingMode,
    SparseType,
)
from torchrec_triton_tbe.bench.batches import Workload
from torchrec_triton_tbe.bench.case import OPTIMIZERS
from torchrec_triton_tbe.bench.report import BYTES_PER_ELEMENT, case_bytes, gbps, log_line
from torchrec_triton_tbe.bench.timing import time_steps
from torchrec_triton_tbe.module import TritonTBE

_OPTIMIZER = {name: EmbOptimType[name.upper()] for name in OPTIMIZERS}
_POOLING = {"sum": PoolingMode.SUM, "mean": PoolingMode.MEAN, "none": PoolingMode.NONE}
# --check tolerances by the least precise dtype involved. Forward: FBGEMM's forward tests (1e-5 for
# fp32, 8e-3 otherwise; bf16 looser by its 3 fewer mantissa bits). Weights after one update: the
# package's test table, fp32 loosened for runs of ~10^4 lookups summed in a different order.
_FWD_TOL = {"fp32": (1e-5, 1e-5), "fp16": (8e-3, 8e-3), "bf16": (4e-2, 4e-2)}
_WEIGHT_TOL = {"fp32": (1e-4, 1e-3), "fp16": (5e-3, 2e-2), "bf16": (4e-2, 4e-2)}
_RANK = ("fp32", "fp16", "bf16")
KERNELS = ("triton", "fbgemm")


@dataclasses.dataclass(frozen=True)
class RunOptions:
    device: torch.device
    compare: bool = False
    check: bool = False
    kernel_config: Optional[str] = None
    fused_bounds_check: bool = False
    hoist_transpose: bool = False


def _least_precise(*names: str) -> str:
    return max(names, key=_RANK.index)


def build_modules(w: Workload, optimizer: str, opts: RunOptions) -> dict[str, torch.nn.Module]:
    case = w.case
    common = dict(
        feature_table_map=list(range(case.num_tables)),
        weights_precision=SparseType(case.weights_precision),
        output_dtype=SparseType(case.output_dtype),
        optimizer=_OPTIMIZER[optimizer],
        stochastic_rounding=case.stoc,
        learning_rate=0.1,
        eps=0.1,
        pooling_mode=_POOLING[case.pooling],
        bounds_check_mode=BoundsCheckMode(case.bounds_check_mode),
    )
    rows = [case.num_embeddings_at(t) for t in range(case.num_tables)]
    ours = TritonTBE(
        list(zip(rows, w.Ds)),
        device=opts.device,
        kernel_config=opts.kernel_config,
        fused_bounds_check=opts.fused_bounds_check,
        hoist_transpose=opts.hoist_transpose,
        **common,
    )
    gen = torch.Generator(device=opts.device).manual_seed(0)
    with torch.no_grad():
        for table in ours.split_embedding_weights():
            table.uniform_(-0.01, 0.01, generator=gen)
    modules: dict[str, torch.nn.Module] = {"triton": ours}
    if opts.compare:
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

        cuda = opts.device.type == "cuda"
        location = ((EmbeddingLocation.DEVICE, ComputeDevice.CUDA) if cuda
                    else (EmbeddingLocation.HOST, ComputeDevice.CPU))
        fbgemm = SplitTableBatchedEmbeddingBagsCodegen(
            [(e, d, *location) for e, d in zip(rows, w.Ds)],
            cache_algorithm=CacheAlgorithm.LRU,
            cache_load_factor=0.2,
            **common,
        ).to(opts.device)
        with torch.no_grad():  # same initial weights
            for src, dst in zip(ours.split_embedding_weights(), fbgemm.split_embedding_weights()):
                dst.copy_(src)
        modules["fbgemm"] = fbgemm
    return modules


def _call(module: torch.nn.Module, w: Workload, i: int) -> torch.Tensor:
    r = w.requests[i % len(w.requests)]
    # As FBGEMM's benchmark: the batches are int64; --indices-dtype 32 casts inside the timed call.
    dt = torch.int32 if w.case.indices_dtype == 32 else torch.int64
    vbe = w.batch_size_per_feature_per_rank
    if vbe is None:
        return module(r.indices.to(dt), r.offsets.to(dt), r.per_sample_weights)
    return module(r.indices.to(dt), r.offsets.to(dt), r.per_sample_weights, batch_size_per_feature_per_rank=vbe)


def forward_step(module: torch.nn.Module, w: Workload) -> Callable[[int], Callable[[], object]]:
    return lambda i: (lambda: _call(module, w, i))


def backward_step(module: torch.nn.Module, w: Workload) -> Callable[[int], Callable[[], object]]:
    def step(i: int):
        out = _call(module, w, i)  # outside the timed region
        return lambda: out.backward(w.grad_output)

    return step


# -------------------------------------------------------------------------------------------------- check
def _compare(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float, rows_per_chunk: int = 1 << 20) -> dict:
    """max |a - b| and the count of elements beyond atol + rtol |b|, in row chunks (tables can be GBs)."""
    max_diff, bad = 0.0, 0
    a2, b2 = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
    for start in range(0, a2.shape[0], rows_per_chunk):
        x = a2[start : start + rows_per_chunk].double()
        y = b2[start : start + rows_per_chunk].double()
        diff = (x - y).abs()
        if diff.numel():
            max_diff = max(max_diff, float(diff.max()))
        bad += int((diff > atol + rtol * y.abs()).sum()) + int(torch.isnan(x).sum())
    return {"max_abs_diff": max_diff, "mismatched": bad, "numel": a.numel(), "atol": atol, "rtol": rtol, "ok": bad == 0}


def check_first_batch(modules: dict[str, torch.nn.Module], w: Workload, optimizer: str) -> dict[str, Any]:
    """Forward outputs on the first batch, then weights and every optimizer state tensor after one
    backward."""
    case = w.case
    outs = {}
    for name, module in modules.items():
        out = _call(module, w, 0)
        out.backward(w.grad_output)
        outs[name] = out.detach()
    ours, ref = modules["triton"], modules["fbgemm"]
    result: dict[str, Any] = {"output": _compare(outs["triton"], outs["fbgemm"],
                                                 *_FWD_TOL[_least_precise(case.weights_precision, case.output_dtype)])}
    w_tol = _WEIGHT_TOL[_least_precise(case.weights_precision, case.output_dtype)]
    per_table = [_compare(a, b, *w_tol) for a, b in zip(ours.split_embedding_weights(), ref.split_embedding_weights())]
    result["weights_after_backward"] = _merge(per_table)
    s_tol = (1e-6, 1e-3) if case.output_dtype == "fp32" else (1e-4, 1e-2)
    # State after one step is a function of each gradient sum, which for a hot row of ~10^4 lookups can
    # cancel down to far below its terms: its fp32 error (summation order) is relative to the terms, not
    # to the sum. So the absolute tolerance scales with the tensor's largest value (H200, 2026-12-01:
    # Adagrad / Adam / LAMB states were off in 4-19 of 2-8 billion elements with a fixed 1e-6, weights
    # all within theirs).
    states = [_compare(a, b, s_tol[0] + 1e-5 * float(b.abs().max()), s_tol[1])
              for mine, theirs in zip(ours.split_optimizer_states(), ref.split_optimizer_states())
              for a, b in zip(mine, theirs)]
    if states:
        result["state_after_backward"] = _merge(states)
    result["ok"] = all(v["ok"] for v in result.values() if isinstance(v, dict))
    return result


def _merge(parts: list[dict]) -> dict:
    return {
        "max_abs_diff": max(p["max_abs_diff"] for p in parts),
        "mismatched": sum(p["mismatched"] for p in parts),
        "numel": sum(p["numel"] for p in parts),
        "atol": parts[0]["atol"],
        "rtol": parts[0]["rtol"],
        "ok": all(p["ok"] for p in parts),
    }


# -------------------------------------------------------------------------------------------------- timing
def run_case(w: Workload, opts: RunOptions, emit: Callable[[str], None],
             baseline_ms: Optional[dict[str, float]] = None) -> dict[str, Any]:
    case = w.case
    T = case.num_tables
    # FBGEMM's log line prints one B, E and L: per-table lists show as their mean.
    B = round(sum(case.batch_size_at(t) for t in range(T)) / T)
    E = round(sum(case.num_embeddings_at(t) for t in range(T)) / T)
    L = round(sum(case.bag_size_at(t) for t in range(T)) / T)
    rw_bytes = case_bytes(case, w.Ds)
    param_bytes = BYTES_PER_ELEMENT[case.weights_precision]
    nparams = sum(d * case.num_embeddings_at(t) for t, d in enumerate(w.Ds))
    accessed = sum(case.batch_size_at(t) * d * case.bag_size_at(t) for t, d in enumerate(w.Ds)) * param_bytes
    # FBGEMM's two header lines, same wording.
    emit(f"[{case.name}] Embedding parameters: {nparams / 1.0e9: .2f} GParam, {nparams * param_bytes / 1.0e9: .2f} GB")
    emit(f"[{case.name}] Accessed weights per batch: {accessed / 1.0e9: .2f} GB")
    stats = w.stats
    emit(f"[{case.name}] batches: {stats['distribution']}, {stats['unique_rows']} runs, max run "
         f"{stats['max_run_length']}, {stats['lookups_in_runs_ge_256_frac']:.1%} of lookups in runs >= 256, "
         f"{stats['lookups_in_runs_lt_4_frac']:.1%} in runs < 4")
    record: dict[str, Any] = {
        "name": case.name,
        "label": case.label(),
        "options": case.options(),
        "Ds": list(w.Ds),
        "lookups": case.lookups,
        "read_write_bytes": rw_bytes,
        "generator": stats,
        "baseline_ms": baseline_ms,
        "results": {},
        "check": {} if opts.check else None,
    }
    kernels = KERNELS if opts.compare else KERNELS[:1]
    warmup = case.warmup_runs + 1  # FBGEMM's benchmark_requests always adds one

    def measure(modules, key: str, make_step, backward: bool, prefix_extra: str) -> None:
        entry: dict[str, Any] = {}
        for kernel in kernels:
            timing = time_steps(make_step(modules[kernel], w), case.iters, warmup, opts.device,
                                case.flush_gpu_cache_size_mb)
            bw = gbps(rw_bytes, timing.median_ms, backward)
            entry[kernel] = {**timing.as_dict(), "gbps": bw}
            emit(log_line(f"{kernel}{prefix_extra}", backward, B, E, T, w.D_logged, L, case.weighted, bw,
                          timing.median_ms * 1e3))
        if opts.compare:
            entry["speedup"] = entry["fbgemm"]["median_ms"] / entry["triton"]["median_ms"]
            emit(f"speedup {key} (fbgemm / triton median): {entry['speedup']:.3f}x")
        if baseline_ms and baseline_ms.get(key) is not None:
            entry["baseline_ms"] = baseline_ms[key]
            entry["speedup_vs_baseline"] = baseline_ms[key] / entry["triton"]["median_ms"]
        record["results"][key] = entry

    for k, optimizer in enumerate(case.optimizers):
        modules = build_modules(w, optimizer, opts)
        if opts.check:
            record["check"][optimizer] = check = check_first_batch(modules, w, optimizer)
            emit(f"[{case.name}] check {optimizer}: {'ok' if check['ok'] else 'MISMATCH'} "
                 f"(output max|diff| {check['output']['max_abs_diff']:.3e}, weights max|diff| "
                 f"{check['weights_after_backward']['max_abs_diff']:.3e})")
        if "fwd" in case.passes and k == 0:
            measure(modules, "fwd", forward_step, False, "")
        if "bwd" in case.passes:
            measure(modules, f"bwd_{optimizer}", backward_step, True, f" {optimizer}")
        del modules
        if opts.device.type == "cuda":
            torch.cuda.empty_cache()
    return record
