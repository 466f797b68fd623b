"""Per-stage timing of our forward and backward on the GPU (which stage eats the time).

    python tools/profile_stages.py [--shape uniform|zipf|...] [--json out.json]

Times (median, CUDA events via triton.testing.do_bench) the forward, then each backward stage run
in isolation on the same batch: linearize, sort, run metadata, the short/long update kernels, and the
whole backward, next to FBGEMM's forward and backward on the same batch when fbgemm_gpu has CUDA.
"""

import json

import torch
import triton

from torchrec_triton_tbe._fbgemm import ComputeDevice, EmbeddingLocation
from torchrec_triton_tbe.module import TritonTBE
from torchrec_triton_tbe.ops import backward as bwd_ops
from torchrec_triton_tbe.ops import transpose as tr_ops

from sweep import profile_case  # noqa: E402  (tools/ is on sys.path when this script runs)


def bench(fn, reps=20):
    return triton.testing.do_bench(fn, warmup=3, rep=reps * 5, return_mode="median")


def timed_backward(forward, grad, reps=10):
    """Median ms of ``forward().backward(grad)``'s backward alone (CUDA events), over ``reps`` calls."""
    times = []
    for _ in range(reps):
        out = forward()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        out.backward(grad)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def main():
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    args, s, kw, idx, off, grad = profile_case("uniform", __doc__)
    B, T, E, D = s["B"], s["T"], s["E"], s["D"]
    dev = torch.device("cuda")
    ours = TritonTBE([(E, D)] * T, device=dev, **kw)
    res = {"shape": args.shape, **s, "optimizer": args.optimizer, "lookups": idx.numel()}
    res["fwd"] = bench(lambda: ours(idx, off))
    spec = ours.spec
    res["linearize"] = bench(lambda: tr_ops.linearize(spec, idx, off, B))
    keys, bags, _ = tr_ops.linearize(spec, idx, off, B)
    res["sort"] = bench(lambda: torch.sort(keys, stable=True))
    res["build_runs (incl linearize+sort)"] = bench(lambda: tr_ops.build_runs(spec, idx, off, B))
    runs = tr_ops.build_runs(spec, idx, off, B)
    st = runs.stats()
    res.update({f"stat_{k}": v for k, v in st.items()})
    state = ours.optimizer_tensors()
    res["fused_update"] = bench(lambda: bwd_ops.fused_update(spec, state, runs, grad, off, None, B))
    short_only = spec.config.replace_backward(short_threshold=1 << 30)
    import dataclasses

    spec_short = dataclasses.replace(spec, config=short_only)
    runs_short = tr_ops.build_runs(spec_short, idx, off, B)
    res["fused_update_all_short"] = bench(lambda: bwd_ops.fused_update(spec_short, state, runs_short, grad, off, None, B))
    # Floor of the update: every lookup's gradient row read once, every unique row read + written once.
    gbytes = st["lookups"] * D * 4 + st["runs"] * D * 2 * 2 + st["runs"] * 8 * (args.optimizer == "rowwise")
    res["update_floor_GB"] = gbytes / 1e9
    res["update_GBps"] = gbytes / res["fused_update"] / 1e6
    res["backward_total"] = timed_backward(lambda: ours(idx, off), grad)
    try:
        fb = SplitTableBatchedEmbeddingBagsCodegen(
            [(E, D, EmbeddingLocation.DEVICE, ComputeDevice.CUDA)] * T, device=dev, **kw
        )
        res["fbgemm_fwd"] = bench(lambda: fb(idx, off))
        res["fbgemm_backward"] = timed_backward(lambda: fb(idx, off), grad)
        del fb
    except Exception as e:  # noqa: BLE001 - report and continue: the breakdown is still useful
        res["fbgemm_error"] = repr(e)
    for k, v in res.items():
        print(f"{k:40s} {v:.3f}" if isinstance(v, float) else f"{k:40s} {v}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
