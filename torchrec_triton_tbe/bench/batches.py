"""Batches from FBGEMM's own request generator, and what that generator really produced.

Both kernels are fed the very same ``TBERequest`` objects. Seeding and call order follow FBGEMM's
``device`` command: ``np.random.seed(42)``, ``torch.manual_seed(42)``, per-table dims (which draw
from NumPy when ``--mixed``), ``generate_requests(num_requests, B, T, L, E, ...)`` with int64
indices and offsets, then ``grad_output = torch.randn(B, sum(Ds))`` on the host.

Two generator facts matter for reading results (fbgemm_gpu 1.6.0 and 1.9.0 sources, identical here):

* Zipf ids (alpha > 1) are drawn with ``torch.ops.fbgemm.zipf_cuda`` when CUDA is available and with
  ``np.random.zipf`` otherwise; each bag keeps its first L *distinct* draws out of 3L (the generator's
  one-E path, which every call here takes; FBGEMM's per-table commands pass 5 for bags of at most 5 ids).
  The drawn ranks then go through a random permutation of the rows, which FBGEMM's commands leave
  unseeded and we seed (below): the same distribution as theirs, on other rows. When some bag
  cannot fill L distinct ids ("too skewed distribution") the generator logs a warning and silently
  falls back to uniform ids for the whole batch. We capture that warning and report it, and we
  measure the run structure the backward actually sees (lookups per (table, row)).
* Uniform ids are sorted within each bag and may repeat inside a bag.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from typing import Any, Iterator

import numpy as np
import torch

from torchrec_triton_tbe.bench.case import PER_TABLE_COMMANDS, BenchCase

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
    grad_output: torch.Tensor  # fixed gradient for the backward passes: [B, sum(Ds)]; VBE 1-D; NONE [N, D]
    stats: dict[str, Any]

    @property
    def batch_size_per_feature_per_rank(self):
        """FBGEMM's VBE argument (one rank, as its vbe command), or None for a fixed batch."""
        case = self.case
        return [[case.batch_size_at(t)] for t in range(case.num_tables)] if case.vbe else None

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


# FBGEMM's Zipf ids go through a random permutation of the rows drawn from an unseeded
# numpy.random.default_rng() unless deterministic_output is set (fbgemm-gpu 1.6.0 and 1.9.0 have it):
# without it every process draws other ids despite the seeds above (found on the H200, where two
# identical cold first steps trained differently), and nothing can be compared across processes.
_REPEATABLE = ({"deterministic_output": True}
               if "deterministic_output" in inspect.signature(generate_requests).parameters else {})


def _generate(case: BenchCase, count: int, B: int, T: int, L: int, E: int, alpha: float, device: torch.device,
              **table_kwargs):
    try:
        return generate_requests(
            count, B, T, L, E, reuse=case.reuse, alpha=alpha, weighted=case.weighted,
            use_cpu=device.type == "cpu", index_dtype=torch.long, offset_dtype=torch.long, **_REPEATABLE,
            **table_kwargs,
        )
    except AssertionError as exc:
        # FBGEMM's generator asserts on what it cannot draw, e.g. Zipf ids for bags larger than the
        # table: with bag-size sigmas the largest drawn bag counts, which no check before drawing knows.
        raise ValueError(f"{case.name}: FBGEMM's request generator refused a table (B={B}, L={L}, E={E}, "
                         f"alpha={alpha}, {table_kwargs or 'fixed bags'}): {exc}") from exc
    except (AttributeError, RuntimeError, NotImplementedError) as exc:
        if alpha > 1.0 and "zipf" in str(exc).lower():
            raise RuntimeError(
                f"{case.name}: FBGEMM's Zipf generator (alpha={alpha}) needs torch.ops.fbgemm.zipf_cuda from "
                f"a CUDA build of fbgemm_gpu when CUDA is available; use alpha <= 1 or install fbgemm-gpu (CUDA)"
            ) from exc
        raise


def _table_kwargs(case: BenchCase, t: int) -> dict[str, Any]:
    """generate_requests' per-table arguments. FBGEMM's device-with-spec and vbe pass sigma_L (None
    unless --bag-size-sigma-list in the first, 0 in the second) and oversample Zipf draws 5x for bags of
    at most 5 ids, 3x (the default) above; the `device` command's per-table lists (ours) keep the default
    and pass sigma_L only when given (each keyword changes the draws, so a case is only comparable with
    its own command's batches)."""
    kwargs: dict[str, Any] = {}
    if case.bag_size_sigma_list is not None:
        kwargs["sigma_L"] = case.bag_size_sigma_at(t)
    if case.command in PER_TABLE_COMMANDS:
        kwargs["zipf_oversample_ratio"] = 3 if case.bag_size_at(t) > 5 else 5
    return kwargs


def _concatenated(per_table: list) -> list:
    """FBGEMM's vbe command: each request's tables laid end to end (offsets shifted, the first of every
    table after the first dropped)."""
    out = []
    for parts in zip(*per_table):
        indices, offsets, weights, shift = [], [], [], 0
        for t, r in enumerate(parts):
            indices.append(r.indices)
            offsets.append(r.offsets[(1 if t else 0):] + shift)
            shift += int(r.offsets[-1])
            if r.per_sample_weights is not None:
                weights.append(r.per_sample_weights)
        out.append(TBERequest(torch.cat(indices), torch.cat(offsets), torch.cat(weights) if weights else None))
    return out


def make_workload(case: BenchCase, device: torch.device) -> Workload:
    np.random.seed(42)
    torch.manual_seed(42)
    Ds = case.table_dims()
    with _fbgemm_warnings() as messages:
        if case.per_table:
            requests = _concatenated([
                _generate(case, case.requests_count, case.batch_size_at(t), 1, case.bag_size_at(t),
                          case.num_embeddings_at(t), case.alpha_at(t), device, **_table_kwargs(case, t))
                for t in range(case.num_tables)
            ])
        else:
            requests = _generate(case, case.requests_count, case.batch_size, case.num_tables, case.bag_size,
                                 case.num_embeddings, case.alpha, device)
    requests = tuple(
        TBERequest(
            r.indices.to(device),
            r.offsets.to(device),
            None if r.per_sample_weights is None else r.per_sample_weights.to(device),
        )
        for r in requests
    )
    if case.pooling == "none":
        grad_output = torch.randn(requests[0].indices.numel(), Ds[0])
    elif case.vbe:
        grad_output = torch.randn(sum(case.batch_size_at(t) * d for t, d in enumerate(Ds)))
    else:
        grad_output = torch.randn(case.batch_size, sum(Ds))
    stats = generator_stats(case, requests[0], messages)
    return Workload(case, tuple(Ds), requests, grad_output.to(device), stats)


def run_lengths(indices: torch.Tensor, offsets: torch.Tensor, bags_per_table, E) -> torch.Tensor:
    """Lookups per distinct (table, row) in one batch: the runs the backward sorts ids into.
    ``bags_per_table``: one B for every table, or a list; ``E``: rows, one for all tables or a list."""
    T = len(bags_per_table)
    starts = torch.tensor([0] + list(np.cumsum(bags_per_table)), device=offsets.device)
    per_table = offsets[starts[1:]] - offsets[starts[:-1]]  # lookups of each table (offsets are feature-major)
    table = torch.repeat_interleave(torch.arange(T, device=indices.device), per_table)
    row_base = torch.tensor([0] + list(np.cumsum(E))[:-1], device=indices.device, dtype=torch.int64)
    linear = row_base[table] + indices.to(torch.int64)
    _, counts = torch.unique(linear, return_counts=True)
    return counts


def generator_stats(case: BenchCase, request: TBERequest, warnings: list[str]) -> dict[str, Any]:
    """Run structure of the first batch, and whether a Zipf request fell back to uniform ids."""
    T = case.num_tables
    counts = run_lengths(request.indices, request.offsets, [case.batch_size_at(t) for t in range(T)],
                         [case.num_embeddings_at(t) for t in range(T)])
    lookups = int(request.indices.numel())
    long_mask = counts >= LONG_RUN
    short_mask = counts < SHORT_RUN
    zipf = any(case.alpha_at(t) > 1.0 for t in range(T))
    fallback = any("falling back to uniform" in m.lower() for m in warnings) if zipf else None
    if not zipf:
        distribution = "uniform"
    elif fallback:
        distribution = "uniform (Zipf fallback)"
    else:
        distribution = f"zipf({case.alpha:g})" if case.alpha_list is None else "zipf(per table)"
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
