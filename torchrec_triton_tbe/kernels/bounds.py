"""Index bounds check: validate (FATAL) or validate-and-repair (WARNING / IGNORE) offsets and ids.

Offsets (WARNING / IGNORE): a parallel check counts the bad bags, and its last program to finish
runs FBGEMM's sequential per-bag repair (a running max over clamped offsets, see ops/bounds.py) only
when the count is not 0, so valid batches cost one small launch and no host-side tensor ops. Ids:
one flat pass over the id positions, each id's feature found by a binary search over the features'
first offsets, reading each id once (4 or 8 bytes per lookup) and writing only the ids it repairs.
The same device function repairs ids inside the forward kernel when the check is fused.
"""

import triton
import triton.language as tl


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
def repaired_view(idx, lmask, num_rows):
    """The ids repair_indices returns, neither written nor counted: for the forward's column slices
    (COL_CHUNKS) other than a feature's first, whose program owns the write and the count. A slice may
    load an id before or after the owner rewrote it; either way it pools row 0 for it, as the owner."""
    return tl.where(lmask & ((idx < 0) | (idx >= num_rows)), 0, idx)


@triton.jit
def _check_indices_kernel(
    indices_ptr,
    offsets_ptr,
    feature_rows_ptr,
    warning_ptr,
    first_bad_ptr,
    B,
    N,
    T,
    steps,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """
    Grid: [cdiv(N, BLOCK)], over id positions j in [p * BLOCK, (p + 1) * BLOCK): every id inside a bag
    (offsets[0] <= j < offsets[T * B]) is checked against its feature's rows. Offsets must already be
    valid (repaired or checked), so they are non-decreasing and feature t owns [offsets[t * B],
    offsets[(t + 1) * B]); j's feature is the largest t with offsets[t * B] <= j (empty features share
    their successor's start), found by a binary search of ``steps`` = bit_length(T - 1) halvings over the T
    starts (L1-resident). Why flat and not per bag: a program per few bags read long bags GATHER ids
    at a time (0.196 ms against FBGEMM's 0.107 on the production-shaped step at B = 8,192, bags of 1 to
    120); here every id costs the same, and the loads are coalesced.

    indices_ptr: [N] int32/int64 ids (repaired in place unless MODE == CHECK_ONLY).
    offsets_ptr: [T*B + 1] bag boundaries.
    feature_rows_ptr: [T] int64 rows of each feature's table.
    warning_ptr: int64[1] count of repaired ids (MODE == REPAIR_COUNT).
    first_bad_ptr: int64[1] smallest bad position, pre-filled with N = len(indices) (MODE == CHECK_ONLY).
    """
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    zero = tl.zeros([], dtype=tl.int64)  # int64 products whether T, B are runtime ints or Triton's 1 constants
    first = tl.load(offsets_ptr).to(tl.int64)
    last = tl.load(offsets_ptr + (zero + T) * B).to(tl.int64)
    live = (j >= first) & (j < last) & (j < N)
    lo = tl.zeros([BLOCK], dtype=tl.int32)
    hi = tl.zeros([BLOCK], dtype=tl.int32) + (T - 1)
    for _ in range(0, steps):
        active = live & (lo < hi)
        mid = lo + (hi - lo + 1) // 2
        start = tl.load(offsets_ptr + mid.to(tl.int64) * B, mask=active, other=0)
        go = start <= j
        lo = tl.where(active & go, mid, lo)
        hi = tl.where(active & ~go, mid - 1, hi)
    num_rows = tl.load(feature_rows_ptr + lo, mask=live, other=1)
    idx = tl.load(indices_ptr + j, mask=live, other=0)
    if MODE == CHECK_ONLY:
        bad = live & ((idx < 0) | (idx >= num_rows))
        first_bad = tl.min(tl.where(bad, j, N), axis=0)
        if first_bad < N:
            tl.atomic_min(first_bad_ptr, first_bad)
    else:
        idx, nbad = repair_indices(indices_ptr + j, idx, live, num_rows)
        if MODE == REPAIR_COUNT:
            if nbad > 0:
                tl.atomic_add(warning_ptr, nbad.to(tl.int64))


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


# N (the ids' count) is compared with offsets, never a mask bound: not specialized, or every batch
# whose count changes its divisibility by 16 would compile this kernel again.
@triton.jit(do_not_specialize=["N"])
def _check_offsets_kernel(offsets_ptr, scratch_ptr, warning_ptr, num_bags, N, COUNT: tl.constexpr,
                          BLOCK: tl.constexpr):
    """
    Grid: [cdiv(num_bags, BLOCK)]. Bag i = [offsets[i], offsets[i + 1]) is bad when it starts below 0,
    ends before it starts or ends past N = len(indices); program 0 also counts offsets[num_bags] != N.
    Adds the count to scratch_ptr[0] (the repair's trigger) and, with COUNT (WARNING), to the module's
    warning counter (int64[1]). Integer atomics: the totals do not depend on program order.

    The last program to finish repairs the offsets when the count is not 0 (offsets[num_bags] = N, then
    every offset becomes the running max of the offsets clamped into [0, N]: what FBGEMM's sequential
    loop produces, each bag clamped into [0, N] and starting no earlier than the previous bag's end). It
    walks them alone, in order, carrying the max across blocks; this runs only on bad input. The repair
    reads offsets every program checks, so it must follow all of them: each program takes a ticket from
    scratch_ptr[1] after its count (acq_rel atomics: a program's count is visible to whoever takes a later
    ticket), and the one taking the last ticket repairs, then zeroes both words for the next call. This
    was a second, one-program launch: launch-bound forwards wait for every launch the host issues.
    scratch_ptr: the module's int32[2] zeros (count, tickets).
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
        tl.atomic_add(scratch_ptr, n, sem="acq_rel")
        if COUNT:
            tl.atomic_add(warning_ptr, n.to(tl.int64))
    ticket = tl.atomic_add(scratch_ptr + 1, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) - 1:
        # An atomic read: the counts of every program, not a cached value.
        if tl.atomic_add(scratch_ptr, 0, sem="acq_rel") > 0:
            carry = tl.full([], 0, tl.int64)
            for s in range(0, num_bags + 1, BLOCK):
                j = s + tl.arange(0, BLOCK)
                mj = j <= num_bags
                x = tl.load(offsets_ptr + j, mask=mj, other=0).to(tl.int64)
                x = tl.where(j == num_bags, N, tl.minimum(tl.maximum(x, 0), N))
                x = tl.maximum(tl.associative_scan(x, 0, _max_combine), carry)
                tl.store(offsets_ptr + j, x.to(offsets_ptr.dtype.element_ty), mask=mj)
                carry = tl.max(tl.where(mj, x, 0), axis=0)
        tl.store(scratch_ptr, 0)
        tl.store(scratch_ptr + 1, 0)
