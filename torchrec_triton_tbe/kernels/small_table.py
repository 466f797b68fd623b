"""Small tables: a per-bag histogram over a table of at most E_PAD rows, multiplied with the table.

A table of a few dozen rows is hit by every bag many times over. The generic path pays per lookup:
the forward loads one row per id, and the backward sorts every lookup into a handful of very long runs
and gathers one output-gradient row per lookup (L gathers of the same bag's row). Here a program
counts each bag's ids per row, H[b, e], and then works per bag:
    forward   out[b, :]  = H[b, :] @ W            (W, the whole table, loaded once per program)
    backward  grad[e, :] = sum_b H[b, e] * dout[b, :]   (split over bag chunks, partials reduced in
                                                         chunk order, then one optimizer step per row)
H carries the per-sample weights (WEIGHTED) and MEAN's 1 / L, so it is fp32, and so are the products
(``input_precision="ieee"``: no TF32 rounding); a count may exceed what fp16 holds exactly.

Byte accounting per program of BAGS * GROUPS bags, D wide, E rows:
    forward:  read E*D*w (the table) + the bags' ids (4-8 B each) [+ 4 B psw] + 2 offsets per bag;
              write BAGS * GROUPS * D * o (the outputs).
    backward: read the same ids [+ psw] and offsets + BAGS * GROUPS * D * 4 (one gradient row per bag,
              not per lookup); write E * D * 4 + E * 4 (the chunk's partials and counts). The apply
              reads n_chunks partials per table and one row of weights and state per touched row.
Compute: BAGS * E_PAD * D multiply-adds per bag group, in registers; no atomics anywhere, the sums of
a row are taken in a fixed order (bag order within a group, groups in order, chunks in order), so
the results are deterministic; they differ from the generic path's only by fp32 summation order.
"""

import triton
import triton.language as tl

from torchrec_triton_tbe.kernels.optim import apply_rows_update


@triton.jit
def _feature(bucket_features_ptr, k, feature_dim_ptr, E_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
    """Bucket slot k's feature t, its width D, and the row / column ranges of its table tile."""
    t = tl.load(bucket_features_ptr + k)
    return t, tl.load(feature_dim_ptr + t), tl.arange(0, E_PAD), tl.arange(0, BLOCK_D)


@triton.jit
def _histogram(indices_ptr, offsets_ptr, psw_ptr, t, b0, B, rows,
               POOLING_MEAN: tl.constexpr, WEIGHTED: tl.constexpr, COUNTS: tl.constexpr,
               BAGS: tl.constexpr, E_PAD: tl.constexpr):
    """Bags b0 .. b0 + BAGS of feature t: (H [BAGS, E_PAD] fp32, per-row lookup counts [E_PAD] int32
    (COUNTS; zeros otherwise), the bags' mask [BAGS]). Ids outside [0, E_PAD) match no row."""
    b = b0 + tl.arange(0, BAGS)
    bm = b < B
    bag = t.to(tl.int64) * B + b
    start = tl.load(offsets_ptr + bag, mask=bm, other=0).to(tl.int64)
    end = tl.load(offsets_ptr + bag + 1, mask=bm, other=0).to(tl.int64)
    L = tl.where(bm, end - start, 0)
    steps = tl.max(L, axis=0)
    h = tl.zeros([BAGS, E_PAD], dtype=tl.float32)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for j in range(0, steps):
        m = j < L
        ids = tl.load(indices_ptr + start + j, mask=m, other=-1).to(tl.int32)
        hit = (ids[:, None] == rows[None, :]) & m[:, None]
        if WEIGHTED:
            w = tl.load(psw_ptr + start + j, mask=m, other=0.0).to(tl.float32)
            h += tl.where(hit, w[:, None], 0.0)
        else:
            h += hit.to(tl.float32)
        if COUNTS:
            counts += tl.sum(hit.to(tl.int32), axis=0)
    if POOLING_MEAN:
        h = h / tl.maximum(L, 1).to(tl.float32)[:, None]
    return h, counts, bm


@triton.jit
def _small_forward_kernel(
    weights_ptr,
    indices_ptr,
    offsets_ptr,
    psw_ptr,
    out_ptr,
    bucket_features_ptr,
    feature_dim_ptr,
    feature_weight_offset_ptr,
    feature_out_offset_ptr,
    feature_rows_ptr,
    B,
    total_D,
    POOLING_MEAN: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK_D: tl.constexpr,
    E_PAD: tl.constexpr,
    BAGS: tl.constexpr,
    GROUPS: tl.constexpr,
):
    """Grid [cdiv(B, BAGS * GROUPS), T_k]: GROUPS groups of BAGS bags of one small-table feature.
    out_ptr: [B, total_D] (the fixed-batch layout only: no VBE here)."""
    t, D, rows, cols = _feature(bucket_features_ptr, tl.program_id(1), feature_dim_ptr, E_PAD, BLOCK_D)
    E = tl.load(feature_rows_ptr + t)
    o_col = tl.load(feature_out_offset_ptr + t).to(tl.int64)
    cmask = cols < D
    w_ptrs = weights_ptr + tl.load(feature_weight_offset_ptr + t) + rows[:, None].to(tl.int64) * D + cols[None, :]
    table = tl.load(w_ptrs, mask=(rows[:, None] < E) & cmask[None, :], other=0.0).to(tl.float32)
    for g in range(GROUPS):
        b0 = (tl.program_id(0) * GROUPS + g) * BAGS
        h, _, bm = _histogram(indices_ptr, offsets_ptr, psw_ptr, t, b0, B, rows,
                              POOLING_MEAN, WEIGHTED, False, BAGS, E_PAD)
        pooled = tl.dot(h, table, input_precision="ieee")
        b = (b0 + tl.arange(0, BAGS)).to(tl.int64)
        o_ptrs = out_ptr + (b * total_D + o_col)[:, None] + cols[None, :]
        tl.store(o_ptrs, pooled.to(out_ptr.dtype.element_ty), mask=bm[:, None] & cmask[None, :])


@triton.jit
def _small_backward_partials_kernel(
    partials_ptr,
    counts_ptr,
    grad_out_ptr,
    indices_ptr,
    offsets_ptr,
    psw_ptr,
    bucket_features_ptr,
    feature_dim_ptr,
    feature_out_offset_ptr,
    B,
    total_D,
    n_chunks,
    POOLING_MEAN: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK_D: tl.constexpr,
    E_PAD: tl.constexpr,
    BAGS: tl.constexpr,
    GROUPS: tl.constexpr,
):
    """Grid [n_chunks, T_k]: chunk c of a small-table feature's bags (GROUPS groups of BAGS) into its
    partial gradient [E_PAD, BLOCK_D] and lookup counts [E_PAD] (slot k * n_chunks + c)."""
    c = tl.program_id(0)
    k = tl.program_id(1)
    t, D, rows, cols = _feature(bucket_features_ptr, k, feature_dim_ptr, E_PAD, BLOCK_D)
    o_col = tl.load(feature_out_offset_ptr + t).to(tl.int64)
    cmask = cols < D
    acc = tl.zeros([E_PAD, BLOCK_D], dtype=tl.float32)
    total = tl.zeros([E_PAD], dtype=tl.int32)
    for g in range(GROUPS):
        b0 = (c * GROUPS + g) * BAGS
        h, counts, bm = _histogram(indices_ptr, offsets_ptr, psw_ptr, t, b0, B, rows,
                                   POOLING_MEAN, WEIGHTED, True, BAGS, E_PAD)
        b = (b0 + tl.arange(0, BAGS)).to(tl.int64)
        g_ptrs = grad_out_ptr + (b * total_D + o_col)[:, None] + cols[None, :]
        dout = tl.load(g_ptrs, mask=bm[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        acc += tl.dot(tl.trans(h), dout, input_precision="ieee")
        total += counts
    slot = k.to(tl.int64) * n_chunks + c
    tl.store(partials_ptr + slot * (E_PAD * BLOCK_D) + rows[:, None] * BLOCK_D + cols[None, :], acc)
    tl.store(counts_ptr + slot * E_PAD + rows, total)


@triton.jit
def _small_backward_apply_kernel(
    weights_ptr,
    m1_ptr,
    m2_ptr,
    m3_ptr,
    lr_ptr,
    hyper_ptr,
    step_ptr,
    partials_ptr,
    counts_ptr,
    bucket_features_ptr,
    feature_dim_ptr,
    feature_rows_ptr,
    feature_weight_offset_ptr,
    feature_row_offset_ptr,
    n_chunks,
    OPTIM: tl.constexpr,
    WD_MODE: tl.constexpr,
    MAX_NORM: tl.constexpr,
    ROW_BIAS: tl.constexpr,
    SR_DROP_BITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    RNG_D: tl.constexpr,
    E_PAD: tl.constexpr,
):
    """Grid [T_k]: a small table's partials summed in chunk order, then one optimizer step for each of
    its rows the batch touched (a lookup count > 0, per-sample weight or not: as a run of the generic
    path). RNG_D: the bucket's BLOCK_D, so stochastic rounding draws the generic path's bits."""
    k = tl.program_id(0)
    t, D, rows, cols = _feature(bucket_features_ptr, k, feature_dim_ptr, E_PAD, BLOCK_D)
    E = tl.load(feature_rows_ptr + t)
    lr = tl.load(lr_ptr)
    step = tl.load(step_ptr)
    acc = tl.zeros([E_PAD, BLOCK_D], dtype=tl.float32)
    total = tl.zeros([E_PAD], dtype=tl.int32)
    for c in range(0, n_chunks):
        slot = k.to(tl.int64) * n_chunks + c
        acc += tl.load(partials_ptr + slot * (E_PAD * BLOCK_D) + rows[:, None] * BLOCK_D + cols[None, :])
        total += tl.load(counts_ptr + slot * E_PAD + rows)
    act = (rows < E) & (total > 0)
    umask = act[:, None] & (cols[None, :] < D)
    w_off = tl.load(feature_weight_offset_ptr + t) + rows[:, None].to(tl.int64) * D + cols[None, :]
    w = tl.load(weights_ptr + w_off, mask=umask, other=0.0).to(tl.float32)
    state_row = tl.load(feature_row_offset_ptr + t) + rows
    apply_rows_update(
        weights_ptr, w_off, w, tl.where(umask, acc, 0.0), umask, act, tl.zeros([E_PAD], dtype=tl.int32) + D,
        state_row, m1_ptr, m2_ptr, m3_ptr, lr, hyper_ptr, step,
        (state_row[:, None] * RNG_D + cols[None, :]).to(tl.int32), OPTIM, WD_MODE, MAX_NORM, ROW_BIAS,
        SR_DROP_BITS,
    )
