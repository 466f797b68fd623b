"""Shared test material: skewed batches, the two oracles (FBGEMM's CPU TBE and the package's
pure-PyTorch reference), one tolerance table, and a verbose comparison."""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Sequence

import torch

import torchrec_triton_tbe  # noqa: F401  (sets TRITON_INTERPRET before anything defines kernels)
from torchrec_triton_tbe._fbgemm import (
    BoundsCheckMode,
    ComputeDevice,
    EmbeddingLocation,
    EmbOptimType,
    PoolingMode,
    SparseType,
    WeightDecayMode,
)
from torchrec_triton_tbe.module import TritonTBE
from torchrec_triton_tbe.ops.spec import Optim, OptimizerSpec, WeightDecay
from torchrec_triton_tbe.reference import ReferenceTBE

logging.getLogger("fbgemm_gpu").setLevel(logging.ERROR)

DTYPE = {SparseType.FP32: torch.float32, SparseType.FP16: torch.float16, SparseType.BF16: torch.bfloat16}

# One table: tolerance by the least precise dtype involved (weights or output). fp16 matches FBGEMM's
# own tests (atol 5e-3, rtol 2e-2); bf16 has 3 fewer mantissa bits than fp16.
TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=5e-3, rtol=2e-2),
    torch.bfloat16: dict(atol=4e-2, rtol=4e-2),
}
# Row-wise Adagrad state is fp32 whatever the weights; it inherits the gradient's precision.
STATE_TOLERANCE = {
    torch.float32: dict(atol=1e-6, rtol=1e-4),
    torch.float16: dict(atol=1e-4, rtol=1e-3),
    torch.bfloat16: dict(atol=1e-3, rtol=1e-2),
}
_RANK = [torch.float32, torch.float16, torch.bfloat16]


def tolerance(*dtypes: torch.dtype, table=TOLERANCE) -> dict:
    return table[max(dtypes, key=_RANK.index)]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, atol: float, rtol: float) -> None:
    """assert_close that reports how many elements miss and the worst ones."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert not torch.isnan(a).any(), f"{what}: NaN in result"
    assert not torch.isnan(e).any(), f"{what}: NaN in the expected values"
    bad = ~(((a - e).abs() <= atol + rtol * e.abs()) | (a == e))
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        worst = [(i, a[tuple(i)].item(), e[tuple(i)].item()) for i in idx]
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{bad.numel()} elements differ beyond atol={atol} rtol={rtol}; "
            f"max |diff| {float((a - e).abs().max()):.3e}; first (index, got, expected): {worst}"
        )


@dataclasses.dataclass
class Batch:
    indices: torch.Tensor
    offsets: torch.Tensor
    per_sample_weights: Optional[torch.Tensor]
    B: int


def skewed_batch(
    rows: Sequence[int],
    feature_table_map: Sequence[int],
    B: int,
    max_L: int,
    generator: torch.Generator,
    weighted: bool = False,
    index_dtype: torch.dtype = torch.int64,
    hot_fraction: float = 0.3,
    min_L: int = 0,
) -> Batch:
    """Heavy-tailed ids: a hot row per table (FBGEMM's long_segments: x[:, 0] = 0 style) takes
    ``hot_fraction`` of the lookups, the rest follow a power law rows * u^3, so a few rows repeat
    many times and most appear once. Bag lengths are uniform in [min_L, max_L] (empty bags included)."""
    T = len(feature_table_map)
    lengths = torch.randint(min_L, max_L + 1, (T * B,), generator=generator)
    offsets = torch.zeros(T * B + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    ids = []
    for t, k in enumerate(feature_table_map):
        n = int(lengths[t * B : (t + 1) * B].sum())
        u = torch.rand(n, generator=generator)
        tail = (rows[k] * u**3).long().clamp(max=rows[k] - 1)
        hot = torch.rand(n, generator=generator) < hot_fraction
        ids.append(torch.where(hot, torch.zeros_like(tail), tail))
    indices = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64)
    psw = torch.rand(indices.numel(), generator=generator) + 0.5 if weighted else None
    return Batch(indices.to(index_dtype), offsets.to(index_dtype), psw, B)


# What FBGEMM's TBE runs for each EmbOptimType, written out here (not read from compat.OPTIMIZERS) so a
# wrong reading of FBGEMM's keywords by the module fails the reference comparisons instead of being copied
# into the oracle.
_EXPECTED_OPTIM = {
    EmbOptimType.EXACT_SGD: Optim.EXACT_SGD,
    EmbOptimType.EXACT_ROWWISE_ADAGRAD: Optim.EXACT_ROWWISE_ADAGRAD,
    EmbOptimType.EXACT_ADAGRAD: Optim.EXACT_ADAGRAD,
    EmbOptimType.ADAM: Optim.ADAM,
    EmbOptimType.PARTIAL_ROWWISE_ADAM: Optim.PARTIAL_ROWWISE_ADAM,
    EmbOptimType.LAMB: Optim.LAMB,
    EmbOptimType.PARTIAL_ROWWISE_LAMB: Optim.PARTIAL_ROWWISE_LAMB,
    EmbOptimType.LARS_SGD: Optim.LARS_SGD,
}
# FBGEMM's row-wise Adagrad is its only optimizer with selectable weight decay modes; the others apply
# weight_decay one fixed way (or not at all).
_EXPECTED_WD = {WeightDecayMode.NONE: WeightDecay.NONE, WeightDecayMode.L2: WeightDecay.L2,
                WeightDecayMode.DECOUPLE: WeightDecay.DECOUPLE}
_EXPECTED_STATE_DTYPE = {SparseType.FP32: torch.float32, SparseType.BF16: torch.bfloat16}


def expected_optimizer_spec(**fbgemm_kwargs) -> OptimizerSpec:
    """The update FBGEMM's module applies for these constructor keywords (its defaults where absent), as
    the OptimizerSpec the reference runs: the tests' independent reading of FBGEMM's keywords."""
    optim = _EXPECTED_OPTIM[fbgemm_kwargs.get("optimizer", EmbOptimType.EXACT_SGD)]
    rowwise_adagrad = optim == Optim.EXACT_ROWWISE_ADAGRAD
    mode = WeightDecayMode(fbgemm_kwargs.get("weight_decay_mode", WeightDecayMode.NONE))
    extra = fbgemm_kwargs.get("extra_optimizer_config")
    dtypes = {name: _EXPECTED_STATE_DTYPE[t] for name, t in (fbgemm_kwargs.get("optimizer_state_dtypes") or {}).items()}
    return OptimizerSpec(
        optim=optim,
        weight_decay_mode=_EXPECTED_WD[mode] if rowwise_adagrad else WeightDecay.NONE,
        max_norm=rowwise_adagrad and float(fbgemm_kwargs.get("max_norm", 0.0)) > 0.0,
        rowwise_bias_correction=bool(getattr(extra, "use_rowwise_bias_correction", False)),
        gradient_clipping=bool(fbgemm_kwargs.get("gradient_clipping", False)),
        max_gradient=float(fbgemm_kwargs.get("max_gradient", 1.0)),
        momentum1_dtype=dtypes.get("momentum1", torch.float32),
        momentum2_dtype=dtypes.get("momentum2", torch.float32),
    )


def checked_optimizer_spec(module, **fbgemm_kwargs) -> OptimizerSpec:
    """expected_optimizer_spec, after asserting the module read the same keywords the same way."""
    spec = expected_optimizer_spec(**fbgemm_kwargs)
    assert module.spec.optimizer == spec, f"the module runs {module.spec.optimizer}, FBGEMM's keywords say {spec}"
    return spec


def make_pair(
    specs: Sequence[tuple[int, int]],
    feature_table_map: Optional[Sequence[int]] = None,
    oracle: str = "fbgemm",
    seed: int = 0,
    fbgemm_overrides: Optional[dict] = None,
    **kwargs,
):
    """A TritonTBE and an oracle (FBGEMM CPU TBE or ReferenceTBE) with identical initial weights;
    ``fbgemm_overrides``: keywords only FBGEMM's module gets differently (to steer around its bugs)."""
    ours = TritonTBE(list(specs), feature_table_map=feature_table_map, device="cpu", **kwargs)
    g = torch.Generator().manual_seed(seed)
    for w in ours.split_embedding_weights():
        w.copy_((torch.rand(w.shape, generator=g) * 2 - 1).to(w.dtype))
    ftm = ours.feature_table_map
    if oracle == "fbgemm":
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        fb_kwargs = {k: v for k, v in kwargs.items() if k not in ("kernel_config", "fused_bounds_check", "hoist_transpose")}
        fb_kwargs.update(fbgemm_overrides or {})
        other = SplitTableBatchedEmbeddingBagsCodegen(
            [(r, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for r, d in specs],
            feature_table_map=list(ftm),
            **fb_kwargs,
        )
        for a, b in zip(ours.split_embedding_weights(), other.split_embedding_weights()):
            b.copy_(a)
    else:
        # The same optimizer (spec and hyper-parameters, FBGEMM's defaults where not given).
        hyper = {k: kwargs.get(k, d) for k, d in REFERENCE_DEFAULTS.items()}
        other = ReferenceTBE(
            ours.split_embedding_weights(),
            ftm,
            mean=kwargs.get("pooling_mode", PoolingMode.SUM) == PoolingMode.MEAN,
            nobag=kwargs.get("pooling_mode", PoolingMode.SUM) == PoolingMode.NONE,
            optimizer=checked_optimizer_spec(ours, **kwargs),
            output_dtype=DTYPE[kwargs.get("output_dtype", SparseType.FP32)],
            **hyper,
        )
    return ours, other


# FBGEMM's constructor defaults of the hyper-parameters ReferenceTBE takes.
REFERENCE_DEFAULTS = dict(learning_rate=0.01, eps=1e-8, beta1=0.9, beta2=0.999, weight_decay=0.0, eta=0.001,
                          momentum=0.9, max_norm=0.0)


def fbgemm_supports(weights: SparseType, output: SparseType, pooling: PoolingMode, weighted: bool, ftm) -> bool:
    """Combinations FBGEMM 1.9.0's CPU TBE computes correctly (found while writing these tests, each
    checked against the pure-PyTorch reference): no BF16 weights or outputs ('not implemented for
    BFloat16'); weighted MEAN's backward omits the 1/L its forward applies; a feature_table_map that is
    not non-decreasing breaks FP16 forward ('Index ... is out of bounds') and the backward of every
    precision (updates land on the wrong rows)."""
    if SparseType.BF16 in (weights, output):
        return False
    if pooling == PoolingMode.MEAN and weighted:
        return False
    if list(ftm) != sorted(ftm):
        return False
    return True


def oracle_step(other, batch: Batch, grad: torch.Tensor):
    """One forward + backward (+ optimizer) on either oracle; returns the forward output."""
    if isinstance(other, ReferenceTBE):
        out64 = other.forward(batch.indices, batch.offsets, batch.per_sample_weights)
        other.backward(out64, grad)
        other.step()
        return other.output(out64)
    out = other(batch.indices.clone(), batch.offsets.clone(), batch.per_sample_weights)
    out.backward(grad)
    return out


def oracle_state(other):
    """(weights per table, [state tensors] per table in split_optimizer_states order, or [])."""
    if isinstance(other, ReferenceTBE):
        return other.tables, (other.states if other.spec.states else [])
    return other.split_embedding_weights(), [list(s) for s in other.split_optimizer_states()]


def assert_both_paths(stats: dict) -> None:
    assert stats["short_runs"] > 0, f"short-run path did not run: {stats}"
    assert stats["long_runs"] > 0 and stats["long_chunks"] > stats["long_runs"], (
        f"long-run (split-K) path did not run with several chunks: {stats}"
    )


def expected_warnings(idx: torch.Tensor, off: torch.Tensor, fb_idx: torch.Tensor) -> int:
    """The documented WARNING count: bad bags (by the original offsets), a wrong last offset, and the
    ids the repair changed. (FBGEMM counts some of these differently; it is nonzero exactly when this is.)"""
    N = idx.numel()
    start, end = off[:-1].long(), off[1:].long()
    bags = int(((start < 0) | (start > end) | (end > N)).sum())
    return bags + int(int(off[-1]) != N) + int((fb_idx != idx.long()).sum())


__all__ = [
    "BoundsCheckMode",
    "EmbOptimType",
    "PoolingMode",
    "SparseType",
    "TritonTBE",
    "expected_warnings",
]

