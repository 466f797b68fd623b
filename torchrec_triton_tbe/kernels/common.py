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
