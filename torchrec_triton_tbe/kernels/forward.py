"""Pooled forward: gather rows, scale by per-sample weights, pool per bag (SUM or MEAN).

Byte accounting per lookup (weights of E bytes/element, D wide, output of O bytes/element):
    read  D*E (the row) + idx bytes (4 or 8) [+ 4 psw]
per bag: read 2 offsets; write D*O.
The row reads dominate (FBGEMM's byte model counts rows + outputs only), so the kernel's job is to
keep enough independent row loads in flight behind the dependent chain offsets -> ids -> rows.

LANES == 1 (sequential): BAGS bags one after another, GATHER rows per step, a [GATHER, BLOCK_D] tile
    whose addresses depend on one index load: GATHER*D*E bytes in flight (256 B for D=32 fp16, GATHER=8),
    too little to cover the latency of narrow rows.
LANES > 1 (bag lanes): LANES bags side by side, GATHER rows of each per step, a [LANES, GATHER, BLOCK_D]
    tile behind one [LANES, GATHER] index load: LANES*GATHER*D*E bytes in flight. Per step the ids read
    are LANES*GATHER*(4 or 8) bytes (masked past each bag's end, so no extra traffic); per LANES bags
    2*LANES offsets and one [LANES, D] output tile. A group takes ceil(max L / GATHER) steps, so its
    cost follows its longest bag (the host shrinks GATHER for short bags, ops/forward.py).
COL_CHUNKS (one launch for every D bucket, ops/forward.py): program_id(1) indexes (feature, first
    column) entries, each BLOCK_D wide, so a feature of width D takes ceil(D / BLOCK_D) programs per bag
    group, each reading its own column slice of the same rows (the ids are read once per slice, from L2:
    4 or 8 bytes per lookup against the slice's BLOCK_D*E). Bytes per lookup are unchanged; what changes
    is one launch instead of one per bucket, where small batches are bound by the host's issue rate.
NARROW, NARROW2 (with COL_CHUNKS): a feature at most NARROW (NARROW2) wide pools NARROW-wide tiles with
    BLOCK_D / NARROW times the rows per step instead of a mostly masked slice: the same bytes per lookup
    (its row), BLOCK_D / NARROW times fewer dependent id -> row steps per bag, and the same tile size.
"""

import triton
import triton.language as tl

from torchrec_triton_tbe.kernels.bounds import REPAIR_COUNT, REPAIR_OFF, repair_indices, repaired_view
from torchrec_triton_tbe.kernels.common import advance_step_count, bag_bounds, column_mask, out_row_start


@triton.jit
def _pool_bags(
    weights_ptr,
    indices_ptr,
    offsets_ptr,
    psw_ptr,
    out_ptr,
    feature_out_offset_ptr,
    pid_b,
    t,
    B,
    total_D,
    D,
    w_base,
    o_col,
    c0,
    num_rows,
    POOLING_MEAN: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BOUNDS_MODE: tl.constexpr,
    EVEN_D: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GATHER: tl.constexpr,
    BAGS: tl.constexpr,
    LANES: tl.constexpr,
    OUT_MAP: tl.constexpr,
    OUT_ALIGN: tl.constexpr,
):
    """Program pid_b's BAGS * LANES bags of feature t, columns [c0, c0 + BLOCK_D) of rows D wide starting
    at w_base (c0 already folded in); returns how many ids it repaired (BOUNDS_MODE)."""
    cols = tl.arange(0, BLOCK_D)
    cmask = column_mask(cols, D - c0, EVEN_D, BLOCK_D)
    g = tl.arange(0, GATHER)
    # fp32 sums for every weight type, fp32 weights included: FBGEMM's CUDA kernel accumulates in
    # at::acc_type<T, true>, which is float for float (fp64 sums cost fp32_zipf115 7 % of its forward).
    acc_ty = tl.float32
    repaired = tl.full([], 0, tl.int32)
    if LANES == 1:
        for bb in tl.static_range(BAGS):
            b = pid_b * BAGS + bb
            if b < B:
                bag, start, end = bag_bounds(offsets_ptr, t, b, B)
                acc = tl.zeros([BLOCK_D], dtype=acc_ty)
                for j in range(start, end, GATHER):
                    lmask = (j + g) < end
                    idx = tl.load(indices_ptr + j + g, mask=lmask, other=0)
                    if BOUNDS_MODE != REPAIR_OFF:
                        if c0 == 0:
                            idx, nbad = repair_indices(indices_ptr + j + g, idx, lmask, num_rows)
                            repaired += nbad
                        else:
                            idx = repaired_view(idx, lmask, num_rows)
                    row = tl.multiple_of(w_base + idx.to(tl.int64) * D, ALIGN)
                    tile = tl.load(
                        weights_ptr + row[:, None] + cols[None, :],
                        mask=lmask[:, None] & cmask[None, :],
                        other=0.0,
                    ).to(acc_ty)
                    if WEIGHTED:
                        psw = tl.load(psw_ptr + j + g, mask=lmask, other=0.0).to(acc_ty)
                        tile = tile * psw[:, None]
                    acc += tl.sum(tile, axis=0)
                if POOLING_MEAN:
                    # FBGEMM: an empty bag pools to zero in every mode.
                    n = end - start
                    acc = tl.where(n > 0, acc / tl.maximum(n, 1).to(acc_ty), 0.0)
                out_row = out_row_start(feature_out_offset_ptr, o_col, t, b, B, total_D, True, OUT_MAP)
                omask = cmask
                if OUT_MAP:
                    omask = cmask & (out_row >= 0)
                out_row = tl.multiple_of(out_row + c0, OUT_ALIGN)
                tl.store(out_ptr + out_row + cols, acc.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        lanes = tl.arange(0, LANES)
        for bb in tl.static_range(BAGS):
            b0 = (pid_b * BAGS + bb) * LANES
            if b0 < B:
                b = b0 + lanes
                live = b < B
                bag = t.to(tl.int64) * B + b
                start = tl.load(offsets_ptr + bag, mask=live, other=0).to(tl.int64)
                end = tl.load(offsets_ptr + bag + 1, mask=live, other=0).to(tl.int64)
                n = end - start
                acc = tl.zeros([LANES, BLOCK_D], dtype=acc_ty)
                # One step loads GATHER ids of every lane, then all their rows: the lanes' row loads
                # are independent, so one dependent id -> row step covers LANES times the bytes.
                for j in range(0, tl.max(n, axis=0), GATHER):
                    pos = start[:, None] + (j + g)[None, :]
                    lmask = pos < end[:, None]
                    idx = tl.load(indices_ptr + pos, mask=lmask, other=0)
                    if BOUNDS_MODE != REPAIR_OFF:
                        if c0 == 0:
                            idx, nbad = repair_indices(indices_ptr + pos, idx, lmask, num_rows)
                            repaired += nbad
                        else:
                            idx = repaired_view(idx, lmask, num_rows)
                    row = tl.multiple_of(w_base + idx.to(tl.int64) * D, [ALIGN, ALIGN])
                    tile = tl.load(
                        weights_ptr + row[:, :, None] + cols[None, None, :],
                        mask=lmask[:, :, None] & cmask[None, None, :],
                        other=0.0,
                    ).to(acc_ty)
                    if WEIGHTED:
                        psw = tl.load(psw_ptr + pos, mask=lmask, other=0.0).to(acc_ty)
                        tile = tile * psw[:, :, None]
                    # Each lane adds the same GATHER rows per step as the sequential path (same
                    # grouping; the order inside a step is the compiler's reduction tree either way).
                    acc += tl.sum(tile, axis=1)
                if POOLING_MEAN:
                    # FBGEMM: an empty bag pools to zero in every mode.
                    acc = tl.where((n > 0)[:, None], acc / tl.maximum(n, 1).to(acc_ty)[:, None], 0.0)
                out_row = out_row_start(feature_out_offset_ptr, o_col, t, b, B, total_D, live, OUT_MAP)
                if OUT_MAP:
                    live = live & (out_row >= 0)
                out_row = tl.multiple_of(out_row + c0, OUT_ALIGN)
                tl.store(
                    out_ptr + out_row[:, None] + cols[None, :],
                    acc.to(out_ptr.dtype.element_ty),
                    mask=live[:, None] & cmask[None, :],
                )
    return repaired


@triton.jit
def _pooled_forward_kernel(
    weights_ptr,
    indices_ptr,
    offsets_ptr,
    psw_ptr,
    out_ptr,
    bucket_features_ptr,
    entry_cols_ptr,
    feature_dim_ptr,
    feature_weight_offset_ptr,
    feature_out_offset_ptr,
    feature_rows_ptr,
    warning_ptr,
    B,
    total_D,
    count_ptr,
    count_saved_ptr,
    POOLING_MEAN: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BOUNDS_MODE: tl.constexpr,
    EVEN_D: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GATHER: tl.constexpr,
    BAGS: tl.constexpr,
    LANES: tl.constexpr,
    OUT_MAP: tl.constexpr,
    OUT_ALIGN: tl.constexpr,
    COL_CHUNKS: tl.constexpr = False,
    NARROW: tl.constexpr = 0,
    NARROW_LANES: tl.constexpr = 1,
    NARROW2: tl.constexpr = 0,
    NARROW2_LANES: tl.constexpr = 1,
    ADVANCE: tl.constexpr = False,
):
    """
    One program = BAGS * LANES consecutive bags of one feature of this D bucket
    (grid: [cdiv(B, BAGS * LANES), T_k]): BAGS groups in turn, the LANES bags of a group side by side.

    weights_ptr: flat weights of all tables, fp32/fp16/bf16; table rows start at
        feature_weight_offset[t] (int64 elements) with row stride D_t.
    indices_ptr: [N] int32/int64 row ids, table-local. Rewritten in place when BOUNDS_MODE repairs.
    offsets_ptr: [T*B + 1] same dtype as indices; bag (t, b) is [offsets[t*B+b], offsets[t*B+b+1]).
    psw_ptr: [N] fp32 or fp16 per-sample weights (read only if WEIGHTED).
    out_ptr: [B, total_D] output (fp32/fp16/bf16); feature t writes columns [out_offset[t], +D_t).
        OUT_MAP (VBE): the 1-D output, bag (t, b) written at feature_out_offset_ptr[t * B + b] (a per-bag
        table; -1: a padding bag, not written). OUT_ALIGN: a power of two dividing every output row start.
    bucket_features_ptr: [T_k] int32 features of this bucket; program_id(1) indexes it.
    entry_cols_ptr: COL_CHUNKS: [E] int32 first column of entry program_id(1), whose feature is
        bucket_features_ptr[program_id(1)] (a multiple of BLOCK_D); otherwise unused.
    feature_*_ptr: per-feature layout tables (see plan.PlanTensors).
    warning_ptr: int64[1] counter of repaired indices (BOUNDS_MODE == WARNING).
    count_ptr, count_saved_ptr: int64[1] the step count and its copy for the backward (ADVANCE: program
        (0, 0) advances the count, common.advance_step_count; otherwise unused).
    EVEN_D: every feature of the bucket has D == BLOCK_D, so no column mask is needed.
    ALIGN: a power of two dividing every row start and output row start (elements): lets the compiler
        emit 16-byte vector loads although D is only known at run time.
    LANES: bags pooled side by side (1: one bag at a time, the sequential path).
    COL_CHUNKS: the program pools columns [c0, c0 + BLOCK_D) of its feature (see the module docstring).
    NARROW, NARROW2 (COL_CHUNKS only; 0: none): features of width <= NARROW (else <= NARROW2) pool
        NARROW-wide tiles of the same size, BLOCK_D / NARROW times the rows per step: NARROW_LANES times
        the bags side by side (their programs cover that many more bags; the grid's surplus ones exit)
        and the rest as more ids per step. Powers of two, NARROW < NARROW2 < BLOCK_D.
    """
    pid_b = tl.program_id(0)
    if ADVANCE:
        advance_step_count(count_ptr, count_saved_ptr, (pid_b == 0) & (tl.program_id(1) == 0))
    t = tl.load(bucket_features_ptr + tl.program_id(1))
    c0 = 0
    if COL_CHUNKS:
        c0 = tl.load(entry_cols_ptr + tl.program_id(1))
    # ALIGN divides D: saying so makes the column mask constant over ALIGN-wide groups, so masked
    # rows still load as 16-byte vectors (without it every element is a scalar load).
    D = (tl.load(feature_dim_ptr + t) // ALIGN) * ALIGN
    # The slice's start folds into the row base (c0 is a multiple of BLOCK_D, itself of ALIGN).
    w_base = tl.load(feature_weight_offset_ptr + t) + c0
    o_col = 0
    if not OUT_MAP:
        o_col = tl.load(feature_out_offset_ptr + t)
    num_rows = tl.load(feature_rows_ptr + t)
    # A narrow feature in a wide slice would mask most of every tile's columns and take as many dependent
    # id -> row steps per bag as a wide one: it pools a narrower tile of the same size instead (the
    # program's branch is uniform: one feature per program). Its sums group the rows differently from a
    # per-bucket launch's (fp rounding only).
    # The narrow levels' widths are constexprs: a level that is off must not be compiled at all, so the
    # runtime test of D sits inside the constexpr one.
    if NARROW == 0:
        repaired = _pool_bags(weights_ptr, indices_ptr, offsets_ptr, psw_ptr, out_ptr, feature_out_offset_ptr, pid_b,
                              t, B, total_D, D, w_base, o_col, c0, num_rows, POOLING_MEAN, WEIGHTED, BOUNDS_MODE,
                              EVEN_D, ALIGN, BLOCK_D, GATHER, BAGS, LANES, OUT_MAP, OUT_ALIGN)
    elif D <= NARROW:
        repaired = _pool_bags(weights_ptr, indices_ptr, offsets_ptr, psw_ptr, out_ptr, feature_out_offset_ptr, pid_b,
                              t, B, total_D, D, w_base, o_col, c0, num_rows, POOLING_MEAN, WEIGHTED, BOUNDS_MODE,
                              False, ALIGN, NARROW, GATHER * (BLOCK_D // NARROW) // NARROW_LANES, BAGS,
                              LANES * NARROW_LANES, OUT_MAP, OUT_ALIGN)
    elif NARROW2 == 0:
        repaired = _pool_bags(weights_ptr, indices_ptr, offsets_ptr, psw_ptr, out_ptr, feature_out_offset_ptr, pid_b,
                              t, B, total_D, D, w_base, o_col, c0, num_rows, POOLING_MEAN, WEIGHTED, BOUNDS_MODE,
                              EVEN_D, ALIGN, BLOCK_D, GATHER, BAGS, LANES, OUT_MAP, OUT_ALIGN)
    elif D <= NARROW2:
        repaired = _pool_bags(weights_ptr, indices_ptr, offsets_ptr, psw_ptr, out_ptr, feature_out_offset_ptr, pid_b,
                              t, B, total_D, D, w_base, o_col, c0, num_rows, POOLING_MEAN, WEIGHTED, BOUNDS_MODE,
                              False, ALIGN, NARROW2, GATHER * (BLOCK_D // NARROW2) // NARROW2_LANES, BAGS,
                              LANES * NARROW2_LANES, OUT_MAP, OUT_ALIGN)
    else:
        repaired = _pool_bags(weights_ptr, indices_ptr, offsets_ptr, psw_ptr, out_ptr, feature_out_offset_ptr, pid_b,
                              t, B, total_D, D, w_base, o_col, c0, num_rows, POOLING_MEAN, WEIGHTED, BOUNDS_MODE,
                              EVEN_D, ALIGN, BLOCK_D, GATHER, BAGS, LANES, OUT_MAP, OUT_ALIGN)
    if BOUNDS_MODE == REPAIR_COUNT:
        if repaired > 0:
            tl.atomic_add(warning_ptr, repaired.to(tl.int64))
