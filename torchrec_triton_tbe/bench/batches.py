"""Batches from FBGEMM's own request generator, and what that generator really produced.

Both kernels are fed the very same ``TBERequest`` objects. Seeding and call order follow FBGEMM's
``device`` command: ``np.random.seed(42)``, ``torch.manual_seed(42)``, per-table dims (which draw
from NumPy when ``--mixed``), ``generate_requests(num_requests, B, T, L, E, ...)`` with int64
indices and offsets, then ``grad_output = torch.randn(B, sum(Ds))`` on the host.

Two generator facts matter for reading results (fbgemm_gpu 1.6.0 and 1.9.0 sources, identical here):

* Zipf ids (alpha > 1) are drawn with ``torch.ops.fbgemm.zipf_cuda`` when CUDA is available and with
  ``np.random.zipf`` otherwise; each bag keeps its first L *distinct* draws out of 3L. When some bag
  cannot fill L distinct ids ("too skewed distribution") the generator logs a warning and silently
  falls back to uniform ids for the whole batch. We capture that warning and report it, and we
  measure the run structure the backward actually sees (lookups per (table, row)).
* Uniform ids are sorted within each bag and may repeat inside a bag.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Iterator

import numpy as np
import torch

from torchrec_triton_tbe.bench.case import BenchCase

try:  # fbgemm_gpu >= 0.8 (checked: 1.6.0 and 1.9.0 both export it here)
    from fbgemm_gpu.tbe.utils import TBERequest, generate_requests
except ImportError as exc:  # pragma: no cover - depends on the installed fbgemm_gpu
    raise ImportError(
        "torchrec_triton_tbe.bench needs fbgemm_gpu's request generator (fbgemm_gpu.tbe.utils.generate_requests, "
        "fbgemm_gpu >= 1.6)"
    ) from exc

LONG_RUN = 256  # "hot" runs: lookups of one row in one batch, at or above FBGEMM's / our long-run threshold
SHORT_RUN = 4  # "short" runs: below this many lookups


@dataclasses.dataclass(frozen=True)
class Workload:
    """One case's inputs, shared by every kernel and optimizer measured on it."""

    case: BenchCase
    Ds: tuple[int, ...]
    requests: tuple[TBERequest, ...]
    grad_output: torch.Tensor  # fixed [B, sum(Ds)] gradient for the backward passes
    stats: dict[str, Any]

    @property
    def D_logged(self):
        """The D FBGEMM prints: the table width, or the average width for mixed tables."""
        return float(np.average(self.Ds)) if len(set(self.Ds)) > 1 else self.Ds[0]


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _fbgemm_warnings() -> Iterator[list[str]]:
    """FBGEMM's generator reports its uniform fallback only through ``logging.warning`` (root logger)."""
    handler = _Collect()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler.messages
    finally:
        root.removeHandler(handler)


def make_workload(case: BenchCase, device: torch.device) -> Workload:
    np.random.seed(42)
    torch.manual_seed(42)
    Ds = case.table_dims()
    try:
        with _fbgemm_warnings() as messages:
            requests = generate_requests(
                case.requests_count,
                case.batch_size,
                case.num_tables,
                case.bag_size,
                case.num_embeddings,
                reuse=case.reuse,
                alpha=case.alpha,
                weighted=case.weighted,
                use_cpu=device.type == "cpu",
                index_dtype=torch.long,
                offset_dtype=torch.long,
            )
    except (AttributeError, RuntimeError, NotImplementedError) as exc:
        if case.alpha > 1.0 and "zipf" in str(exc).lower():
            raise RuntimeError(
                f"{case.name}: FBGEMM's Zipf generator (alpha={case.alpha}) needs torch.ops.fbgemm.zipf_cuda from "
                f"a CUDA build of fbgemm_gpu when CUDA is available; use alpha <= 1 or install fbgemm-gpu (CUDA)"
            ) from exc
        raise
    requests = tuple(
        TBERequest(
            r.indices.to(device),
            r.offsets.to(device),
            None if r.per_sample_weights is None else r.per_sample_weights.to(device),
        )
        for r in requests
    )
    grad_output = torch.randn(case.batch_size, sum(Ds)).to(device)
    stats = generator_stats(case, requests[0], messages)
    return Workload(case, tuple(Ds), requests, grad_output, stats)


def run_lengths(indices: torch.Tensor, offsets: torch.Tensor, B: int, T: int, E: int) -> torch.Tensor:
    """Lookups per distinct (table, row) in one batch: the runs the backward sorts ids into."""
    per_table = offsets[B :: B] - offsets[: -1 : B]  # lookups of each table (offsets are feature-major)
    table = torch.repeat_interleave(torch.arange(T, device=indices.device), per_table)
    linear = table.to(torch.int64) * E + indices.to(torch.int64)
    _, counts = torch.unique(linear, return_counts=True)
    return counts


def generator_stats(case: BenchCase, request: TBERequest, warnings: list[str]) -> dict[str, Any]:
    """Run structure of the first batch, and whether a Zipf request fell back to uniform ids."""
    counts = run_lengths(request.indices, request.offsets, case.batch_size, case.num_tables, case.num_embeddings)
    lookups = int(request.indices.numel())
    long_mask = counts >= LONG_RUN
    short_mask = counts < SHORT_RUN
    fallback = any("falling back to uniform" in m.lower() for m in warnings) if case.alpha > 1.0 else None
    if case.alpha <= 1.0:
        distribution = "uniform"
    else:
        distribution = "uniform (Zipf fallback)" if fallback else f"zipf({case.alpha:g})"
    runs = int(counts.numel())
    return {
        "of_batch": 0,
        "distribution": distribution,
        "zipf_fallback_to_uniform": fallback,
        "generator_warnings": list(warnings),
        "lookups": lookups,
        "unique_rows": runs,  # = runs: distinct (table, row) pairs
        "mean_run_length": lookups / runs if runs else 0.0,
        "max_run_length": int(counts.max()) if runs else 0,
        f"runs_ge_{LONG_RUN}": int(long_mask.sum()),
        f"lookups_in_runs_ge_{LONG_RUN}_frac": float(counts[long_mask].sum()) / lookups if lookups else 0.0,
        f"runs_lt_{SHORT_RUN}_frac": float(short_mask.sum()) / runs if runs else 0.0,
        f"lookups_in_runs_lt_{SHORT_RUN}_frac": float(counts[short_mask].sum()) / lookups if lookups else 0.0,
    }
