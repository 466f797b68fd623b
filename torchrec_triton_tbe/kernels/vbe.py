"""Variable batch per feature (ops/vbe.py): the padded offsets and the per-bag output table in one pass.

Byte accounting per padded bag (t, b), b < B: read one offset (the bag's start, or its feature's end for
padding bags) and, for its rank, two small per-(feature, rank) values (cached); write one padded offset
and one 8 B table entry. R (ranks) compares per bag to find its rank.
"""

import triton
import triton.language as tl


# t0: first feature of this launch (see _linearize_kernel); T, the feature count, is read as a value
# (.to), which Triton's specialization of a 1 would turn into a constant. Neither is specialized.
@triton.jit(do_not_specialize=["T", "t0"])
def _vbe_layout_kernel(
    offsets_ptr,
    bag_begin_ptr,
    bags_ptr,
    rank_begin_ptr,
    dims_ptr,
    base_ptr,
    padded_ptr,
    out_map_ptr,
    B,
    R,
    total_bags,
    base_stride_t,
    base_stride_r,
    T,
    t0,
    BLOCK: tl.constexpr,
):
    """
    Grid: [cdiv(B, BLOCK), features of this launch], feature t = t0 + program_id(1) of T. Feature t has
    bags[t] bags starting at bag bag_begin[t] of the given (feature-major) offsets; its rank r's bags
    start at rank_begin[t * (R + 1) + r] within the feature, and that rank's block of the output at
    base[t * base_stride_t + r * base_stride_r] (elements).
    padded_ptr: [T * B + 1] padded offsets (padding bags empty, at the feature's end).
    out_map_ptr: [T * B] int64 row start of each bag in the 1-D output, -1 for padding bags.
    """
    t = t0 + tl.program_id(1)
    b = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = b < B
    n = tl.load(bags_ptr + t)
    src = tl.load(bag_begin_ptr + t) + tl.minimum(b, n)
    slot = t.to(tl.int64) * B + b
    tl.store(padded_ptr + slot, tl.load(offsets_ptr + src, mask=m, other=0), mask=m)
    # The bag's rank: how many of ranks 1..R-1 start at or before it (empty ranks share a start: the
    # last of them, the one that holds bags, is counted).
    ranks = tl.zeros([BLOCK], dtype=tl.int64)
    row_begin = rank_begin_ptr + t.to(tl.int64) * (R + 1)
    for r in range(1, R):
        ranks += (b >= tl.load(row_begin + r)).to(tl.int64)
    first = tl.load(row_begin + ranks, mask=m, other=0)
    base = tl.load(base_ptr + t * base_stride_t + ranks * base_stride_r, mask=m, other=0).to(tl.int64)
    row = base + (b - first) * tl.load(dims_ptr + t)
    tl.store(out_map_ptr + slot, tl.where(b < n, row, -1), mask=m)
    if (t == 0) & (tl.program_id(0) == 0):
        tl.store(padded_ptr + T.to(tl.int64) * B, tl.load(offsets_ptr + total_bags))
