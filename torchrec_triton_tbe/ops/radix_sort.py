"""The run plan's sort: stable, by key, returning the sorted keys and the permutation (kernels/radix_sort.py).

``transpose.sort`` (configs/) picks the implementation: "radix" (ours: as many passes as the keys have
significant bits, an int32 permutation) or "torch" (torch.sort(stable=True): all 32 bits, int64
permutation). Both give the same keys and the same permutation (the stable order is unique); the
radix sort takes int32 keys of at most 31 bits and fewer than 2**31 of them, which the run plan's keys
are unless the tables hold 2**31 - 1 rows or more (plan.key_dtype int64) or the batch 2**31 lookups:
those batches take torch.sort, by that rule and not by any runtime condition.

No host sync: every size is known from N and the key width.
"""

from __future__ import annotations

import dataclasses

import torch

from torchrec_triton_tbe.kernels.radix_sort import _digit_counts_kernel, _digit_scatter_kernel
from torchrec_triton_tbe.ops.launch import cdiv, launch


@dataclasses.dataclass(frozen=True)
class RadixSortPlan:
    key_bits: int  # keys are < 2**key_bits
    radix_bits: int  # bits per pass: 2**radix_bits digit bins
    block: int  # keys per program (a power of two)
    num_warps: int

    @property
    def passes(self) -> int:
        return cdiv(max(self.key_bits, 1), self.radix_bits)


def radix_applies(keys: torch.Tensor) -> bool:
    """int32 keys (of at most 31 bits, non-negative) and an int32 permutation."""
    return keys.dtype == torch.int32 and keys.numel() < 2**31 - 1


def sort_keys(keys: torch.Tensor, plan: RadixSortPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted keys, perm): keys[perm] == sorted keys, equal keys in input order. keys: [N] int32,
    every one in [0, 2**plan.key_bits)."""
    if not radix_applies(keys):
        raise ValueError(f"sort_keys: the radix sort takes fewer than 2**31 - 1 int32 keys, got {keys.numel()} "
                         f"{keys.dtype} keys (ops/transpose.py sorts those with torch.sort)")
    if not 1 <= plan.key_bits <= 31:
        raise ValueError(f"sort_keys: key_bits must be in [1, 31], got {plan.key_bits}")
    N = keys.numel()
    perm = torch.empty(N, dtype=torch.int32, device=keys.device)
    if N == 0:
        return keys.clone(), perm
    bins = 1 << plan.radix_bits
    num_blocks = cdiv(N, plan.block)
    counts = torch.empty(bins * num_blocks, dtype=torch.int32, device=keys.device)
    src_keys, src_perm = keys, perm
    # Ping-pong buffers; the input keys are never written.
    bufs = [(torch.empty_like(keys), perm), (torch.empty_like(keys), torch.empty_like(perm))]
    constexprs = dict(BINS=bins, BLOCK=plan.block)
    for k in range(plan.passes):
        shift = k * plan.radix_bits
        launch(_digit_counts_kernel, (num_blocks,), (src_keys, counts, N, shift, num_blocks), constexprs,
               plan.num_warps)
        # The digit-major inclusive scan: entry (d, p) minus its own count is the first output slot of
        # block p's keys of digit d. int32: the total is N < 2**31.
        scanned = torch.cumsum(counts, 0, dtype=torch.int32)
        dst_keys, dst_perm = bufs[k % 2]
        launch(
            _digit_scatter_kernel,
            (num_blocks,),
            (src_keys, src_perm, counts, scanned, dst_keys, dst_perm, N, shift, num_blocks),
            dict(**constexprs, LOG_BLOCK=plan.block.bit_length() - 1, FIRST=k == 0),
            plan.num_warps,
        )
        src_keys, src_perm = dst_keys, dst_perm
    return src_keys, src_perm
