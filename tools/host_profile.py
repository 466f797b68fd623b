"""Where the host time of a forward / backward goes on launch-bound shapes (FBGEMM's default shape).

    python tools/host_profile.py [--shape default] [--optimizer rowwise] [--json out.json]
    python tools/host_profile.py --suite-shape prod_t40_b16k --batch-size 8192 [--kernel-config F]

``--suite-shape`` takes a shape of configs/suites/h200.yaml instead (the bench's batches and modules:
per-table rows, dims and bag sizes), at its batch or ``--batch-size``.

On a shape whose GPU work is shorter than the time the host needs to issue it, an event-timed
backward measures the host: the GPU idles between launches. This prints, for ours and FBGEMM's TBE on
the same batch: the host issue time of one call (wall clock around the call, no sync inside), the
event-timed median, the GPU time of the kernels it launched (torch.profiler), and a cProfile top list
of our host-side Python.
"""

import cProfile
import io
import json
import pstats
import time

import torch

from torchrec_triton_tbe._fbgemm import ComputeDevice, EmbeddingLocation
from torchrec_triton_tbe.module import TritonTBE

from sweep import profile_case  # noqa: E402  (tools/ is on sys.path when this script runs)


def host_and_event_ms(fn, prep=None, reps=50):
    """Median host issue time and median event time of fn (prep runs untimed before each call)."""
    host, ev = [], []
    for _ in range(reps):
        if prep is not None:
            prep()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        e.record()
        torch.cuda.synchronize()
        host.append((t1 - t0) * 1e3)
        ev.append(s.elapsed_time(e))
    host.sort()
    ev.sort()
    return host[len(host) // 2], ev[len(ev) // 2]


def gpu_kernels(fn, prep=None):
    """Kernels launched by fn and their summed GPU time (ms), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    if prep is not None:
        prep()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        dev_us = getattr(ev, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(ev, "self_cuda_time_total", 0)
        if dev_us > 0:
            rows.append((ev.key[:60], ev.count, dev_us / 1e3))
    rows.sort(key=lambda r: -r[2])
    cpu_ops = sorted(
        ((ev.key[:60], ev.count, ev.self_cpu_time_total / 1e3) for ev in prof.key_averages()), key=lambda r: -r[2]
    )
    return rows, cpu_ops


def _suite_options(ap) -> None:
    ap.add_argument("--suite-shape", help="a shape of --suite instead of --shape")
    ap.add_argument("--suite", default="h200", help="with --suite-shape: a suite of configs/suites/")
    ap.add_argument("--batch-size", type=int, help="with --suite-shape: this batch instead of the shape's")
    ap.add_argument("--kernel-config", help="with --suite-shape: our kernel config (YAML path)")


def suite_case(args, dev) -> tuple:
    """(modules, description, ids, offsets, gradient) of a suite shape, as bench.cli builds them."""
    from torchrec_triton_tbe.bench.batches import make_workload
    from torchrec_triton_tbe.bench.case import load_suite
    from torchrec_triton_tbe.bench.runner import RunOptions, build_modules

    overrides = {} if args.batch_size is None else {"batch_size": args.batch_size}
    shapes = {s.case.name: s.case for s in load_suite(args.suite, overrides)[1]}
    case = shapes[args.suite_shape]
    w = make_workload(case, dev)
    opt = "exact_rowwise_adagrad" if args.optimizer == "rowwise" else "exact_sgd"
    modules = build_modules(w, opt, RunOptions(dev, compare=("fbgemm",), kernel_config=args.kernel_config))
    r = w.requests[0]
    desc = {"suite_shape": case.name, "B": case.batch_size, "T": case.num_tables, "Ds": list(w.Ds)}
    return dict(modules), desc, r.indices, r.offsets, w.grad_output


def main():
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    args, s, kw, idx, off, grad = profile_case("default", __doc__, _suite_options)
    dev = torch.device("cuda")
    if args.suite_shape:
        modules, s, idx, off, grad = suite_case(args, dev)
    else:
        T, E, D = s["T"], s["E"], s["D"]
        modules = {
            "triton": TritonTBE([(E, D)] * T, device=dev, **kw),
            "fbgemm": SplitTableBatchedEmbeddingBagsCodegen(
                [(E, D, EmbeddingLocation.DEVICE, ComputeDevice.CUDA)] * T, **kw
            ),
        }
    res = {"shape": args.suite_shape or args.shape, **s, "optimizer": args.optimizer, "lookups": idx.numel()}
    for name, m in modules.items():
        holder = {}

        def fwd(m=m):
            return m(idx, off)

        def prep(m=m):
            holder["out"] = m(idx, off)

        def bwd():
            holder["out"].backward(grad)

        for _ in range(5):
            prep()
            bwd()
        fh, fe = host_and_event_ms(fwd)
        bh, be = host_and_event_ms(bwd, prep)
        fk, fcpu = gpu_kernels(fwd)
        bk, bcpu = gpu_kernels(bwd, prep)
        res[name] = {
            "fwd_host_ms": fh, "fwd_event_ms": fe, "fwd_gpu_ms": sum(r[2] for r in fk), "fwd_kernels": fk,
            "bwd_host_ms": bh, "bwd_event_ms": be, "bwd_gpu_ms": sum(r[2] for r in bk), "bwd_kernels": bk,
            "bwd_cpu_ops": bcpu[:25], "fwd_cpu_ops": fcpu[:15],
        }
        print(f"{name}: fwd host {fh:.3f} event {fe:.3f} gpu {res[name]['fwd_gpu_ms']:.3f} ms ({len(fk)} kernels); "
              f"bwd host {bh:.3f} event {be:.3f} gpu {res[name]['bwd_gpu_ms']:.3f} ms ({len(bk)} kernels)")
        print("  fwd kernels: " + "; ".join(f"{k} x{c} {t * 1e3:.0f}us" for k, c, t in fk[:10]))
        print("  fwd cpu ops: " + "; ".join(f"{k} x{c} {t * 1e3:.0f}us" for k, c, t in fcpu[:10]))
        print("  bwd kernels: " + "; ".join(f"{k} x{c} {t * 1e3:.0f}us" for k, c, t in bk[:14]))
        print("  bwd cpu ops: " + "; ".join(f"{k} x{c} {t * 1e3:.0f}us" for k, c, t in bcpu[:14]))

    m = modules["triton"]
    for _ in range(3):
        out = m(idx, off)
        out.backward(grad)
    torch.cuda.synchronize()

    def forwards():
        for _ in range(50):
            m(idx, off)

    def steps():
        for _ in range(50):
            m(idx, off).backward(grad)

    for label, fn in (("fwd", forwards), ("fwd+bwd", steps)):
        prof = cProfile.Profile()
        prof.enable()
        fn()
        prof.disable()
        torch.cuda.synchronize()
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(28)
            text = buf.getvalue()
            res[f"cprofile_{label}_{key}"] = text
            print(f"== cProfile by {key} (50 {label})")
            print("\n".join(line[:150] for line in text.splitlines()[6:30]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
