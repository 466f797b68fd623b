"""Fused optimizer steps as device functions, shared by the short-run and long-run kernels.

Each call updates a tile of R rows, each with its fully reduced gradient (fp32, [R, BLOCK_D]), so a
row gets one step per backward however many lookups touched it (FBGEMM's "EXACT" optimizers).
Byte accounting per unique row: read + write D weights, and for row-wise Adagrad 4 + 4 bytes of state.
"""

import triton
import triton.language as tl

# OPTIM values (ops/spec.py's Optim).
EXACT_SGD: tl.constexpr = tl.constexpr(0)
EXACT_ROWWISE_ADAGRAD: tl.constexpr = tl.constexpr(1)


@triton.jit
def _mix32(x):
    """A 32-bit integer finaliser (two multiply-xorshift rounds, "lowbias32"): full avalanche, so
    consecutive inputs give independent-looking bits."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def store_rounded(w_ptrs, w, mask, seed, rng_offsets, SR_DROP_BITS: tl.constexpr):
    """Store fp32 ``w`` into the weights' dtype. With SR_DROP_BITS > 0 (fp16: 13, bf16: 16 dropped
    mantissa bits) round stochastically: add uniform random bits below the kept mantissa, then
    truncate, so E[stored] == w (FBGEMM's stochastic_rounding). The truncated fp32 value is exactly
    representable in the target type (normal range), so the final conversion does not round again.

    The random bits are a hash of (step, element) rather than Philox (tl.randint): every element of
    every updated row needs its own draw, and ten Philox rounds per element made the H200's short-run
    update compute-bound: 32.3 ms with Philox, 16.3 ms with this hash, 14.6 ms without rounding
    (B=65536, T=32, D=128 fp16, uniform ids; 2026-11-30). Two multiply-xorshift rounds keyed by a
    hashed step are plenty for rounding noise (only the low SR_DROP_BITS bits are used); results stay
    deterministic for a given step."""
    if SR_DROP_BITS > 0:
        low: tl.constexpr = (1 << SR_DROP_BITS) - 1
        bits = w.to(tl.int32, bitcast=True)
        key = _mix32(seed.to(tl.uint32) ^ 0x9E3779B9)
        noise = (_mix32(rng_offsets.to(tl.uint32) ^ key) & low).to(tl.int32)
        w = ((bits + noise) & ~low).to(tl.float32, bitcast=True)
    tl.store(w_ptrs, w.to(w_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def apply_rows_update(
    w_ptrs,
    w,
    momentum_ptrs,
    g,
    mask,
    rmask,
    D,
    lr,
    eps,
    seed,
    rng_offsets,
    OPTIM: tl.constexpr,
    SR_DROP_BITS: tl.constexpr,
):
    """w_ptrs / w / g / mask: [R, BLOCK_D] (w already loaded, as fp32). momentum_ptrs / rmask / D: [R]."""
    if OPTIM == EXACT_ROWWISE_ADAGRAD:
        # FBGEMM: m += mean(g^2) over D; w -= lr / (sqrt(m) + eps) * g (multiplier formed first).
        m = tl.load(momentum_ptrs, mask=rmask, other=0.0) + tl.sum(g * g, axis=1) / D.to(tl.float32)
        tl.store(momentum_ptrs, m, mask=rmask)
        w = w - (lr / (tl.sqrt(m) + eps))[:, None] * g
    else:
        w = w - lr * g
    store_rounded(w_ptrs, w, mask, seed, rng_offsets, SR_DROP_BITS)
