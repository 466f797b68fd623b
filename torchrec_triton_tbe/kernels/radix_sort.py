"""A stable LSD radix sort of non-negative int32 keys carrying an int32 permutation (ops/radix_sort.py).

Why not torch.sort: it sorts all 32 bits of an int32 key (four 8-bit passes) and carries an int64
permutation, 24 bytes moved per key per pass; the run plan's keys span only bit_length(total rows)
bits (24 for 15 M rows: three passes) and its permutation fits int32, 16 bytes per key per pass.

One pass over digit (key >> shift) & (BINS - 1), programs of BLOCK consecutive keys each, two launches
and a scan between them:
1. _digit_counts_kernel: program p writes how many of its keys have each digit, digit-major
   (counts[d * num_blocks + p]), so one exclusive scan over the flat table gives every (digit, block)
   its first output slot: all smaller digits of every block, then this digit of the blocks before.
2. the scan (torch.cumsum: one CUB launch).
3. _digit_scatter_kernel: program p orders its keys by (digit, position) with tl.sort on the packed
   int32 (digit << log2(BLOCK)) | position (unique values: no ties), so key j of the sorted block has
   rank j - (keys of this block with a smaller digit) among its digit's keys here, and goes to
   that digit's first slot for this block plus that rank. Equal digits keep their order (positions
   break ties): the pass is stable, hence the sort.

Byte accounting per key and pass: counts read the key (4 B); the scatter reads key and permutation
(8 B: the sorted block's re-reads hit L1) and writes both (8 B). The counts table is BINS * N / BLOCK
entries, read by the scan and once per key by the scatter (cached).
"""

import triton
import triton.language as tl


@triton.jit
def _block_digits(keys_ptr, N, shift, BINS: tl.constexpr, BLOCK: tl.constexpr):
    """(digits, positions, live) of this program's keys; dead lanes get digit BINS (after every live
    key in the packed order)."""
    pos = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = pos < N
    key = tl.load(keys_ptr + pos, mask=live, other=0)
    digit = tl.where(live, (key >> shift) & (BINS - 1), BINS)
    return digit, pos, live


@triton.jit
def _digit_counts_kernel(keys_ptr, counts_ptr, N, shift, num_blocks, BINS: tl.constexpr, BLOCK: tl.constexpr):
    """Grid: [num_blocks]. counts[d * num_blocks + p] = keys of block p whose digit is d."""
    p = tl.program_id(0)
    digit, _, live = _block_digits(keys_ptr, N, shift, BINS, BLOCK)
    hist = tl.histogram(digit, BINS, mask=live)
    d = tl.arange(0, BINS)
    tl.store(counts_ptr + d.to(tl.int64) * num_blocks + p, hist.to(counts_ptr.dtype.element_ty))


@triton.jit
def _digit_scatter_kernel(
    keys_ptr,
    perm_ptr,
    counts_ptr,
    scanned_ptr,
    keys_out_ptr,
    perm_out_ptr,
    N,
    shift,
    num_blocks,
    BINS: tl.constexpr,
    BLOCK: tl.constexpr,
    LOG_BLOCK: tl.constexpr,
    FIRST: tl.constexpr,
):
    """Grid: [num_blocks]. Key i of block p goes to slot scanned[d * num_blocks + p] - counts[...] (its
    digit's first slot for this block) + its rank among this block's keys of digit d. FIRST: the
    permutation is the identity (perm_ptr unread)."""
    p = tl.program_id(0)
    digit, pos, live = _block_digits(keys_ptr, N, shift, BINS, BLOCK)
    local = tl.arange(0, BLOCK)
    order = tl.sort((digit << LOG_BLOCK) | local)
    d = order >> LOG_BLOCK
    src = p.to(tl.int64) * BLOCK + (order & (BLOCK - 1))
    ok = d < BINS  # the dead lanes sort last
    hist = tl.histogram(digit, BINS, mask=live)
    smaller = tl.cumsum(hist, axis=0) - hist  # this block's keys with a smaller digit, per digit
    dc = tl.minimum(d, BINS - 1)
    rank = local - tl.gather(smaller, dc, 0)
    entry = dc.to(tl.int64) * num_blocks + p
    first = tl.load(scanned_ptr + entry, mask=ok, other=0) - tl.load(counts_ptr + entry, mask=ok, other=0)
    dest = first.to(tl.int64) + rank
    key = tl.load(keys_ptr + src, mask=ok, other=0)
    if FIRST:
        val = src.to(perm_out_ptr.dtype.element_ty)
    else:
        val = tl.load(perm_ptr + src, mask=ok, other=0)
    tl.store(keys_out_ptr + dest, key, mask=ok)
    tl.store(perm_out_ptr + dest, val, mask=ok)
