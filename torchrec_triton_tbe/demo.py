"""Side-by-side demo: TritonTBE against FBGEMM's TBE with identical weights, trained on skewed batches.

    python -m torchrec_triton_tbe.demo [--steps 4] [--batch-size 16] ...

On a CPU machine both run on the CPU (our kernels under Triton's interpreter, FBGEMM's CPU TBE);
with a GPU both run there (FBGEMM's CUDA TBE) at a larger default size. Prints, per step, the
largest difference of outputs, weights and optimizer state (``--optimizer``, row-wise Adagrad by
default), and how the backward routed the
batch's runs (short = one program per row, long = split-K chunks).
"""

from __future__ import annotations

import argparse
import logging
import math
import time

import torch

from torchrec_triton_tbe import _env
from torchrec_triton_tbe._fbgemm import ComputeDevice, EmbeddingLocation, EmbOptimType, PoolingMode, SparseType
from torchrec_triton_tbe.module import TritonTBE


def skewed_ids(rows: int, n: int, alpha: float, generator: torch.Generator) -> torch.Tensor:
    """Zipf-like ids: rank r drawn with probability ~ r^-alpha (inverse-CDF of a continuous power
    law), then ranks scattered over the table by a fixed permutation so hot rows are not all row 0."""
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    ranks = ((1 - u) ** (-1.0 / (alpha - 1.0)) - 1.0).clamp(max=rows - 1).long()
    perm = torch.randperm(rows, generator=generator)
    return perm[ranks]


def make_batch(T: int, B: int, L: int, rows: int, alpha: float, generator: torch.Generator):
    lengths = torch.randint(0, 2 * L + 1, (T * B,), generator=generator)
    offsets = torch.zeros(T * B + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    indices = skewed_ids(rows, int(offsets[-1]), alpha, generator)
    return indices, offsets


# --optimizer names (the A/B demos'); every optimizer TritonTBE implements.
OPTIMIZERS = {
    "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    "sgd": EmbOptimType.EXACT_SGD,
    "adagrad": EmbOptimType.EXACT_ADAGRAD,
    "adam": EmbOptimType.ADAM,
    "partial_rowwise_adam": EmbOptimType.PARTIAL_ROWWISE_ADAM,
    "lamb": EmbOptimType.LAMB,
    "partial_rowwise_lamb": EmbOptimType.PARTIAL_ROWWISE_LAMB,
    "lars_sgd": EmbOptimType.LARS_SGD,
}
# FBGEMM's CPU TBE (the FBGEMM side on a machine without CUDA) implements only these.
CPU_FUSED_OPTIMIZERS = ("rowwise_adagrad", "sgd", "adagrad")


def _max_abs_diff(pairs) -> float:
    """The largest |a - b| over the pairs, NaN if any difference is NaN (Python's max() keeps or drops a
    NaN by argument order, so a run gone NaN could print a finite difference)."""
    worst = 0.0
    for a, b in pairs:
        if a.numel():
            d = (a.double() - b.double()).abs()
            worst = math.nan if (d.isnan().any() or math.isnan(worst)) else max(worst, float(d.max()))
    return worst


def main(argv=None) -> int:
    gpu = torch.cuda.is_available() and not _env.interpreting()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=4096 if gpu else 16)
    ap.add_argument("--num-tables", type=int, default=8 if gpu else 3)
    ap.add_argument("--num-embeddings", type=int, default=100_000 if gpu else 60)
    ap.add_argument("--embedding-dim", type=int, default=128 if gpu else 16)
    ap.add_argument("--bag-size", type=int, default=20 if gpu else 4)
    ap.add_argument("--alpha", type=float, default=1.15, help="Zipf exponent of the ids (> 1)")
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="rowwise_adagrad")
    ap.add_argument("--learning-rate", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not gpu and args.optimizer not in CPU_FUSED_OPTIMIZERS:
        raise SystemExit(f"--optimizer {args.optimizer}: FBGEMM's CPU TBE implements only "
                         f"{', '.join(CPU_FUSED_OPTIMIZERS)}; run it on a GPU")
    logging.getLogger("fbgemm_gpu").setLevel(logging.ERROR)
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    device = torch.device("cuda" if gpu else "cpu")
    T, B = args.num_tables, args.batch_size
    # Mixed widths (two D buckets) and one table shared by two features.
    dims = [args.embedding_dim if t % 2 == 0 else max(4, args.embedding_dim // 2) for t in range(T)]
    specs = [(args.num_embeddings, d) for d in dims]
    feature_table_map = sorted(list(range(T)) + [T - 1])
    common = dict(
        feature_table_map=feature_table_map,
        optimizer=OPTIMIZERS[args.optimizer],
        learning_rate=args.learning_rate,
        eps=1e-3,
        pooling_mode=PoolingMode.SUM,
        weights_precision=SparseType.FP32,
        output_dtype=SparseType.FP32,
    )
    ours = TritonTBE(specs, device=device, **common)
    loc = (EmbeddingLocation.DEVICE, ComputeDevice.CUDA) if gpu else (EmbeddingLocation.HOST, ComputeDevice.CPU)
    fbgemm = SplitTableBatchedEmbeddingBagsCodegen([(r, d, *loc) for r, d in specs], device=device, **common)
    ours.init_embedding_weights_uniform(-0.1, 0.1)
    for a, b in zip(ours.split_embedding_weights(), fbgemm.split_embedding_weights()):
        b.copy_(a)
    ours.collect_backward_stats = True

    where = "GPU (compiled Triton vs FBGEMM CUDA)" if gpu else "CPU (Triton interpreter vs FBGEMM CPU)"
    print(f"TritonTBE vs FBGEMM SplitTableBatchedEmbeddingBagsCodegen on {where}")
    print(f"features={len(feature_table_map)} tables={T} dims={dims} rows={args.num_embeddings} B={B} "
          f"mean L={args.bag_size} alpha={args.alpha} {args.optimizer} lr={args.learning_rate}")
    head = (f"{'step':>4} {'lookups':>8} {'max|dOut|':>10} {'max|dW|':>10} {'max|dState|':>11} "
            f"{'runs':>6} {'short':>6} {'long':>5} {'chunks':>6} {'ms ours':>8} {'ms fbgemm':>9}")
    print(head)
    print("-" * len(head))
    g = torch.Generator().manual_seed(args.seed)
    for step in range(args.steps):
        indices, offsets = make_batch(len(feature_table_map), B, args.bag_size, args.num_embeddings, args.alpha, g)
        indices, offsets = indices.to(device), offsets.to(device)
        grad = torch.randn(B, sum(dims[k] for k in feature_table_map), generator=g).to(device)
        times = []
        outs = []
        for module in (ours, fbgemm):
            t0 = time.perf_counter()
            out = module(indices.clone(), offsets.clone())
            out.backward(grad)
            if gpu:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
            outs.append(out.detach())
        d_out = _max_abs_diff([(outs[0], outs[1])])
        d_w = _max_abs_diff(zip(ours.split_embedding_weights(), fbgemm.split_embedding_weights()))
        d_m = _max_abs_diff((a.float(), b.float()) for mine, theirs in
                            zip(ours.split_optimizer_states(), fbgemm.split_optimizer_states())
                            for a, b in zip(mine, theirs))
        s = ours.backward_stats()
        print(f"{step:>4} {s['lookups']:>8} {d_out:>10.2e} {d_w:>10.2e} {d_m:>11.2e} {s['runs']:>6} "
              f"{s['short_runs']:>6} {s['long_runs']:>5} {s['long_chunks']:>6} {times[0]:>8.1f} {times[1]:>9.1f}")
    if not gpu:
        print("(CPU times measure Triton's interpreter, not kernels)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
