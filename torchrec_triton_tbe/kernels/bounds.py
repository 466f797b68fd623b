"""Index bounds check: validate (FATAL) or validate-and-repair (WARNING / IGNORE) the ids of every bag.

Offsets are repaired on the host side of the pipeline (a cummax over clamped offsets reproduces
FBGEMM's sequential per-bag repair exactly, see ops/bounds.py); these kernels handle the ids, one
program per BAGS bags of one feature, reading each id once (4 or 8 bytes per lookup) and writing
only the ids they repair. The same device function repairs ids inside the forward kernel when the
check is fused.
"""

import triton
import triton.language as tl

from torchrec_triton_tbe.kernels.common import bag_bounds

# Modes of the id check (ops/bounds.py maps FBGEMM's BoundsCheckMode onto them).
REPAIR_OFF: tl.constexpr = tl.constexpr(0)
REPAIR_COUNT: tl.constexpr = tl.constexpr(1)  # WARNING: repair to row 0 and count
REPAIR_SILENT: tl.constexpr = tl.constexpr(2)  # IGNORE: repair to row 0
CHECK_ONLY: tl.constexpr = tl.constexpr(3)  # FATAL: record the first bad position, change nothing


@triton.jit
def repair_indices(idx_ptrs, idx, lmask, num_rows):
    """Ids outside [0, num_rows) become 0 (FBGEMM's repair) and are written back in place, so the
    backward sees the same ids the forward pooled. Returns the repaired ids and how many changed (one
    scalar for a tile of any rank: the forward's [GATHER] steps and its bag lanes' [LANES, GATHER])."""
    bad = lmask & ((idx < 0) | (idx >= num_rows))
    idx = tl.where(bad, 0, idx)
    tl.store(idx_ptrs, idx, mask=bad)
    return idx, tl.sum(bad.to(tl.int32))


@triton.jit
def _check_indices_kernel(
    indices_ptr,
    offsets_ptr,
    feature_rows_ptr,
    warning_ptr,
    first_bad_ptr,
    B,
    N,
    MODE: tl.constexpr,
    GATHER: tl.constexpr,
    BAGS: tl.constexpr,
):
    """
    Grid: [cdiv(B, BAGS), T]. Offsets must already be valid (repaired or checked).

    indices_ptr: [N] int32/int64 ids (repaired in place unless MODE == CHECK_ONLY).
    offsets_ptr: [T*B + 1] bag boundaries.
    feature_rows_ptr: [T] int64 rows of each feature's table.
    warning_ptr: int64[1] count of repaired ids (MODE == REPAIR_COUNT).
    first_bad_ptr: int64[1] smallest bad position, pre-filled with N = len(indices) (MODE == CHECK_ONLY).
    """
    pid_b = tl.program_id(0)
    t = tl.program_id(1)
    num_rows = tl.load(feature_rows_ptr + t)
    g = tl.arange(0, GATHER)
    nbad = tl.full([], 0, tl.int32)
    first_bad = tl.full([], 0, tl.int64) + N
    for bb in tl.static_range(BAGS):
        b = pid_b * BAGS + bb
        if b < B:
            bag, start, end = bag_bounds(offsets_ptr, t, b, B)
            for j in range(start, end, GATHER):
                lmask = (j + g) < end
                idx = tl.load(indices_ptr + j + g, mask=lmask, other=0)
                if MODE == CHECK_ONLY:
                    bad = lmask & ((idx < 0) | (idx >= num_rows))
                    first_bad = tl.minimum(first_bad, tl.min(tl.where(bad, j + g, N), axis=0))
                else:
                    idx, n = repair_indices(indices_ptr + j + g, idx, lmask, num_rows)
                    nbad += n
    if MODE == CHECK_ONLY:
        if first_bad < N:
            tl.atomic_min(first_bad_ptr, first_bad)
    if MODE == REPAIR_COUNT:
        if nbad > 0:
            tl.atomic_add(warning_ptr, nbad.to(tl.int64))
