"""Index bounds check: validate (FATAL) or validate-and-repair (WARNING / IGNORE) offsets and ids.

Offsets (WARNING / IGNORE): a parallel check counts the bad bags and raises a device flag; a
one-program repair then runs FBGEMM's sequential per-bag repair (a running max over clamped offsets,
see ops/bounds.py) only when the flag is up, so valid batches cost two small launches and no
host-side tensor ops. Ids: one program per BAGS bags of one feature, reading each id once (4 or 8
bytes per lookup) and writing only the ids they repair. The same device function repairs ids inside
the forward kernel when the check is fused.
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


@triton.jit
def _check_offsets_kernel(offsets_ptr, flag_ptr, warning_ptr, num_bags, N, COUNT: tl.constexpr, BLOCK: tl.constexpr):
    """
    Grid: [cdiv(num_bags, BLOCK)]. Bag i = [offsets[i], offsets[i + 1]) is bad when it starts below 0,
    ends before it starts or ends past N = len(indices); program 0 also counts offsets[num_bags] != N.
    Adds the count to flag_ptr (int32[1], the repair's trigger) and, with COUNT (WARNING), to the
    module's warning counter (int64[1]). Integer atomics: the totals do not depend on program order.
    """
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < num_bags
    start = tl.load(offsets_ptr + i, mask=m, other=0).to(tl.int64)
    end = tl.load(offsets_ptr + i + 1, mask=m, other=0).to(tl.int64)
    bad = m & ((start < 0) | (start > end) | (end > N))
    n = tl.sum(bad.to(tl.int32), axis=0)
    if pid == 0:
        n += (tl.load(offsets_ptr + num_bags).to(tl.int64) != N).to(tl.int32)
    if n > 0:
        tl.atomic_add(flag_ptr, n)
        if COUNT:
            tl.atomic_add(warning_ptr, n.to(tl.int64))


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _repair_offsets_kernel(offsets_ptr, flag_ptr, num_bags, N, BLOCK: tl.constexpr):
    """
    Grid: [1]. When the check raised the flag: offsets[num_bags] = N, then every offset becomes the
    running max of the offsets clamped into [0, N] (what FBGEMM's sequential loop produces: each bag
    clamped into [0, N], starting no earlier than the previous bag's end). One program walks the
    offsets in order, carrying the max across blocks; it runs only on bad input. Clears the flag.
    """
    if tl.load(flag_ptr) > 0:
        carry = tl.full([], 0, tl.int64)
        for s in range(0, num_bags + 1, BLOCK):
            i = s + tl.arange(0, BLOCK)
            m = i <= num_bags
            x = tl.load(offsets_ptr + i, mask=m, other=0).to(tl.int64)
            x = tl.where(i == num_bags, N, tl.minimum(tl.maximum(x, 0), N))
            x = tl.maximum(tl.associative_scan(x, 0, _max_combine), carry)
            tl.store(offsets_ptr + i, x.to(offsets_ptr.dtype.element_ty), mask=m)
            carry = tl.max(tl.where(m, x, 0), axis=0)
        tl.store(flag_ptr, 0)
