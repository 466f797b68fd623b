"""Fused optimizer steps as device functions, shared by the short-run and long-run apply kernels.

Each call updates exactly one row with its fully reduced gradient ``g`` (fp32, BLOCK_D wide), so a
row gets one step per backward however many lookups touched it (FBGEMM's "EXACT" optimizers).
Byte accounting per unique row: read + write D weights, and for row-wise Adagrad 4 + 4 bytes of state.
"""

import triton
import triton.language as tl

# OPTIM values (ops/backward.py maps FBGEMM's EmbOptimType onto them).
EXACT_SGD: tl.constexpr = tl.constexpr(0)
EXACT_ROWWISE_ADAGRAD: tl.constexpr = tl.constexpr(1)


@triton.jit
def store_rounded(w_ptrs, w, cmask, seed, rng_offsets, SR_DROP_BITS: tl.constexpr):
    """Store fp32 ``w`` into the weights' dtype. With SR_DROP_BITS > 0 (fp16: 13, bf16: 16 dropped
    mantissa bits) round stochastically: add uniform random bits below the kept mantissa, then
    truncate, so E[stored] == w (FBGEMM's stochastic_rounding). The truncated fp32 value is exactly
    representable in the target type (normal range), so the final conversion does not round again."""
    if SR_DROP_BITS > 0:
        low: tl.constexpr = (1 << SR_DROP_BITS) - 1
        bits = w.to(tl.int32, bitcast=True)
        noise = (tl.randint(seed, rng_offsets) & low).to(tl.int32)
        w = ((bits + noise) & ~low).to(tl.float32, bitcast=True)
    tl.store(w_ptrs, w.to(w_ptrs.dtype.element_ty), mask=cmask)


@triton.jit
def apply_row_update(
    w_row_ptr,
    momentum_ptr,
    g,
    cols,
    cmask,
    D,
    lr,
    eps,
    seed,
    rng_base,
    OPTIM: tl.constexpr,
    SR_DROP_BITS: tl.constexpr,
):
    """w_row_ptr: first element of the row; momentum_ptr: the row's fp32 state (row-wise Adagrad)."""
    w = tl.load(w_row_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    if OPTIM == EXACT_ROWWISE_ADAGRAD:
        # FBGEMM: m += mean(g^2) over D; w -= lr / (sqrt(m) + eps) * g (multiplier formed first).
        m = tl.load(momentum_ptr) + tl.sum(g * g, axis=0) / D.to(tl.float32)
        tl.store(momentum_ptr, m)
        w = w - (lr / (tl.sqrt(m) + eps)) * g
    else:
        w = w - lr * g
    store_rounded(w_row_ptr + cols, w, cmask, seed, rng_base + cols, SR_DROP_BITS)
