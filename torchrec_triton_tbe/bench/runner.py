"""One case: build TritonTBE (and FBGEMM's TBE, TorchRec's Triton TBE) with identical weights, check,
time, log.

Constructor arguments are those FBGEMM's ``device`` command passes (``learning_rate=0.1``, ``eps=0.1``,
``feature_table_map=range(T)``, the case's precisions, pooling, bounds check and rounding). Forward is
optimizer-independent, so it is timed once per case (with the first optimizer's modules); the
backward is timed per optimizer. Both kernels update weights in place during the backward runs, as
in FBGEMM's benchmark; that changes values, not the work done.

Peers (``bench/peers.py``: TorchRec's Triton TBE, loaded from a checkout) get the same constructor
arguments where they have them. A pass a peer cannot run (MEAN or sequence pooling, an optimizer it
lacks, ...) is recorded as ``{"skipped": reason}`` under the peer in that pass's entry, with one log line;
its forward is still timed when only the optimizer is missing (built with exact_sgd: the forward does not
depend on it). Off the GPU, FBGEMM's CPU TBE is skipped the same way where it cannot run a pass or
computes it unlike its CUDA TBE (fbgemm_cpu_skip_reason), and --check then compares ours with the
pure-PyTorch reference as well (uses_reference).
"""

from __future__ import annotations

import dataclasses
import functools
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
from torchrec_triton_tbe.bench import peers
from torchrec_triton_tbe.bench.batches import Workload
from torchrec_triton_tbe.bench.case import COMPARE_KERNELS, OPTIMIZERS
from torchrec_triton_tbe.bench.report import BYTES_PER_ELEMENT, case_bytes, gbps, log_line, spec_log_line
from torchrec_triton_tbe.bench.timing import time_steps
from torchrec_triton_tbe.bench.vbe_command import vbe_lines
from torchrec_triton_tbe.module import TritonTBE
from torchrec_triton_tbe.reference import ReferenceTBE

LEARNING_RATE, EPS = 0.1, 0.1  # FBGEMM's device command's
_OPTIMIZER = {name: EmbOptimType[name.upper()] for name in OPTIMIZERS}
_POOLING = {"sum": PoolingMode.SUM, "mean": PoolingMode.MEAN, "none": PoolingMode.NONE}
# --check tolerances by the least precise dtype involved. Forward: FBGEMM's forward tests (1e-5 for
# fp32, 8e-3 otherwise; bf16 looser by its 3 fewer mantissa bits). Weights after one update: the
# package's test table, fp32 loosened for runs of ~10^4 lookups summed in a different order.
_FWD_TOL = {"fp32": (1e-5, 1e-5), "fp16": (8e-3, 8e-3), "bf16": (4e-2, 4e-2)}
_WEIGHT_TOL = {"fp32": (1e-4, 1e-3), "fp16": (5e-3, 2e-2), "bf16": (4e-2, 4e-2)}
_RANK = ("fp32", "fp16", "bf16")
KERNELS = ("triton", *COMPARE_KERNELS)  # ours first; the speed-ups are theirs / ours


@dataclasses.dataclass(frozen=True)
class RunOptions:
    device: torch.device
    # Kernels to run besides ours, of COMPARE_KERNELS; a bool still works (True: ("fbgemm",), the old flag).
    compare: tuple[str, ...] = ()
    check: bool = False
    kernel_config: Optional[str] = None
    fused_bounds_check: bool = False
    hoist_transpose: bool = False
    torchrec_checkout: Optional[str] = None  # for "torchrec_triton": holds torchrec/distributed/triton_tbe/

    def __post_init__(self) -> None:
        compare = self.compare
        if isinstance(compare, bool):
            compare = ("fbgemm",) if compare else ()
        elif isinstance(compare, str):
            compare = tuple(x for x in compare.split(",") if x)
        compare = tuple(compare)
        unknown = [k for k in compare if k not in COMPARE_KERNELS]
        if unknown:
            raise ValueError(f"compare {unknown}: choose from {', '.join(COMPARE_KERNELS)}")
        if "torchrec_triton" in compare and not self.torchrec_checkout:
            raise ValueError("compare torchrec_triton needs a TorchRec checkout (--torchrec-checkout or "
                             f"${peers.CHECKOUT_ENV})")
        object.__setattr__(self, "compare", compare)

    @property
    def kernels(self) -> tuple[str, ...]:
        return ("triton", *(k for k in COMPARE_KERNELS if k in self.compare))


def _least_precise(*names: str) -> str:
    return max(names, key=_RANK.index)


PEERS = tuple(k for k in COMPARE_KERNELS if k != "fbgemm")


def _failure(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]


# What FBGEMM's CPU TBE (fbgemm-gpu-cpu 1.9.0, the --check oracle off the GPU) trains: its constructor
# asserts on any other optimizer.
FBGEMM_CPU_OPTIMIZERS = ("exact_sgd", "exact_adagrad", "exact_rowwise_adagrad")
# The bench's optimizers FBGEMM's TBE (1.6.0 and 1.9.0, CUDA and CPU) takes a variable batch with: its
# forward asserts on the others ("Variable batch size TBE support is enabled for ...").
FBGEMM_VBE_OPTIMIZERS = ("exact_sgd", "exact_rowwise_adagrad", "adam")


def skip_reason(kernel: str, w: Workload, optimizer: Optional[str], device: torch.device) -> Optional[str]:
    """Why ``kernel`` cannot run this case's forward (``optimizer`` None) or its backward with
    ``optimizer``; None when it can. Ours runs everything the bench offers; FBGEMM's CUDA TBE all but a
    variable batch with some optimizers, its CPU TBE less (fbgemm_cpu_skip_reason)."""
    if kernel == "triton":
        return None
    if kernel == "fbgemm":
        if w.case.vbe and optimizer is not None and optimizer not in FBGEMM_VBE_OPTIMIZERS:
            return (f"optimizer {optimizer} with a variable batch: FBGEMM's TBE takes one with "
                    f"{', '.join(FBGEMM_VBE_OPTIMIZERS)} only")
        if torch.device(device).type != "cuda":
            return fbgemm_cpu_skip_reason(w.case, optimizer)
        return fbgemm_cuda_bf16_failure(torch.device(device)) if w.case.weights_precision == "bf16" else None
    return peers.peer_skip_reason(kernel, w.case, optimizer, device)


@functools.cache
def fbgemm_cuda_bf16_failure(device: torch.device) -> Optional[str]:
    """Why FBGEMM's CUDA TBE cannot run bf16 weights on ``device``, or None: a one-table forward, once
    per process. FBGEMM 1.6.0 refuses cache_precision bf16 ("cache_precision bf16 not supported!"); with
    FP32, the bench's choice (no table is cached), its forward raised "not implemented for emb_t
    'BFloat16'" (H100, 2026-12-06): that build dispatches no bf16-weights forward. A failure that does
    not name bf16 is not this one, and propagates."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    try:
        module = SplitTableBatchedEmbeddingBagsCodegen(
            [(8, 4, EmbeddingLocation.DEVICE, ComputeDevice.CUDA)], weights_precision=SparseType.BF16,
            cache_precision=SparseType.FP32, output_dtype=SparseType.FP32).to(device)
        module(torch.zeros(1, dtype=torch.int64, device=device), torch.tensor([0, 1], device=device))
        torch.cuda.synchronize(device)
    except RuntimeError as e:
        message = str(e)
        lowered = message.lower()
        if "bfloat16" not in lowered and "bf16" not in lowered:
            raise
        return f"FBGEMM's CUDA TBE here runs no bf16 weights (a one-table forward raised: {message[:200]})"
    return None


def fbgemm_cpu_skip_reason(case: Any, optimizer: Optional[str]) -> Optional[str]:
    """What FBGEMM's CPU TBE cannot run of this case (see skip_reason), so that a CPU run records it as
    skipped instead of failing the shape or reporting a mismatch that is FBGEMM's CPU semantics."""
    if "bf16" in (case.weights_precision, case.output_dtype):
        return "FBGEMM's CPU TBE has no bf16 kernels (its forward raises NotImplementedError for BFloat16)"
    if case.weighted and case.pooling == "mean" and case.output_dtype != "fp32":
        return ("weighted MEAN with a 16-bit output: FBGEMM's CPU forward leaves out the 1/L there (its fp32 "
                "output and its CUDA forward apply it)")
    if optimizer is None:
        return None
    if optimizer not in FBGEMM_CPU_OPTIMIZERS:
        return f"optimizer {optimizer}: FBGEMM's CPU TBE trains {', '.join(FBGEMM_CPU_OPTIMIZERS)} only"
    if case.weighted and case.pooling == "mean":
        # fbgemm_gpu/codegen/training/backward/embedding_backward_split_cpu_template.cpp: "MEAN pooling
        # will not work with indice_weights!" (its CPU forward divides by L; its CUDA backward does too).
        return ("weighted MEAN: FBGEMM's CPU backward leaves out the 1/L its forward applies (its CUDA "
                "backward and ours apply it)")
    return None


class Modules(dict):
    """build_modules' {kernel: module}, plus ``errors``: {peer: why} for a peer that raised while being
    built (recorded as {"error": why} in every entry of the shape, instead of losing the shape's other
    kernels' numbers; ours and FBGEMM's raise)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.errors: dict[str, str] = {}


def peer_error(modules: dict, kernel: str) -> Optional[str]:
    return getattr(modules, "errors", {}).get(kernel)


def build_modules(w: Workload, optimizer: str, opts: RunOptions) -> Modules:
    """Ours and every compared kernel that can run at least this case's forward, with identical weights.
    A peer lacking ``optimizer`` is built with exact_sgd (its forward is the same)."""
    case = w.case
    common = dict(
        feature_table_map=list(range(case.num_tables)),
        weights_precision=SparseType(case.weights_precision),
        output_dtype=SparseType(case.output_dtype),
        optimizer=_OPTIMIZER[optimizer],
        stochastic_rounding=case.stoc,
        learning_rate=LEARNING_RATE,
        eps=EPS,
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
    # Not FBGEMM's own start (uniform(-3e-4, 3e-4) in its device commands, zeros in vbe): the kernels'
    # times do not depend on the values, and every contender copies these weights.
    gen = torch.Generator(device=opts.device).manual_seed(0)
    with torch.no_grad():
        for table in ours.split_embedding_weights():
            table.uniform_(-0.01, 0.01, generator=gen)
    modules = Modules(triton=ours)
    if "fbgemm" in opts.compare and skip_reason("fbgemm", w, None, opts.device) is None:
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

        cuda = opts.device.type == "cuda"
        location = ((EmbeddingLocation.DEVICE, ComputeDevice.CUDA) if cuda
                    else (EmbeddingLocation.HOST, ComputeDevice.CPU))
        if skip_reason("fbgemm", w, optimizer, opts.device) is not None:
            # Its backward is skipped (an optimizer it lacks here): the forward is the same with any.
            common = dict(common, optimizer=_OPTIMIZER["exact_sgd"])
        # cache_precision defaults to the weights' and FBGEMM 1.6.0's CUDA module refuses bf16 there
        # ("cache_precision bf16 not supported!") though every table here is in device memory, uncached.
        cache = dict(cache_precision=SparseType.FP32) if cuda and case.weights_precision == "bf16" else {}
        fbgemm = SplitTableBatchedEmbeddingBagsCodegen(
            [(e, d, *location) for e, d in zip(rows, w.Ds)],
            cache_algorithm=CacheAlgorithm.LRU,
            cache_load_factor=0.2,
            **cache,
            **common,
        ).to(opts.device)
        with torch.no_grad():  # same initial weights
            for src, dst in zip(ours.split_embedding_weights(), fbgemm.split_embedding_weights()):
                dst.copy_(src)
        modules["fbgemm"] = fbgemm
    if "torchrec_triton" in opts.compare and skip_reason("torchrec_triton", w, None, opts.device) is None:
        peer_optimizer = optimizer if skip_reason("torchrec_triton", w, optimizer, opts.device) is None \
            else "exact_sgd"
        try:
            peer = peers.build_torchrec_triton(
                opts.torchrec_checkout, list(zip(rows, w.Ds)), case, peer_optimizer, opts.device,
                fused_bounds_check=opts.fused_bounds_check, hoist_transpose=opts.hoist_transpose)
            with torch.no_grad():  # same initial weights (its own are torch.empty)
                for src, dst in zip(ours.split_embedding_weights(), peer.split_embedding_weights()):
                    dst.copy_(src)
        except Exception as e:  # noqa: BLE001 - a peer's failure is its own result, recorded per pass
            modules.errors["torchrec_triton"] = _failure(e)
        else:
            modules["torchrec_triton"] = peer
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
    # Rows of the first dim (flatten, not reshape(n, -1): a batch of no lookups gives 0 x D, whose -1 is ambiguous).
    a2, b2 = (t.flatten(1) if t.dim() > 1 else t.reshape(-1, 1) for t in (a, b))
    for start in range(0, a2.shape[0], rows_per_chunk):
        x = a2[start : start + rows_per_chunk].double()
        y = b2[start : start + rows_per_chunk].double()
        diff = (x - y).abs()
        if diff.numel():
            max_diff = max(max_diff, float(diff.max()))
        bad += int((diff > atol + rtol * y.abs()).sum()) + int(torch.isnan(x).sum())
    return {"max_abs_diff": max_diff, "mismatched": bad, "numel": a.numel(), "atol": atol, "rtol": rtol, "ok": bad == 0}


def check_first_batch(modules: dict[str, torch.nn.Module], w: Workload, optimizer: str,
                      reference: bool = False) -> dict[str, Any]:
    """Forward outputs on the first batch, then weights and every optimizer state tensor after one
    backward, of every other kernel against ours. FBGEMM's comparison keeps its top-level keys
    (``output``, ``weights_after_backward``, ``state_after_backward``); a peer's sits under its name, its
    weights and state compared only where it ran this optimizer's backward (else ``{"skipped": why}``).
    ``reference``: ours also against the pure-PyTorch reference (torchrec_triton_tbe/reference.py), under
    ``"reference"``: where FBGEMM's CPU TBE, the oracle off the GPU, cannot check this case (uses_reference)."""
    case = w.case
    device = w.grad_output.device
    # The reference starts from the weights every kernel starts from: taken before our backward runs.
    tables0 = [t.detach().clone() for t in modules["triton"].split_embedding_weights()] if reference else None
    outs, stepped, failed = {}, set(), {}
    for name, module in modules.items():
        try:
            out = _call(module, w, 0)
            if skip_reason(name, w, optimizer, device) is None:
                out.backward(w.grad_output)
                stepped.add(name)
        except Exception as e:  # noqa: BLE001 - only a peer's failure is recorded; ours and FBGEMM's raise
            if name not in PEERS:
                raise
            failed[name] = _failure(e)
            continue
        outs[name] = out.detach()
    ours = modules["triton"]
    f_tol = _FWD_TOL[_least_precise(case.weights_precision, case.output_dtype)]
    w_tol = _WEIGHT_TOL[_least_precise(case.weights_precision, case.output_dtype)]
    s_tol = (1e-6, 1e-3) if case.output_dtype == "fp32" else (1e-4, 1e-2)

    def against(name: str) -> dict[str, Any]:
        ref = modules[name]
        part: dict[str, Any] = {"output": _compare(outs["triton"], outs[name], *f_tol)}
        if name not in stepped:
            part["weights_after_backward"] = {"skipped": skip_reason(name, w, optimizer, device)}
            return part
        part.update(_after_step(ours, ref.split_embedding_weights(), ref.split_optimizer_states(), w_tol, s_tol))
        return part

    result: dict[str, Any] = {}
    if "fbgemm" in modules:
        result.update(against("fbgemm"))
    if reference:
        result["reference"] = _against_reference(ours, tables0, w, outs["triton"], f_tol, w_tol, s_tol)
    for name in modules:
        if name in failed:
            result[name] = {"error": failed[name]}
        elif name not in ("triton", "fbgemm"):
            result[name] = against(name)
            result[name]["ok"] = _all_ok(result[name])
    # Nothing compared (FBGEMM skipped on the GPU, where the reference does not run, and no peer):
    # "ok" None, printed "unchecked", never a pass.
    compared = any(isinstance(v, dict) and "ok" in v for v in result.values())
    result["ok"] = _all_ok(result) if compared else None
    return result


def uses_reference(opts: RunOptions, w: Workload, optimizer: str) -> bool:
    """Whether --check also compares ours with the pure-PyTorch reference: FBGEMM is compared, but off the
    GPU its CPU TBE cannot run this case, or would not compute what its CUDA TBE does (fbgemm_cpu_skip_reason)."""
    return ("fbgemm" in opts.compare and opts.device.type != "cuda"
            and skip_reason("fbgemm", w, optimizer, opts.device) is not None)


def _against_reference(ours: TritonTBE, tables0: list[torch.Tensor], w: Workload, out: torch.Tensor,
                       f_tol: tuple, w_tol: tuple, s_tol: tuple) -> dict[str, Any]:
    """Ours (already stepped once on the first batch, output ``out``) against ReferenceTBE run from
    ``tables0`` with the bench's constructor arguments (build_modules): output, weights, optimizer state."""
    case, r = w.case, w.requests[0]
    ref = ReferenceTBE(tables0, list(range(case.num_tables)), mean=case.pooling == "mean",
                       optimizer=ours.spec.optimizer, learning_rate=LEARNING_RATE, eps=EPS,
                       output_dtype=ours.spec.output_dtype, nobag=case.pooling == "none")
    out64 = ref.forward(r.indices, r.offsets, r.per_sample_weights,
                        batch_size_per_feature_per_rank=w.batch_size_per_feature_per_rank)
    part: dict[str, Any] = {"output": _compare(out, ref.output(out64).detach(), *f_tol)}
    ref.backward(out64, w.grad_output)
    ref.step()
    part.update(_after_step(ours, ref.tables, ref.states, w_tol, s_tol))
    part["ok"] = _all_ok(part)
    return part


def _after_step(ours: TritonTBE, weights: list[torch.Tensor], states: list[list[torch.Tensor]], w_tol: tuple,
                s_tol: tuple) -> dict[str, Any]:
    """Our weights and optimizer state after one step against another's (per table): the check's
    ``weights_after_backward`` and, where the optimizer keeps state, ``state_after_backward``."""
    part = {"weights_after_backward": _merge([_compare(a, b, *w_tol)
                                              for a, b in zip(ours.split_embedding_weights(), weights)])}
    # State after one step is a function of each gradient sum, which for a hot row of ~10^4 lookups
    # can cancel down to far below its terms: its fp32 error (summation order) is relative to the
    # terms, not to the sum. So the absolute tolerance scales with the tensor's largest value (H200,
    # 2026-12-01: Adagrad / Adam / LAMB states were off in 4-19 of 2-8 billion elements with a fixed
    # 1e-6, weights all within theirs).
    compared = [_compare(a.reshape(b.shape), b, s_tol[0] + 1e-5 * float(b.abs().max()), s_tol[1])
                for mine, theirs in zip(ours.split_optimizer_states(), states) for a, b in zip(mine, theirs)]
    if compared:
        part["state_after_backward"] = _merge(compared)
    return part


def _all_ok(part: dict[str, Any]) -> bool:
    return all(v["ok"] for v in part.values() if isinstance(v, dict) and "ok" in v)


def check_summary(name: str, check: dict[str, Any]) -> str:
    """``<kernel> output max|diff| ..., weights max|diff| ...`` of one kernel's check part."""
    def diff(v: dict) -> str:
        return f"{v['max_abs_diff']:.3e}" if "max_abs_diff" in v else f"skipped: {v['skipped']}"

    return f"{name} output max|diff| {diff(check['output'])}, weights max|diff| {diff(check['weights_after_backward'])}"


def _peer_summary(name: str, part: dict[str, Any], built: bool) -> str:
    if "error" in part:
        return f"{name} error: {part['error']}"
    return check_summary(name, part) if built else f"{name} skipped: {part['skipped']}"


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
    alpha = round(sum(case.alpha_at(t) for t in range(T)) / T, 4)
    if case.command == "vbe":  # FBGEMM's vbe lines hold both passes: printed once both are measured
        def line(prefix: str, backward: bool, bw: float, us: float) -> None:
            return None
    elif case.command == "device-with-spec":  # its lines print the lists
        Ls = [case.bag_size_at(t) for t in range(T)]
        sigmas = None if case.bag_size_sigma_list is None else list(case.bag_size_sigma_list)
        alpha_shown = case.alpha if case.alpha_list is None else list(case.alpha_list)

        def line(prefix: str, backward: bool, bw: float, us: float) -> str:
            return spec_log_line(prefix, backward, B, [case.num_embeddings_at(t) for t in range(T)], w.Ds, Ls,
                                 sigmas, case.weighted, alpha_shown, bw, us)
    else:
        def line(prefix: str, backward: bool, bw: float, us: float) -> str:
            return log_line(prefix, backward, B, E, T, w.D_logged, L, case.weighted, bw, us, alpha)
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
        "lookups": stats["lookups"],  # drawn (case.lookups: the expected count, the same without sigmas)
        "read_write_bytes": rw_bytes,
        "generator": stats,
        "baseline_ms": baseline_ms,
        "results": {},
        "check": {} if opts.check else None,
    }
    kernels = opts.kernels
    warmup = case.warmup_runs + 1  # FBGEMM's benchmark_requests always adds one
    # Off the GPU ours runs in Triton's interpreter: a ratio of those times says nothing about kernels.
    caveat = "" if w.grad_output.device.type == "cuda" else " (CPU: Triton's interpreter, not a kernel-time ratio)"

    def measure(modules, key: str, make_step, backward: bool, prefix_extra: str, optimizer: Optional[str]) -> None:
        entry: dict[str, Any] = {}
        for kernel in kernels:
            reason = skip_reason(kernel, w, optimizer, opts.device)
            if reason is not None:
                entry[kernel] = {"skipped": reason}
                emit(f"{kernel}{prefix_extra} {'Backward' if backward else 'Forward'}: skipped ({reason})")
                continue
            error = peer_error(modules, kernel)
            if error is None:
                try:
                    timing = time_steps(make_step(modules[kernel], w), case.iters, warmup, opts.device,
                                        case.flush_gpu_cache_size_mb)
                except Exception as e:  # noqa: BLE001 - a peer's failure is its result; ours and FBGEMM's raise
                    if kernel not in PEERS:
                        raise
                    error = _failure(e)
            if error is not None:
                entry[kernel] = {"error": error}
                emit(f"{kernel}{prefix_extra} {'Backward' if backward else 'Forward'}: error ({error})")
                continue
            bw = gbps(rw_bytes, timing.median_ms, backward)
            entry[kernel] = {**timing.as_dict(), "gbps": bw}
            text = line(f"{kernel}{prefix_extra}", backward, bw, timing.median_ms * 1e3)
            if text:
                emit(text)
        for kernel in kernels[1:]:
            if "median_ms" not in entry[kernel]:
                continue
            # FBGEMM's keeps its historical name, "speedup"; others are "speedup_<kernel>".
            name = "speedup" if kernel == "fbgemm" else f"speedup_{kernel}"
            entry[name] = entry[kernel]["median_ms"] / entry["triton"]["median_ms"]
            emit(f"{name} {key} ({kernel} / triton median): {entry[name]:.3f}x{caveat}")
        if baseline_ms and baseline_ms.get(key) is not None:
            entry["baseline_ms"] = baseline_ms[key]
            entry["speedup_vs_baseline"] = baseline_ms[key] / entry["triton"]["median_ms"]
        record["results"][key] = entry

    for k, optimizer in enumerate(case.optimizers):
        modules = build_modules(w, optimizer, opts)
        if opts.check:
            record["check"][optimizer] = check = check_first_batch(modules, w, optimizer,
                                                                   reference=uses_reference(opts, w, optimizer))
            for name in opts.kernels:  # a compared kernel that cannot run this case at all, or failed to build
                if name not in modules:
                    error = peer_error(modules, name)
                    check[name] = {"error": error} if error else {"skipped": skip_reason(name, w, None, opts.device)}

            parts = [check_summary("fbgemm", check)] if "fbgemm" in modules else []
            parts += [_peer_summary(n, check[n], n in modules) for n in opts.kernels
                      if n != "triton" and (n != "fbgemm" or n not in modules)]
            if "reference" in check:
                parts.append(check_summary("reference", check["reference"]))
            if "fbgemm" in modules and len(parts) == 1:  # FBGEMM only: the line as it always was
                parts = [parts[0][len("fbgemm "):]]
            verdict = "unchecked" if check["ok"] is None else "ok" if check["ok"] else "MISMATCH"
            emit(f"[{case.name}] check {optimizer}: {verdict} ({'; '.join(parts)})")
        if "fwd" in case.passes and k == 0:
            measure(modules, "fwd", forward_step, False, "", None)
        if "bwd" in case.passes:
            measure(modules, f"bwd_{optimizer}", backward_step, True, f" {optimizer}", optimizer)
        del modules
        if opts.device.type == "cuda":
            torch.cuda.empty_cache()
    if case.command == "vbe":
        results = record["results"]
        for optimizer in case.optimizers:
            for kernel in kernels:
                fwd = results.get("fwd", {}).get(kernel, {}).get("median_ms")
                bwd = results.get(f"bwd_{optimizer}", {}).get(kernel, {}).get("median_ms")
                if fwd is not None or bwd is not None:
                    for text in vbe_lines(f"{kernel} {optimizer}", case, w.Ds, None if fwd is None else fwd * 1e3,
                                          None if bwd is None else bwd * 1e3):
                        emit(text)
    return record
