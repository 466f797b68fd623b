"""Small tables: a per-bag histogram over a table of at most E_PAD rows, multiplied with the table.

A table of a few dozen rows is hit by every bag many times over. The generic path pays per lookup:
the forward loads one row per id, and the backward sorts every lookup into a handful of very long runs
and gathers one output-gradient row per lookup (L gathers of the same bag's row). Here a program
counts each bag's ids per row, H[b, e], and then works per bag:
    forward   out[b, :]  = H[b, :] @ W            (W, the whole table, loaded once per program)
    backward  grad[e, :] = sum_b H[b, e] * dout[b, :]   (split over bag chunks, partials reduced in
                                                         a fixed order, then one optimizer step per row)
How H is counted: unweighted, a group's lookups are one contiguous stretch of the ids, taken
POSITIONS at a time as H += member^T @ onehot (0 / 1 fp16 operands, fp32 accumulator: exact counts, on
tensor cores); weighted, one id per bag per step, the weights summed in fp32 (a weight is no exact
fp16 operand). H then carries MEAN's 1 / L, so the products with the table or the gradient are fp32
(``input_precision="ieee"``: no TF32 rounding).

Byte accounting per program of BAGS * GROUPS bags, D wide, E rows:
    forward:  read E*D*w (the table) + the bags' ids (4-8 B each) [+ 4 B psw] + 2 offsets per bag;
              write BAGS * GROUPS * D * o (the outputs).
    backward: read the same ids [+ psw] and offsets + BAGS * GROUPS * D * 4 (one gradient row per bag,
              not per lookup); write E_PAD * D * 4 + E_PAD * 4 (the chunk's partials and counts). The
              apply reads n_chunks partial rows per table row and one row of weights and state per
              touched row.
Compute per lookup (unweighted): BAGS + E_PAD compares and a [BAGS, E_PAD] slice of a tensor-core dot;
per bag group BAGS * E_PAD * D fp32 multiply-adds. No atomics anywhere, the sums of a row are taken in
a fixed order (bag order within a group, groups in order, chunks in a fixed tree), so the results are
deterministic; they differ from the generic path's only by fp32 summation order.
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
def _feature_lookups(offsets_ptr, t, B):
    """Feature t's lookups in this call (its B bags' ids). The backward takes a small table's feature
    on the path when they are at least min_lookups (backward_min_bag * B): read from the offsets on the
    device by the sort keys' pass (kernels/transpose.py, whose sentinel keys then keep those lookups out
    of every generic run) and by both backward kernels below, the same comparison everywhere, so each
    lookup's gradient is applied by exactly one path."""
    base = t.to(tl.int64) * B
    return tl.load(offsets_ptr + base + B).to(tl.int64) - tl.load(offsets_ptr + base).to(tl.int64)


@triton.jit
def _histogram(indices_ptr, offsets_ptr, psw_ptr, t, b0, B, rows,
               POOLING_MEAN: tl.constexpr, WEIGHTED: tl.constexpr, COUNTS: tl.constexpr,
               BAGS: tl.constexpr, E_PAD: tl.constexpr, POSITIONS: tl.constexpr, ROWS_FIRST: tl.constexpr):
    """Bags b0 .. b0 + BAGS of feature t: (H [BAGS, E_PAD] fp32, or H^T [E_PAD, BAGS] with ROWS_FIRST
    (the backward's operand), per-row lookup counts [E_PAD] int32 (COUNTS; zeros otherwise), the bags'
    mask [BAGS]). Ids outside [0, E_PAD) match no row."""
    b = b0 + tl.arange(0, BAGS)
    bm = b < B
    base = t.to(tl.int64) * B
    start = tl.load(offsets_ptr + base + b, mask=bm, other=0).to(tl.int64)
    end = tl.load(offsets_ptr + base + b + 1, mask=bm, other=0).to(tl.int64)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    if WEIGHTED:
        # A weight is no 0/1 operand: one id per bag per step, summed in fp32 in registers.
        L = tl.where(bm, end - start, 0)
        h = tl.zeros([BAGS, E_PAD], dtype=tl.float32)
        for j in range(0, tl.max(L, axis=0)):
            m = j < L
            ids = tl.load(indices_ptr + start + j, mask=m, other=-1)
            ids = tl.where((ids >= 0) & (ids < E_PAD), ids, -1).to(tl.int32)
            hit = (ids[:, None] == rows[None, :]) & m[:, None]
            w = tl.load(psw_ptr + start + j, mask=m, other=0.0).to(tl.float32)
            h += tl.where(hit, w[:, None], 0.0)
            if COUNTS:
                counts += tl.sum(hit.to(tl.int32), axis=0)
        if POOLING_MEAN:
            h = h / tl.maximum(L, 1).to(tl.float32)[:, None]
        if ROWS_FIRST:
            h = tl.trans(h)
    else:
        # The group's lookups are one contiguous stretch [s0, s1) of the ids. Per step, POSITIONS of
        # them: H += member^T @ onehot, member [P, BAGS] (which bag holds position p) and onehot
        # [P, E_PAD] (which row id p is), both 0 / 1, so fp16 operands and the fp32 accumulator give
        # exact counts (at most POSITIONS per step) on tensor cores. Each operand is built in the
        # orientation the dot takes (no transpose in the loop). The next step's ids are loaded before
        # this step's dot: the loop's one global load no longer waits on its own latency.
        s0 = tl.load(offsets_ptr + base + tl.minimum(b0, B)).to(tl.int64)
        n = (tl.load(offsets_ptr + base + tl.minimum(b0 + BAGS, B)).to(tl.int64) - s0).to(tl.int32)
        lo = tl.where(bm, start - s0, 0).to(tl.int32)
        hi = tl.where(bm, end - s0, 0).to(tl.int32)
        L = hi - lo
        p = tl.arange(0, POSITIONS)
        if ROWS_FIRST:
            h = tl.zeros([E_PAD, BAGS], dtype=tl.float32)
        else:
            h = tl.zeros([BAGS, E_PAD], dtype=tl.float32)
        ids = tl.load(indices_ptr + s0 + p, mask=p < n, other=-1)
        for p0 in range(0, n, POSITIONS):
            q = p0 + p
            nxt = tl.load(indices_ptr + s0 + POSITIONS + q, mask=q + POSITIONS < n, other=-1)
            ids = tl.where((ids >= 0) & (ids < E_PAD), ids, -1).to(tl.int32)
            if ROWS_FIRST:
                onehot_t = (rows[:, None] == ids[None, :]).to(tl.float16)  # [E_PAD, P]
                member = ((q[:, None] >= lo[None, :]) & (q[:, None] < hi[None, :])).to(tl.float16)  # [P, BAGS]
                h += tl.dot(onehot_t, member)
            else:
                member_t = ((q[None, :] >= lo[:, None]) & (q[None, :] < hi[:, None])).to(tl.float16)  # [BAGS, P]
                onehot = (ids[:, None] == rows[None, :]).to(tl.float16)  # [P, E_PAD]
                h += tl.dot(member_t, onehot)
            ids = nxt
        if ROWS_FIRST:
            if COUNTS:
                counts = tl.sum(h, axis=1).to(tl.int32)
            if POOLING_MEAN:
                h = h / tl.maximum(L, 1).to(tl.float32)[None, :]
        else:
            if COUNTS:
                counts = tl.sum(h, axis=0).to(tl.int32)
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
    POSITIONS: tl.constexpr,
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
                              POOLING_MEAN, WEIGHTED, False, BAGS, E_PAD, POSITIONS, False)
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
    min_lookups,
    POOLING_MEAN: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK_D: tl.constexpr,
    E_PAD: tl.constexpr,
    BAGS: tl.constexpr,
    GROUPS: tl.constexpr,
    POSITIONS: tl.constexpr,
):
    """Grid [n_chunks, T_k]: chunk c of a small-table feature's bags (GROUPS groups of BAGS) into its
    partial gradient [E_PAD, BLOCK_D] and lookup counts [E_PAD] (slot k * n_chunks + c). A feature the
    path does not take this call (_feature_lookups) writes nothing: its apply programs return too."""
    c = tl.program_id(0)
    k = tl.program_id(1)
    t, D, rows, cols = _feature(bucket_features_ptr, k, feature_dim_ptr, E_PAD, BLOCK_D)
    if _feature_lookups(offsets_ptr, t, B) < min_lookups:
        return
    o_col = tl.load(feature_out_offset_ptr + t).to(tl.int64)
    cmask = cols < D
    acc = tl.zeros([E_PAD, BLOCK_D], dtype=tl.float32)
    total = tl.zeros([E_PAD], dtype=tl.int32)
    for g in range(GROUPS):
        b0 = (c * GROUPS + g) * BAGS
        h, counts, bm = _histogram(indices_ptr, offsets_ptr, psw_ptr, t, b0, B, rows,
                                   POOLING_MEAN, WEIGHTED, True, BAGS, E_PAD, POSITIONS, True)
        b = (b0 + tl.arange(0, BAGS)).to(tl.int64)
        g_ptrs = grad_out_ptr + (b * total_D + o_col)[:, None] + cols[None, :]
        dout = tl.load(g_ptrs, mask=bm[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        acc += tl.dot(h, dout, input_precision="ieee")
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
    offsets_ptr,
    B,
    n_chunks,
    min_lookups,
    OPTIM: tl.constexpr,
    WD_MODE: tl.constexpr,
    MAX_NORM: tl.constexpr,
    ROW_BIAS: tl.constexpr,
    SR_DROP_BITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    RNG_D: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    """Grid [E_PAD, T_k]: row e of a small table, its partials summed CHUNKS at a time (each step a
    tree over CHUNKS partial rows, the steps in chunk order: a fixed order, so deterministic), then one
    optimizer step if the batch touched it (a lookup count > 0, per-sample weight or not: as a run of
    the generic path). One program per row, not per table: the partials of a table are n_chunks tiles,
    and a row's reads are independent of the other rows'. RNG_D: the bucket's BLOCK_D, so stochastic
    rounding draws the generic path's bits."""
    e = tl.program_id(0)
    k = tl.program_id(1)
    t, D, _, cols = _feature(bucket_features_ptr, k, feature_dim_ptr, E_PAD, BLOCK_D)
    E = tl.load(feature_rows_ptr + t)
    if (e >= E) | (_feature_lookups(offsets_ptr, t, B) < min_lookups):
        return
    lr = tl.load(lr_ptr)
    step = tl.load(step_ptr)
    ch = tl.arange(0, CHUNKS)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    # Chunks that looked the row up (not a sum of counts: one row's lookups may pass 2**31 in a batch).
    total = tl.zeros([CHUNKS], dtype=tl.int32)
    for c0 in range(0, n_chunks, CHUNKS):
        cm = c0 + ch < n_chunks
        slot = k.to(tl.int64) * n_chunks + c0 + ch
        tile = tl.load(partials_ptr + (slot * E_PAD + e)[:, None] * BLOCK_D + cols[None, :], mask=cm[:, None], other=0.0)
        acc += tl.sum(tile, axis=0)
        total += (tl.load(counts_ptr + slot * E_PAD + e, mask=cm, other=0) != 0).to(tl.int32)
    one = tl.arange(0, 1)
    act = (one == 0) & (tl.sum(total, axis=0) > 0)
    umask = act[:, None] & (cols[None, :] < D)
    w_off = tl.load(feature_weight_offset_ptr + t) + (e + one)[:, None].to(tl.int64) * D + cols[None, :]
    w = tl.load(weights_ptr + w_off, mask=umask, other=0.0).to(tl.float32)
    state_row = tl.load(feature_row_offset_ptr + t) + e + one
    apply_rows_update(
        weights_ptr, w_off, w, tl.where(umask, acc[None, :], 0.0), umask, act, tl.zeros([1], dtype=tl.int32) + D,
        state_row, m1_ptr, m2_ptr, m3_ptr, lr, hyper_ptr, step,
        (state_row[:, None] * RNG_D + cols[None, :]).to(tl.int32), OPTIM, WD_MODE, MAX_NORM, ROW_BIAS,
        SR_DROP_BITS,
    )
