"""Fused optimizer steps as device functions, shared by the short-run and long-run kernels.

Each call updates a tile of R rows, each with its fully reduced gradient (fp32, [R, BLOCK_D]), so a
row gets one step per backward however many lookups touched it (FBGEMM's "EXACT" optimizers). The
optimizer is a constexpr (OPTIM): one specialization per optimizer, and the row-wise Adagrad and SGD
code is what it was before the others existed. The update rules are FBGEMM's, term for term
(fbgemm_gpu/codegen/genscript/optimizers.py), in fp32 like FBGEMM's accumulators.

State: element-wise state (Adagrad's sum, Adam's / LAMB's moments, LARS's momentum) is laid out like
the weights, so an element's state sits at its weight's flat offset; row-wise state at the row's
index in [total_rows]. State may be stored narrower than fp32 (bf16 moments); the update uses the
fp32 values it computed, and only the stored copy is rounded (to nearest), as FBGEMM does.

Byte accounting per unique row of D elements: read + write D weights; + read + write the
element-wise state (4 B per element per fp32 tensor) and 4 B per row-wise state tensor.
"""

import triton
import triton.language as tl

# OPTIM values (ops/spec.py's Optim).
EXACT_SGD: tl.constexpr = tl.constexpr(0)
EXACT_ROWWISE_ADAGRAD: tl.constexpr = tl.constexpr(1)
EXACT_ADAGRAD: tl.constexpr = tl.constexpr(2)
ADAM: tl.constexpr = tl.constexpr(3)
PARTIAL_ROWWISE_ADAM: tl.constexpr = tl.constexpr(4)
LAMB: tl.constexpr = tl.constexpr(5)
PARTIAL_ROWWISE_LAMB: tl.constexpr = tl.constexpr(6)
LARS_SGD: tl.constexpr = tl.constexpr(7)

# WD_MODE values (ops/spec.py's WeightDecay: row-wise Adagrad's modes, numbered as FBGEMM's).
WD_L2: tl.constexpr = tl.constexpr(1)
WD_DECOUPLE: tl.constexpr = tl.constexpr(2)

# Indices into the hyper-parameter tensor (ops/spec.py's HYPER_FIELDS).
H_EPS: tl.constexpr = tl.constexpr(0)
H_BETA1: tl.constexpr = tl.constexpr(1)
H_BETA2: tl.constexpr = tl.constexpr(2)
H_WEIGHT_DECAY: tl.constexpr = tl.constexpr(3)
H_ETA: tl.constexpr = tl.constexpr(4)
H_MOMENTUM: tl.constexpr = tl.constexpr(5)
H_MAX_NORM: tl.constexpr = tl.constexpr(6)


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
def rounded(w, seed, rng_offsets, SR_DROP_BITS: tl.constexpr):
    """fp32 ``w`` as the weights will hold it, still as fp32. With SR_DROP_BITS > 0 (fp16: 13, bf16:
    16 dropped mantissa bits) it rounds stochastically: add uniform random bits below the kept
    mantissa, then truncate, so E[stored] == w (FBGEMM's stochastic_rounding); the truncated value is
    exactly representable in the target type (normal range), so storing it does not round again.
    Without (SR_DROP_BITS == 0) it is returned as is and the store rounds to nearest.

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
    return w


@triton.jit
def _bias_correction(beta, t):
    """1 - beta**t (FBGEMM: 1.0 - powf(beta, iter)), t >= 1 a step count (scalar or per row). In fp64:
    for beta = 0.999 and t = 1 the difference keeps its fp32 precision only if the power has more."""
    return (1.0 - tl.exp2(t.to(tl.float64) * tl.log2(beta.to(tl.float64)))).to(tl.float32)


@triton.jit
def _nearest(value, dtype: tl.constexpr):
    """fp32 ``value`` rounded to nearest (even) in ``dtype``, as fp32. For bf16 the rounding is done on
    the bits: compiled kernels' conversion rounds to nearest, but Triton's CPU interpreter truncates,
    and the tests compare with a round-to-nearest reference. NaN stays NaN."""
    if dtype == tl.bfloat16:
        bits = value.to(tl.int32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
        value = tl.where(value == value, bits.to(tl.float32, bitcast=True), value)
    return value.to(dtype).to(tl.float32)


@triton.jit
def store_nearest(ptrs, value, mask):
    """Store fp32 ``value`` rounded to nearest (even) in the pointee's dtype."""
    dtype: tl.constexpr = ptrs.dtype.element_ty
    tl.store(ptrs, _nearest(value, dtype).to(dtype), mask=mask)


@triton.jit
def _row_norm(x):
    return tl.sqrt(tl.sum(x * x, axis=1))


@triton.jit
def _ratio_or_zero(num, den):
    """num / den where den > 0, else 0 (and no division by zero on any lane)."""
    live = den > 0
    return tl.where(live, num / tl.where(live, den, 1.0), 0.0)


@triton.jit
def apply_rows_update(
    weights_ptr,
    w_off,
    w,
    g,
    mask,
    rmask,
    D,
    state_row,
    m1_ptr,
    m2_ptr,
    m3_ptr,
    lr,
    hyper_ptr,
    step,
    rng_offsets,
    OPTIM: tl.constexpr,
    WD_MODE: tl.constexpr,
    MAX_NORM: tl.constexpr,
    ROW_BIAS: tl.constexpr,
    SR_DROP_BITS: tl.constexpr,
):
    """One optimizer step for R rows, and the store of their new weights.

    w_off / w / g / mask: [R, BLOCK_D]: element offsets of the rows in the flat weights (and in
    element-wise state), their current weights (fp32, 0 where masked), their reduced gradients (fp32, 0
    where masked), the live elements. rmask / D / state_row: [R]: live rows, their widths, their index
    in row-wise state. m1 / m2 / m3: the optimizer's state tensors (momentum1, momentum2, row_counter;
    unused ones are stand-ins). lr: the learning rate; hyper_ptr: fp32 [HYPER_FIELDS]; step: this
    update's step count t >= 1 (int64; FBGEMM's ``iter`` as the forward advanced it), the bias
    correction's t, and seeds stochastic rounding."""
    if OPTIM == EXACT_SGD:
        w = w - lr * g
    elif OPTIM == EXACT_ROWWISE_ADAGRAD:
        # m += mean((g [+ wd * w for L2])^2) over D; w = correction * w - lr / (sqrt(m) + eps) * g.
        eps = tl.load(hyper_ptr + H_EPS)
        m_ptrs = m1_ptr + state_row
        if WD_MODE == WD_L2:
            wd = tl.load(hyper_ptr + H_WEIGHT_DECAY)
            gw = g + wd * w  # the squares only: FBGEMM leaves the gradient itself as it is
            m = tl.load(m_ptrs, mask=rmask, other=0.0) + tl.sum(gw * gw, axis=1) / D.to(tl.float32)
        else:
            m = tl.load(m_ptrs, mask=rmask, other=0.0) + tl.sum(g * g, axis=1) / D.to(tl.float32)
        tl.store(m_ptrs, m, mask=rmask)
        multiplier = lr / (tl.sqrt(m) + eps)
        if WD_MODE == WD_L2:
            w = (1.0 - multiplier * wd)[:, None] * w - multiplier[:, None] * g
        elif WD_MODE == WD_DECOUPLE:
            wd = tl.load(hyper_ptr + H_WEIGHT_DECAY)
            w = (1.0 - lr * wd) * w - multiplier[:, None] * g
        else:
            w = w - multiplier[:, None] * g
    elif OPTIM == EXACT_ADAGRAD:
        eps = tl.load(hyper_ptr + H_EPS)
        m = tl.load(m1_ptr + w_off, mask=mask, other=0.0).to(tl.float32) + g * g
        store_nearest(m1_ptr + w_off, m, mask)
        w = w - lr * g / (tl.sqrt(m) + eps)
    elif OPTIM == LARS_SGD:
        eta = tl.load(hyper_ptr + H_ETA)
        mom = tl.load(hyper_ptr + H_MOMENTUM)
        wd = tl.load(hyper_ptr + H_WEIGHT_DECAY)
        w_norm = _row_norm(w)
        # FBGEMM divides 0 by 0 (NaN weights) for a zero row with a zero gradient; that row keeps its value.
        adjusted_lr = _ratio_or_zero(lr * eta * w_norm, _row_norm(g) + wd * w_norm)
        m = mom * tl.load(m1_ptr + w_off, mask=mask, other=0.0).to(tl.float32) + adjusted_lr[:, None] * (g + wd * w)
        store_nearest(m1_ptr + w_off, m, mask)
        w = w - m
    else:
        # The Adam / LAMB family: first moment element-wise, second element-wise or per row.
        b1 = tl.load(hyper_ptr + H_BETA1)
        b2 = tl.load(hyper_ptr + H_BETA2)
        eps = tl.load(hyper_ptr + H_EPS)
        wd = tl.load(hyper_ptr + H_WEIGHT_DECAY)
        if ROW_BIAS:
            t = tl.load(m3_ptr + state_row, mask=rmask, other=0.0) + 1.0
            tl.store(m3_ptr + state_row, t, mask=rmask)
            bc1 = _bias_correction(b1, t)[:, None]
            bc2 = _bias_correction(b2, t)[:, None]
        else:
            bc1 = _bias_correction(b1, step)
            bc2 = _bias_correction(b2, step)
        m = tl.load(m1_ptr + w_off, mask=mask, other=0.0).to(tl.float32) * b1 + g * (1.0 - b1)
        store_nearest(m1_ptr + w_off, m, mask)
        if OPTIM == ADAM or OPTIM == LAMB:
            v = tl.load(m2_ptr + w_off, mask=mask, other=0.0).to(tl.float32) * b2 + (g * g) * (1.0 - b2)
            store_nearest(m2_ptr + w_off, v, mask)
            r = m / bc1 / (tl.sqrt(v / bc2) + eps)
        else:
            g_avg = tl.sum(g * g, axis=1) / D.to(tl.float32)
            v = g_avg * (1.0 - b2) + tl.load(m2_ptr + state_row, mask=rmask, other=0.0).to(tl.float32) * b2
            store_nearest(m2_ptr + state_row, v, rmask)
            if OPTIM == PARTIAL_ROWWISE_ADAM:
                r = m / bc1 / (tl.sqrt(v / bc2) + eps)[:, None]
            else:
                r = m / bc1 * (1.0 / (tl.sqrt(v / bc2) + eps))[:, None]
        r = r + wd * w
        if OPTIM == ADAM or OPTIM == PARTIAL_ROWWISE_ADAM:
            w = w - lr * r
        else:
            # LAMB's trust ratio ||w|| / ||r|| per row. FBGEMM writes NaN where ||r|| == 0 (a zero step);
            # here such a row keeps its value.
            w = w - (lr * _ratio_or_zero(_row_norm(w), _row_norm(r)))[:, None] * r
    if MAX_NORM:
        # FBGEMM (row-wise Adagrad's post-update): the stored row is rescaled to norm max_norm when
        # its norm exceeds it, and stored again; rows within the bound keep the first store.
        w = _nearest(rounded(w, step, rng_offsets, SR_DROP_BITS), weights_ptr.dtype.element_ty)
        max_norm = tl.load(hyper_ptr + H_MAX_NORM)
        scale = _ratio_or_zero(max_norm, _row_norm(w))
        w = tl.where((scale < 1.0)[:, None], w * scale[:, None], w)
        rng_offsets = rng_offsets ^ 0x5BD1E995  # the second rounding draws its own bits
    store_nearest(weights_ptr + w_off, rounded(w, step, rng_offsets, SR_DROP_BITS), mask)
