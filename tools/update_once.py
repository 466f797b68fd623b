"""Run the backward's fused update on one batch a few times, and nothing else: a target for a kernel
profiler on the device, e.g.

    ncu --clock-control none -k regex:_backward_short --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python tools/update_once.py --shape uniform --tables 8

(the first call compiles; profile a later one). Shapes as tools/sweep.py; --tables overrides T so the
profiler's save/restore of the weights stays small. Stochastic rounding off, as in the suite.
"""

import argparse

import torch

from torchrec_triton_tbe._fbgemm import BoundsCheckMode, EmbOptimType, SparseType
from torchrec_triton_tbe.module import TritonTBE
from torchrec_triton_tbe.ops import backward as bwd_ops
from torchrec_triton_tbe.ops import transpose as tr_ops

from sweep import SHAPES  # noqa: E402  (tools/ is on sys.path when this script runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="uniform", choices=sorted(SHAPES))
    ap.add_argument("--tables", type=int)
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()
    from fbgemm_gpu.tbe.utils import generate_requests

    s = dict(SHAPES[args.shape])
    if args.tables:
        s["T"] = args.tables
    B, T, E, D, L = s["B"], s["T"], s["E"], s["D"], s["L"]
    dev = torch.device("cuda")
    m = TritonTBE([(E, D)] * T, device=dev, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                  weights_precision=SparseType.FP16, bounds_check_mode=BoundsCheckMode.NONE,
                  stochastic_rounding=False)
    req = generate_requests(1, B, T, L, E, alpha=s["alpha"])[0]
    idx, off = req.indices.to(dev), req.offsets.to(dev)
    grad = torch.randn(B, T * D, device=dev)
    state = m.optimizer_tensors()
    spec = m.spec
    runs = tr_ops.build_runs(spec, idx, off, B)
    print({k: v for k, v in runs.stats().items()})
    for _ in range(args.calls):
        bwd_ops.fused_update(spec, state, runs, grad, off, None, B)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
