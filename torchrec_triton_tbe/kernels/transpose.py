"""Transpose kernels: lookups in batch order -> sort keys, then sorted keys -> runs (one per row).

The run metadata is two scans (run starts over slots, chunk offsets over runs), each in three
launches without a tensor op between them: a pass that writes one total per program of BLOCK slots
(or runs), one program that turns the totals into exclusive prefixes in place (N / BLOCK of them: a
few dozen steps on the largest batches), and a pass whose program p starts its running sum at its
prefix. Every program handles one block, so the passes keep the GPU as busy as elementwise kernels.

Byte accounting per lookup: linearize reads the id (4/8 B) and writes a key (4/8 B) and a bag id
(4 B); run flags read one key (its neighbour comes from cache) and the sort's permutation (8 B) and
gather the bag id (a 32 B sector for 4 B: the one random access), writing 4 B; run starts read the
key again and write 4 B per run (N past the last run); run chunks read two run starts (one from
cache); chunk offsets read the two run starts again and write 4 B per run plus 4 B per long-run
chunk. The chunk passes stop at the run count, read from the scanned totals: past it they read and
write nothing (a batch whose rows repeat has far fewer runs than lookups). Every table is sized by N;
no launch needs a count that only the device knows.
"""

import triton
import triton.language as tl

from torchrec_triton_tbe.kernels.small_table import _feature_lookups


# t0 is the first feature of this launch (features past CUDA's grid-y limit take more launches): not
# specialized, so the first launch, t0 = 0, is the same compiled kernel as the later ones.
@triton.jit(do_not_specialize=["t0"])
def _linearize_kernel(
    indices_ptr,
    offsets_ptr,
    feature_key_offset_ptr,
    keys_ptr,
    bags_ptr,
    feature_small_ptr,
    B,
    bag_shift,
    min_lookups,
    t0,
    BLOCK_BAGS: tl.constexpr,
    STEP: tl.constexpr,
    NOBAG: tl.constexpr,
    SMALL: tl.constexpr,
):
    """
    Grid: [cdiv(B, BLOCK_BAGS), features of this launch], feature t = t0 + program_id(1). Lookup p of bag (t, b)
    gets key = key_offset[t] + idx[p] (the table's rows in bucket-ordered key space; features sharing a table share
    keys, so their gradients merge into one run) and bag id (t << bag_shift) | b (B <= 2**bag_shift: the backward
    splits it with a shift and a mask, not a division). A program walks BLOCK_BAGS bags side by side, STEP lookups
    of each per step, so consecutive lanes read consecutive ids.

    NOBAG (PoolingMode.NONE): every lookup is its own output row, so its "bag" id is
    (t << bag_shift) | (p - offsets[t*B]), its position within its feature (N <= 2**bag_shift): the
    backward then finds its gradient row exactly as a pooled bag's, with the feature's first position
    as the column offset (ops/backward.py).

    indices_ptr: [N] int32/int64 ids; offsets_ptr: [T*B + 1].
    feature_key_offset_ptr: [T] int64.
    keys_ptr: [N] int32/int64 out (pre-filled with the sentinel for lookups outside every bag).
    bags_ptr: [N] int32/int64 out.

    SMALL (the backward takes the small-table path, ops/small_table.py): the lookups of a small-table
    feature the path takes this call (kernels/small_table.py _feature_lookups; feature_small_ptr: [T]
    int32 flags) keep the sentinel key, so they sort past every bucket and no generic kernel applies them.
    """
    t = t0 + tl.program_id(1)
    if SMALL:
        if (tl.load(feature_small_ptr + t) != 0) & (_feature_lookups(offsets_ptr, t, B) >= min_lookups):
            return
    b = tl.program_id(0) * BLOCK_BAGS + tl.arange(0, BLOCK_BAGS)
    bmask = b < B
    bag = t.to(tl.int64) * B + b
    start = tl.load(offsets_ptr + bag, mask=bmask, other=0).to(tl.int64)
    end = tl.load(offsets_ptr + bag + 1, mask=bmask, other=0).to(tl.int64)
    n = tl.where(bmask, end - start, 0)
    key0 = tl.load(feature_key_offset_ptr + t)
    first = tl.load(offsets_ptr + t.to(tl.int64) * B).to(tl.int64)
    steps = tl.arange(0, STEP)
    for j in range(0, tl.max(n, axis=0), STEP):
        m = (j + steps)[None, :] < n[:, None]
        p = start[:, None] + j + steps[None, :]
        idx = tl.load(indices_ptr + p, mask=m, other=0).to(tl.int64)
        tl.store(keys_ptr + p, (key0 + idx).to(keys_ptr.dtype.element_ty), mask=m)
        if NOBAG:
            code = (t.to(tl.int64) << bag_shift) | (p - first)
        else:
            code = ((t.to(tl.int64) << bag_shift) | b)[:, None] + 0 * p
        tl.store(bags_ptr + p, code.to(bags_ptr.dtype.element_ty), mask=m)


# num_programs follows the batch's lookup count: not specialized, or Triton would compile this kernel
# again whenever that count changes its divisibility by 16 (one program scans a few thousand totals:
# the vector width of its masked loads is immaterial).
@triton.jit(do_not_specialize=["num_programs"])
def _scan_totals_kernel(totals_ptr, num_programs, BLOCK: tl.constexpr):
    """
    Grid: [1]. totals[0:num_programs] (one per program of a metadata pass) become exclusive prefix
    sums in place, and totals[num_programs] the sum of all of them.
    """
    carry = tl.full([], 0, tl.int64)
    for s in range(0, num_programs, BLOCK):
        j = s + tl.arange(0, BLOCK)
        m = j < num_programs
        v = tl.load(totals_ptr + j, mask=m, other=0).to(tl.int64)
        tl.store(totals_ptr + j, (carry + tl.cumsum(v, axis=0) - v).to(totals_ptr.dtype.element_ty), mask=m)
        carry += tl.sum(v, axis=0)
    tl.store(totals_ptr + num_programs, carry.to(totals_ptr.dtype.element_ty))


@triton.jit
def _block_slots(BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """Slots (or runs) [p * BLOCK, (p + 1) * BLOCK) of this program, in int32 unless WIDE (N + a block
    past 2**31). Why not always int64: these passes are latency-bound (one short block per program,
    ~300 blocks per SM on 42 M lookups), and 64-bit indices and prefix sums cost registers: ptxas for
    sm_90 at BLOCK=1024 with 4 warps, run starts 92 -> 72 and chunk offsets 108 -> 80 per thread in
    int32, so more programs fit on an SM and more loads are in flight (docs/performance.md)."""
    p = tl.program_id(0)
    if WIDE:
        return p.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    else:
        return p * BLOCK + tl.arange(0, BLOCK)


@triton.jit
def _slot_keys(sorted_keys_ptr, i, N):
    """(key, previous slot's key, run start?) of slots i: a run starts at slot 0 and wherever the key
    changes. The previous key is loaded up to i == N (the end, a bucket-bound candidate). Keys keep
    their dtype (compared, never added)."""
    key = tl.load(sorted_keys_ptr + i, mask=i < N, other=0)
    prev = tl.load(sorted_keys_ptr + i - 1, mask=(i > 0) & (i <= N), other=0)
    return key, prev, (i < N) & ((i == 0) | (key != prev))


@triton.jit
def _run_flags_kernel(
    sorted_keys_ptr, perm_ptr, bags_ptr, sorted_bags_ptr, program_runs_ptr, N, sentinel,
    BLOCK: tl.constexpr, WIDE: tl.constexpr
):
    """
    Grid: [cdiv(N + 1, BLOCK)]. program_runs[p] = how many runs start in slots [p * BLOCK, (p + 1) *
    BLOCK) (slot 0, or a key unlike the previous slot's); and sorted_bags[i] = bags[perm[i]], the bag
    of the lookup the sort put in slot i (one pass for both); 0 for a lookup outside every bag (its key
    is the sentinel): linearize never writes its bag, so reading it would read uninitialised memory
    (compute-sanitizer initcheck; such slots sort past every bucket and are never applied).
    """
    p = tl.program_id(0)
    i = _block_slots(BLOCK, WIDE)
    m = i < N
    key, _, head = _slot_keys(sorted_keys_ptr, i, N)
    count = tl.sum(head.to(i.dtype), axis=0)
    q = tl.load(perm_ptr + i, mask=m, other=0)
    tl.store(sorted_bags_ptr + i, tl.load(bags_ptr + q, mask=m & (key != sentinel), other=0), mask=m)
    tl.store(program_runs_ptr + p, count.to(program_runs_ptr.dtype.element_ty))


# num_programs only indexes one load: not specialized (a recompile per batch count's divisibility).
@triton.jit(do_not_specialize=["num_programs"])
def _run_starts_kernel(
    sorted_keys_ptr,
    run_prefix_ptr,
    bucket_key_bounds_ptr,
    run_start_ptr,
    bucket_run_bounds_ptr,
    N,
    num_programs,
    num_bounds,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WIDE: tl.constexpr,
):
    """
    Grid: [cdiv(N + 1, BLOCK)]. run_prefix[p] = runs starting before this program's slots (scanned
    program totals; run_prefix[num_programs] = all runs). The run starting at slot i is number
    run_prefix[p] + (run starts up to i in this block) - 1, so run_start[that] = i: every entry written
    by one program, no atomics, deterministic. Entries from the run count on are N (run r ends where
    run r + 1 starts); program p writes those of its own index range, which holds entry N at the end.

    bucket_run_bounds[k] = the first run whose key is >= bucket_key_bounds[k] (the run count when no
    key is): the one run start (or the end, slot N) whose key reaches the bound while the previous
    slot's key is below it. Buckets are contiguous in key space, so bucket k owns runs
    [bounds[k], bounds[k + 1]).
    """
    p = tl.program_id(0)
    i = _block_slots(BLOCK, WIDE)
    key, prev, head = _slot_keys(sorted_keys_ptr, i, N)
    r = tl.load(run_prefix_ptr + p).to(i.dtype) + tl.cumsum(head.to(i.dtype), axis=0) - 1
    tl.store(run_start_ptr + r, i.to(run_start_ptr.dtype.element_ty), mask=head)
    num_runs = tl.load(run_prefix_ptr + num_programs).to(i.dtype)
    tl.store(run_start_ptr + i, (i * 0 + N).to(run_start_ptr.dtype.element_ty), mask=(i >= num_runs) & (i <= N))

    kk = tl.arange(0, BLOCK_K)
    kmask = kk < num_bounds
    bound = tl.load(bucket_key_bounds_ptr + kk, mask=kmask, other=0)
    end = i == N
    below = (i == 0)[:, None] | (prev[:, None] < bound[None, :])
    reaches = end[:, None] | (bound[None, :] <= key[:, None])
    hit = (head | end)[:, None] & below & reaches & kmask[None, :]
    run = tl.where(end, num_runs, r)
    tl.store(
        bucket_run_bounds_ptr + kk[None, :] + 0 * i[:, None],
        (run[:, None] + 0 * kk[None, :]).to(bucket_run_bounds_ptr.dtype.element_ty),
        mask=hit,
    )


@triton.jit
def _run_chunk_count(run_start_ptr, r, num_runs, threshold, chunk):
    """Split-K chunks of runs r: cdiv(L, chunk) when the length L reaches the threshold, else 0 (and 0
    past the last run, whose starts are not read: a batch whose rows repeat has far fewer runs than
    its N lookups, and the chunk passes would otherwise read N + 1 starts twice)."""
    m = r < num_runs
    L = (tl.load(run_start_ptr + r + 1, mask=m, other=0) - tl.load(run_start_ptr + r, mask=m, other=0)).to(r.dtype)
    return tl.where(m & (L >= threshold), (L + (chunk - 1)) // chunk, 0)


# num_programs only indexes one load: not specialized (a recompile per batch count's divisibility).
@triton.jit(do_not_specialize=["num_programs"])
def _run_chunks_kernel(
    run_start_ptr, run_prefix_ptr, program_chunks_ptr, num_programs, threshold, chunk, BLOCK: tl.constexpr,
    WIDE: tl.constexpr
):
    """Grid: [cdiv(N + 1, BLOCK)], over runs r in [p * BLOCK, (p + 1) * BLOCK):
    program_chunks[p] = the split-K chunks of its runs (_run_chunk_count); run_prefix[num_programs] is
    the run count (_run_starts_kernel's scanned totals)."""
    p = tl.program_id(0)
    r = _block_slots(BLOCK, WIDE)
    num_runs = tl.load(run_prefix_ptr + num_programs).to(r.dtype)
    count = tl.sum(_run_chunk_count(run_start_ptr, r, num_runs, threshold, chunk), axis=0)
    tl.store(program_chunks_ptr + p, count.to(program_chunks_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["num_programs"])
def _chunk_offsets_kernel(
    run_start_ptr,
    run_prefix_ptr,
    chunk_prefix_ptr,
    bucket_run_bounds_ptr,
    run_chunk_begin_ptr,
    bucket_chunk_bounds_ptr,
    chunk_run_ptr,
    num_programs,
    threshold,
    chunk,
    num_bounds,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WIDE: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    """
    Grid: [cdiv(N + 1, BLOCK)], over runs r in [p * BLOCK, (p + 1) * BLOCK), written for r <= the run
    count R (run_prefix[num_programs]); entries past R are left unwritten and never read.
    SEARCH_STEPS: bit_length(BLOCK - 1), the halvings that narrow BLOCK runs to one.
    chunk_prefix[p]: the chunks of the runs before this program's (scanned program totals; entry
    num_programs: all chunks).
    run_chunk_begin[r] = the chunks of all runs before r (exclusive prefix sum; entry R = all chunks);
    bucket_chunk_bounds[k] = run_chunk_begin[bucket_run_bounds[k]], written by the program holding
    that run.
    chunk_run[q] = the run owning chunk q, for this program's chunks [chunk_prefix[p], chunk_prefix[p +
    1]): the largest run r of the block with run_chunk_begin[r] <= q (runs without chunks share their
    successor's begin, so the largest is the one with chunks), a binary search over the block's begins
    just written (log2(BLOCK) steps). Why here: a separate pass searched all R + 1 begins per chunk (up to
    bit_length(N + 1) dependent loads): 30 µs of dlrm_t26_l1's backward on the H200 under Nsight Compute,
    111 programs of 4 warps waiting on 21 round trips (docs/performance.md). A loop over each run's
    chunks instead took as many steps as the longest run has chunks (0.248 ms at 7.6 M lookups); this
    one takes one search per BLOCK of the block's chunks, and none for a round of BLOCK chunks that all
    belong to the run the previous round ended in (a hot row's).
    """
    p = tl.program_id(0)
    r = _block_slots(BLOCK, WIDE)
    num_runs = tl.load(run_prefix_ptr + num_programs).to(r.dtype)
    in_range = r <= num_runs
    c = _run_chunk_count(run_start_ptr, r, num_runs, threshold, chunk)
    c_lo = tl.load(chunk_prefix_ptr + p).to(r.dtype)
    first = c_lo + tl.cumsum(c, axis=0) - c
    tl.store(run_chunk_begin_ptr + r, first.to(run_chunk_begin_ptr.dtype.element_ty), mask=in_range)
    kk = tl.arange(0, BLOCK_K)
    kmask = kk < num_bounds
    bucket_runs = tl.load(bucket_run_bounds_ptr + kk, mask=kmask, other=-1).to(r.dtype)
    hit = (r[:, None] == bucket_runs[None, :]) & in_range[:, None] & kmask[None, :]
    tl.store(
        bucket_chunk_bounds_ptr + kk[None, :] + 0 * r[:, None],
        (first[:, None] + 0 * kk[None, :]).to(bucket_chunk_bounds_ptr.dtype.element_ty),
        mask=hit,
    )
    # Every thread's begins are stored before any thread searches them (the barrier makes a block's
    # global stores visible to the whole block).
    tl.debug_barrier()
    c_hi = tl.load(chunk_prefix_ptr + p + 1).to(r.dtype)
    # The block's runs that may own chunks: [first run, last run below R]; when the block holds none,
    # it has no chunks either (c_lo == c_hi) and the loop does not run.
    r_first = tl.min(r, axis=0)
    r_last = tl.minimum(tl.max(r, axis=0), num_runs - 1)
    lanes = tl.arange(0, BLOCK).to(r.dtype)
    # A hot row's run can hold most of a block's chunks (a default id in every bag: hundreds of thousands
    # of chunks), which one program writes BLOCK per round. The run owning the last chunk searched and the
    # end of its chunks are kept, so rounds wholly inside that run store it without a search: such a run
    # costs one search, then stores only.
    cur_run = r_first
    cur_end = c_lo  # the first round searches
    for q0 in range(c_lo, c_hi, BLOCK):
        q = q0 + lanes
        live = q < c_hi
        if q0 + BLOCK <= cur_end:
            owner = tl.zeros_like(q) + cur_run
        else:
            lo = tl.zeros_like(q) + r_first
            hi = tl.zeros_like(q) + r_last
            for _ in tl.static_range(SEARCH_STEPS):
                active = live & (lo < hi)
                mid = lo + (hi - lo + 1) // 2
                go = tl.load(run_chunk_begin_ptr + mid, mask=active, other=0).to(r.dtype) <= q
                lo = tl.where(active & go, mid, lo)
                hi = tl.where(active & ~go, mid - 1, hi)
            owner = lo
            # Owners never decrease with q: the largest is the last live chunk's. Its chunks end at its
            # first chunk plus its count, both still in registers (the next run's begin may belong to
            # the next program's block, written with no order to this one).
            cur_run = tl.max(tl.where(live, lo, r_first), axis=0)
            cur_end = tl.sum(tl.where(r == cur_run, first + c, 0), axis=0)
        tl.store(chunk_run_ptr + q, owner.to(chunk_run_ptr.dtype.element_ty), mask=live)
