"""The transpose: lookups in batch order -> runs of equal (table, row), with split-K chunk metadata.

No host sync anywhere: every buffer is sized from N = len(indices) (an upper bound on runs) or from
N / chunk + N / threshold + 1 (an upper bound on long-run chunks), and every count that depends on
the data (runs per bucket, chunks per bucket) stays on the device, read by the kernels that need it.
"""

from __future__ import annotations

import dataclasses

import torch

from torchrec_triton_tbe.kernels.transpose import (
    _chunk_offsets_kernel,
    _linearize_kernel,
    _run_chunks_kernel,
    _run_flags_kernel,
    _run_starts_kernel,
    _scan_totals_kernel,
)
from torchrec_triton_tbe.ops import small_table
from torchrec_triton_tbe.ops.launch import cdiv, grid_y_chunks, launch, mean_bag_pow2, next_pow2
from torchrec_triton_tbe.ops.spec import TBESpec


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """One batch's runs. Slots are positions in sorted order; runs index [0, N]."""

    num_lookups: int  # N
    sorted_keys: torch.Tensor  # [N] key_dtype
    perm: torch.Tensor  # [N] int64: original lookup position of each sorted slot
    sorted_bags: torch.Tensor  # [N] int32/int64: (t << bag_shift) | b of each sorted slot
    bag_shift: int  # bits of b in a bag id: B <= 2**bag_shift
    run_start: torch.Tensor  # [N + 1] int32/int64: first slot of run r; N for r >= num_runs
    bucket_run_bounds: torch.Tensor  # [K + 1] (device): bucket k owns runs [b[k], b[k+1])
    threshold: int
    chunk: int
    max_chunks: int  # upper bound of long-run chunks (workspace rows)
    # [N + 1] first chunk of each run (exclusive prefix sum), written up to the run count R (entry R =
    # all chunks); entries past R are unset.
    run_chunk_begin: torch.Tensor
    chunk_run: torch.Tensor  # [max_chunks] run of each live chunk (slots from run_chunk_begin[R] on: unset)
    bucket_chunk_bounds: torch.Tensor  # [K + 1] bucket k owns chunks [b[k], b[k+1])

    def stats(self) -> dict:
        """Run counts for tests and demos. Syncs (reads device counts): never called on the hot path."""
        lens = (self.run_start[1:] - self.run_start[:-1]).to(torch.int64)
        runs = lens > 0
        long = lens >= self.threshold
        num_runs = int(runs.sum())
        return {
            "lookups": self.num_lookups,
            "runs": num_runs,
            "short_runs": int((runs & ~long).sum()),
            "long_runs": int((runs & long).sum()),
            "long_chunks": int(self.run_chunk_begin[num_runs]),  # entry R: every chunk (unset past R)
            "max_run": int(lens.max()) if self.num_lookups else 0,
        }


def _index_dtype(n: int) -> torch.dtype:
    return torch.int32 if n < 2**31 - 1 else torch.int64


def wide_slots(n: int, block: int) -> bool:
    """Whether the metadata passes over N lookups need 64-bit slot indices (kernels/transpose.py
    _block_slots): their programs index up to a block past N + 1."""
    return n + 2 * block >= 2**31 - 1


def bag_code(num_features: int, B: int) -> tuple[int, torch.dtype]:
    """(bag_shift, dtype) of the bag ids (t << bag_shift) | b: the kernels split them with a shift and
    a mask, where t * B + b needed an integer division per lookup on the backward's hot path."""
    shift = max(B - 1, 1).bit_length()
    return shift, torch.int32 if (max(num_features, 1) << shift) <= 2**31 else torch.int64


def linearize(spec: TBESpec, indices: torch.Tensor, offsets: torch.Tensor, B: int, vbe=None):
    """Sort key and bag id of every lookup (lookups outside every bag, and those of the small-table
    features this backward takes on its own path, ops/small_table.py, get the sentinel key), and the
    bag ids' shift (bag_code)."""
    N = indices.numel()
    plan, cfg = spec.plan, spec.config.transpose
    keys = torch.full((N,), plan.sentinel_key, dtype=plan.key_dtype, device=indices.device)
    # Pooled: b < B; sequence (nobag): a lookup's position within its feature, < N.
    bag_shift, bag_dtype = bag_code(plan.num_features, N if spec.nobag else B)
    bags = torch.empty(N, dtype=bag_dtype, device=indices.device)
    if N and B:
        block_bags, step = linearize_tile(cfg.bags_per_program, cfg.lookups_per_step, N, B * plan.num_features)
        small = small_table.backward_applies(spec, vbe, B, N)
        T = plan.num_features
        for t0, features in grid_y_chunks(T):
            launch(
                _linearize_kernel,
                (cdiv(B, block_bags), features),
                (indices, offsets, spec.tensors.feature_key_offset, keys, bags, spec.tensors.feature_small, B,
                 bag_shift, small_table.min_lookups(spec, B) if small else 0, t0),
                dict(BLOCK_BAGS=block_bags, STEP=step, NOBAG=spec.nobag, SMALL=small),
                cfg.num_warps,
            )
    return keys, bags, bag_shift


def linearize_tile(bags_per_program: int, lookups_per_step: int, num_lookups: int, num_bags: int) -> tuple[int, int]:
    """(bags side by side, ids per bag per step) of the linearize kernel: the configured tile, with the
    step cut to the mean bag length's power of two when bags are shorter and the freed columns given
    to more bags (same tile size). With L=1 bags and 16 ids per step, 15 of 16 tile columns were masked
    and each program did 64 lookups: 0.22 ms for 4.2 M lookups on the H200, latency-bound. Knob, not
    result: every lookup gets the same key and bag id whatever the tiling."""
    step = min(lookups_per_step, mean_bag_pow2(num_lookups, num_bags))
    return bags_per_program * (lookups_per_step // step), step


def build_runs(spec: TBESpec, indices: torch.Tensor, offsets: torch.Tensor, B: int, vbe=None) -> RunPlan:
    """The runs of this call's lookups. ``vbe``: the call's VBELayout (None: fixed batch); with it, or
    any other call the small-table path does not take, every lookup gets its key."""
    N = indices.numel()
    device = indices.device
    bcfg, tcfg = spec.config.backward, spec.config.transpose
    keys, bags, bag_shift = linearize(spec, indices, offsets, B, vbe)
    # Stable sort: equal keys keep batch order, so each run is reduced in the same order every time.
    sorted_keys, perm = torch.sort(keys, stable=True)
    idt = _index_dtype(N + 1)
    threshold, chunk = bcfg.short_threshold, bcfg.long_chunk
    # Each long run has >= threshold lookups and cdiv(L, chunk) <= L / chunk + 1 chunks.
    max_chunks = N // chunk + N // threshold + 1
    bounds = spec.tensors.bucket_key_bounds
    num_bounds = bounds.numel()
    run_block = tcfg.run_block
    programs = cdiv(N + 1, run_block)  # one block of slots (or runs 0..N) each
    # Small batches are launch-bound (the host issues ops slower than the GPU runs them): the tables
    # below take six Triton launches with nothing but allocations between them.
    sorted_bags = torch.empty_like(bags)
    run_start = torch.empty(N + 1, dtype=idt, device=device)
    bucket_run_bounds = torch.empty(num_bounds, dtype=idt, device=device)
    run_chunk_begin = torch.empty(N + 1, dtype=idt, device=device)
    chunk_run = torch.empty(max_chunks, dtype=idt, device=device)
    bucket_chunk_bounds = torch.empty(num_bounds, dtype=idt, device=device)
    # Per program: runs (row 0) and chunks (row 1), scanned in place; the last column holds the sums.
    # Rows padded to 16 bytes: row 1's address would otherwise be 16-byte aligned or not with the batch's
    # program count, and Triton compiles each kernel reading it once per alignment (three kernels).
    per16 = 16 // idt.itemsize
    row = cdiv(programs + 1, per16) * per16
    totals = torch.empty(2, row, dtype=idt, device=device)
    run_totals, chunk_totals = totals[0, : programs + 1], totals[1, : programs + 1]
    block_k = next_pow2(num_bounds)
    grid = (programs,)
    blocks = dict(BLOCK=run_block, WIDE=wide_slots(N, run_block))  # implied by int64 tables (N >= 2**31 - 2)
    launch(_run_flags_kernel, grid, (sorted_keys, perm, bags, sorted_bags, run_totals, N, spec.plan.sentinel_key),
           blocks, 4)
    launch(_scan_totals_kernel, (1,), (run_totals, programs), dict(BLOCK=tcfg.scan_block), tcfg.scan_warps)
    launch(
        _run_starts_kernel,
        grid,
        (sorted_keys, run_totals, bounds, run_start, bucket_run_bounds, N, programs, num_bounds),
        dict(**blocks, BLOCK_K=block_k),
        4,
    )
    launch(_run_chunks_kernel, grid, (run_start, run_totals, chunk_totals, programs, threshold, chunk), blocks, 4)
    launch(_scan_totals_kernel, (1,), (chunk_totals, programs), dict(BLOCK=tcfg.scan_block), tcfg.scan_warps)
    launch(
        _chunk_offsets_kernel,
        grid,
        (run_start, run_totals, chunk_totals, bucket_run_bounds, run_chunk_begin, bucket_chunk_bounds, chunk_run,
         programs, threshold, chunk, num_bounds),
        dict(**blocks, BLOCK_K=block_k, SEARCH_STEPS=(run_block - 1).bit_length()),
        4,
    )
    return RunPlan(
        num_lookups=N,
        sorted_keys=sorted_keys,
        perm=perm,
        sorted_bags=sorted_bags,
        bag_shift=bag_shift,
        run_start=run_start,
        bucket_run_bounds=bucket_run_bounds,
        threshold=threshold,
        chunk=chunk,
        max_chunks=max_chunks,
        run_chunk_begin=run_chunk_begin,
        chunk_run=chunk_run,
        bucket_chunk_bounds=bucket_chunk_bounds,
    )
