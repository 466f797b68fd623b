"""Device helpers shared by the bag-walking kernels (forward, bounds check, psw gradient)."""

import triton
import triton.language as tl


@triton.jit
def bag_bounds(offsets_ptr, t, b, B):
    """Bag (t, b): its flat id t*B + b and its lookups [start, end) (64-bit: N may pass 2^31)."""
    bag = t.to(tl.int64) * B + b
    return bag, tl.load(offsets_ptr + bag).to(tl.int64), tl.load(offsets_ptr + bag + 1).to(tl.int64)


@triton.jit
def column_mask(cols, D, EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Live columns of a row of width D; EVEN_D (D == BLOCK_D for the whole bucket) makes it constant."""
    if EVEN_D:
        return cols < BLOCK_D
    return cols < D


@triton.jit
def out_row_start(out_offset_ptr, o_col, t, b, B, total_D, m, OUT_MAP: tl.constexpr):
    """Element offset of bag (t, b)'s output row (also its output-gradient row), where m. Fixed batch:
    the output is [B, total_D] and the row starts at b * total_D + o_col, o_col being the feature's
    column offset (out_offset_ptr[t], loaded by the caller: once per program where t is fixed; for a
    sequence backward, the feature's first position times D). OUT_MAP (variable batch per feature,
    VBE): out_offset_ptr is a per-bag table [T * B] of row starts in the 1-D output, -1 for the padding
    bags of features with fewer than B bags, and o_col is unused. t and b may be scalars or vectors."""
    if OUT_MAP:
        return tl.load(out_offset_ptr + t.to(tl.int64) * B + b, mask=m, other=0)
    return b.to(tl.int64) * total_D + o_col


@triton.jit
def advance_step_count(count_ptr, saved_ptr, first):
    """Called under a forward's ADVANCE (its first pooled / sequence launch); ``first``: whether this is
    that launch's first program, which adds 1 to the module's step count and writes the new value to
    ``saved_ptr`` too (the backward's copy; ``count_ptr`` itself where no update reads it). In the forward's launch
    instead of two torch ops (``add_``, ``clone``): on launch-bound batches each device launch the host
    issues costs as much as a small kernel. Masked, not branched: under an ``if`` ptxas gave one sequence
    specialization (BLOCK_D 512, 4 warps) a stack frame."""
    count = tl.load(count_ptr, mask=first, other=0) + 1
    tl.store(count_ptr, count, mask=first)
    tl.store(saved_ptr, count, mask=first)
