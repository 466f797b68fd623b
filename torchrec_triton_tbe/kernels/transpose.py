"""Transpose kernels: lookups in batch order -> sort keys, then sorted keys -> runs (one per row).

Byte accounting per lookup: linearize reads the id (4/8 B) and writes a key (4/8 B) and a bag id
(4 B); run boundaries read one key and one running head count (4 B each) and write 4 B per run.
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
    GATHER: tl.constexpr,
    BAGS: tl.constexpr,
):
    """
    Grid: [cdiv(B, BAGS), T]. Lookup p of bag (t, b) gets key = key_offset[t] + idx[p] (the table's
    rows in bucket-ordered key space; features sharing a table share keys, so their gradients merge
    into one run) and bag id t*B + b.

    indices_ptr: [N] int32/int64 ids; offsets_ptr: [T*B + 1].
    feature_key_offset_ptr: [T] int64.
    keys_ptr: [N] int32/int64 out (pre-filled with the sentinel for lookups outside every bag).
    bags_ptr: [N] int32 out.
    """
    pid_b = tl.program_id(0)
    t = tl.program_id(1)
    key0 = tl.load(feature_key_offset_ptr + t)
    g = tl.arange(0, GATHER)
    for bb in tl.static_range(BAGS):
        b = pid_b * BAGS + bb
        if b < B:
            bag = t.to(tl.int64) * B + b
            start = tl.load(offsets_ptr + bag).to(tl.int64)
            end = tl.load(offsets_ptr + bag + 1).to(tl.int64)
            for j in range(start, end, GATHER):
                lmask = (j + g) < end
                idx = tl.load(indices_ptr + j + g, mask=lmask, other=0).to(tl.int64)
                tl.store(keys_ptr + j + g, (key0 + idx).to(keys_ptr.dtype.element_ty), mask=lmask)
                tl.store(bags_ptr + j + g, bag.to(tl.int32), mask=lmask)


@triton.jit
def _run_starts_kernel(sorted_keys_ptr, run_count_ptr, run_start_ptr, N, BLOCK: tl.constexpr):
    """
    Grid: [cdiv(N, BLOCK)]. Position i starts a run when its key differs from position i-1's;
    run_count[i] is the inclusive count of run starts up to i, so the run starting at i is number
    run_count[i] - 1 and run_start[run_count[i] - 1] = i. Every run start is written by exactly one
    program: no atomics, deterministic.
    """
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    key = tl.load(sorted_keys_ptr + i, mask=m)
    prev = tl.load(sorted_keys_ptr + i - 1, mask=m & (i > 0))
    head = m & ((i == 0) | (key != prev))
    r = tl.load(run_count_ptr + i, mask=head, other=1) - 1
    tl.store(run_start_ptr + r, i.to(run_start_ptr.dtype.element_ty), mask=head)
