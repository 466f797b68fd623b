"""Transpose kernels: lookups in batch order -> sort keys, then sorted keys -> runs (one per row).

Byte accounting per lookup: linearize reads the id (4/8 B) and writes a key (4/8 B) and a bag id
(4 B); run flags read one key (its neighbour comes from cache) and the sort's permutation (8 B),
gather the bag id (a 32 B sector for 4 B: the one random access) and write 4 + 4 B; run starts read a
key and a running count (4 B each) and write 4 B per run (N past the last run); run chunks read two
run starts (one from cache) and the first key of each run (a random 4 B read, live runs only) and
write 4 B per slot; chunk owners read two chunk offsets per run and write 4 B per long-run chunk.
Every table is sized by N; no kernel here needs a count that only the device knows.
"""

import triton
import triton.language as tl


@triton.jit
def _linearize_kernel(
    indices_ptr,
    offsets_ptr,
    feature_key_offset_ptr,
    keys_ptr,
    bags_ptr,
    B,
    bag_shift,
    BLOCK_BAGS: tl.constexpr,
    STEP: tl.constexpr,
):
    """
    Grid: [cdiv(B, BLOCK_BAGS), T]. Lookup p of bag (t, b) gets key = key_offset[t] + idx[p] (the
    table's rows in bucket-ordered key space; features sharing a table share keys, so their gradients
    merge into one run) and bag id (t << bag_shift) | b (B <= 2**bag_shift: the backward splits it
    with a shift and a mask, not a division). A program walks BLOCK_BAGS bags side by side, STEP
    lookups of each per step, so consecutive lanes read consecutive ids.

    indices_ptr: [N] int32/int64 ids; offsets_ptr: [T*B + 1].
    feature_key_offset_ptr: [T] int64.
    keys_ptr: [N] int32/int64 out (pre-filled with the sentinel for lookups outside every bag).
    bags_ptr: [N] int32/int64 out.
    """
    t = tl.program_id(1)
    b = tl.program_id(0) * BLOCK_BAGS + tl.arange(0, BLOCK_BAGS)
    bmask = b < B
    bag = t.to(tl.int64) * B + b
    start = tl.load(offsets_ptr + bag, mask=bmask, other=0).to(tl.int64)
    end = tl.load(offsets_ptr + bag + 1, mask=bmask, other=0).to(tl.int64)
    n = tl.where(bmask, end - start, 0)
    key0 = tl.load(feature_key_offset_ptr + t)
    steps = tl.arange(0, STEP)
    for j in range(0, tl.max(n, axis=0), STEP):
        m = (j + steps)[None, :] < n[:, None]
        p = start[:, None] + j + steps[None, :]
        idx = tl.load(indices_ptr + p, mask=m, other=0).to(tl.int64)
        tl.store(keys_ptr + p, (key0 + idx).to(keys_ptr.dtype.element_ty), mask=m)
        code = (t.to(tl.int64) << bag_shift) | b
        tl.store(bags_ptr + p, (code[:, None] + 0 * p).to(bags_ptr.dtype.element_ty), mask=m)


@triton.jit
def _run_flags_kernel(sorted_keys_ptr, perm_ptr, bags_ptr, sorted_bags_ptr, flags_ptr, N, BLOCK: tl.constexpr):
    """flags[i] = 1 where a run starts (i == 0 or key differs from the previous slot), else 0; and
    sorted_bags[i] = bags[perm[i]], the bag of the lookup the sort put in slot i (one pass for both)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    key = tl.load(sorted_keys_ptr + i, mask=m)
    prev = tl.load(sorted_keys_ptr + i - 1, mask=m & (i > 0))
    head = (i == 0) | (key != prev)
    tl.store(flags_ptr + i, head.to(flags_ptr.dtype.element_ty), mask=m)
    p = tl.load(perm_ptr + i, mask=m, other=0)
    tl.store(sorted_bags_ptr + i, tl.load(bags_ptr + p, mask=m, other=0), mask=m)


@triton.jit
def _run_starts_kernel(sorted_keys_ptr, run_count_ptr, run_start_ptr, N, BLOCK: tl.constexpr):
    """
    Grid: [cdiv(N + 1, BLOCK)]. run_count[i] is the inclusive count of run starts up to slot i, so the
    run starting at i is number run_count[i] - 1 and run_start[run_count[i] - 1] = i. Every run start
    is written by exactly one program: no atomics, deterministic. Entries past the last run are N (run
    r ends where run r + 1 starts); program p writes those of its index block, which never holds a
    start (a start's index is below the run count).
    """
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    key = tl.load(sorted_keys_ptr + i, mask=m)
    prev = tl.load(sorted_keys_ptr + i - 1, mask=m & (i > 0))
    head = m & ((i == 0) | (key != prev))
    r = tl.load(run_count_ptr + i, mask=head, other=1) - 1
    tl.store(run_start_ptr + r, i.to(run_start_ptr.dtype.element_ty), mask=head)
    num_runs = tl.load(run_count_ptr + N - 1)
    tl.store(run_start_ptr + i, (i * 0 + N).to(run_start_ptr.dtype.element_ty), mask=(i >= num_runs) & (i <= N))


@triton.jit
def _run_chunks_kernel(
    run_start_ptr,
    sorted_keys_ptr,
    bucket_key_bounds_ptr,
    chunk_counts_ptr,
    bucket_run_bounds_ptr,
    N,
    threshold,
    chunk,
    num_bounds,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """
    Grid: [cdiv(N + 1, BLOCK)], one lane per run r in [0, N].
    chunk_counts[0] = 0 and chunk_counts[r + 1] = the split-K chunks of run r: cdiv(L, chunk) when its
    length L reaches the threshold, else 0 (runs past the last have L = 0). Their inclusive sum is
    each run's first chunk.
    bucket_run_bounds[k] = the first run whose key is >= bucket_key_bounds[k] (the run count if
    none): the one r where run r - 1's key is below the bound and run r's key (or the end) is not.
    Buckets are contiguous in key space, so bucket k owns runs [bounds[k], bounds[k + 1]).
    """
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = r < N
    in_range = r <= N
    rs = tl.load(run_start_ptr + r, mask=in_range, other=N).to(tl.int64)
    re = tl.load(run_start_ptr + r + 1, mask=m, other=N).to(tl.int64)
    L = re - rs
    c = tl.where(m & (L >= threshold), (L + (chunk - 1)) // chunk, 0)
    tl.store(chunk_counts_ptr + r + 1, c.to(chunk_counts_ptr.dtype.element_ty), mask=m)
    tl.store(chunk_counts_ptr + r, tl.zeros_like(c).to(chunk_counts_ptr.dtype.element_ty), mask=r == 0)

    kk = tl.arange(0, BLOCK_K)
    kmask = kk < num_bounds
    bound = tl.load(bucket_key_bounds_ptr + kk, mask=kmask, other=0).to(tl.int64)
    live = rs < N
    key = tl.load(sorted_keys_ptr + rs, mask=in_range & live, other=0).to(tl.int64)
    prs = tl.load(run_start_ptr + r - 1, mask=in_range & (r > 0), other=N).to(tl.int64)
    prev_key = tl.load(sorted_keys_ptr + prs, mask=in_range & (prs < N), other=0).to(tl.int64)
    below = (r == 0)[:, None] | ((prs < N)[:, None] & (prev_key[:, None] < bound[None, :]))
    reaches = (~live)[:, None] | (bound[None, :] <= key[:, None])
    hit = below & reaches & in_range[:, None] & kmask[None, :]
    tl.store(
        bucket_run_bounds_ptr + kk[None, :] + 0 * r[:, None],
        (r[:, None] + 0 * kk[None, :]).to(bucket_run_bounds_ptr.dtype.element_ty),
        mask=hit,
    )


@triton.jit
def _chunk_runs_kernel(
    run_chunk_begin_ptr,
    bucket_run_bounds_ptr,
    chunk_run_ptr,
    bucket_chunk_bounds_ptr,
    N,
    num_bounds,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """
    Grid: [cdiv(N, BLOCK)], one lane per run r. chunk_run[c] = r for each of run r's chunks
    c in [run_chunk_begin[r], run_chunk_begin[r + 1]) (only long runs have chunks): a program takes as
    many steps as its block's longest run has chunks, one store per lane and step (no search, no
    atomics: every chunk has one owner). Slots past the live chunks are not written (the long-path
    kernels stop at bucket_chunk_bounds[K]). Program 0 also writes
    bucket_chunk_bounds[k] = run_chunk_begin[bucket_run_bounds[k]].
    """
    pid = tl.program_id(0)
    if pid == 0:
        kk = tl.arange(0, BLOCK_K)
        kmask = kk < num_bounds
        rb = tl.load(bucket_run_bounds_ptr + kk, mask=kmask, other=0)
        first = tl.load(run_chunk_begin_ptr + rb, mask=kmask, other=0)
        tl.store(bucket_chunk_bounds_ptr + kk, first.to(bucket_chunk_bounds_ptr.dtype.element_ty), mask=kmask)
    r = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = r < N
    first = tl.load(run_chunk_begin_ptr + r, mask=m, other=0).to(tl.int64)
    count = tl.load(run_chunk_begin_ptr + r + 1, mask=m, other=0).to(tl.int64) - first
    count = tl.where(m, count, 0)
    owner = r.to(chunk_run_ptr.dtype.element_ty)
    for j in range(0, tl.max(count, axis=0)):
        tl.store(chunk_run_ptr + first + j, owner, mask=j < count)
