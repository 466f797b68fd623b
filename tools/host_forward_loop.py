"""Host issue time of back-to-back training forwards on FBGEMM's default shape (32 tables of 100,000 x 128,
B = 512, bags of 20; fp16 weights with stochastic rounding, bounds check NONE), for whichever tree of
torchrec_triton_tbe is first on PYTHONPATH: the A/B of a host-path change, one fresh process per tree
and run (tools/device_session.sh host-loop alternates them).

    PYTHONPATH=/tmp/site:<tree> python tools/host_forward_loop.py [sgd|rwa]

After 50 warm-up forwards: 15 rounds of 100 forwards with no sync between them (the host runs ahead of
the GPU as in a training loop); per round the wall clock until the last forward returned (host) and until
the GPU finished (total), per forward. Prints one line: the tree, the optimizer, the median and minimum
of both, and the step count afterwards (1,550 where the forward advances it). CUDA only.
"""

import statistics
import sys
import time

import torch

import torchrec_triton_tbe
from torchrec_triton_tbe._fbgemm import BoundsCheckMode, ComputeDevice, EmbeddingLocation, EmbOptimType, SparseType
from torchrec_triton_tbe.module import TritonTBE

T, B, L, E, D = 32, 512, 20, 100000, 128


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("host_forward_loop.py: needs a CUDA device")
    opt = EmbOptimType.EXACT_ROWWISE_ADAGRAD if "rwa" in sys.argv[1:] else EmbOptimType.EXACT_SGD
    m = TritonTBE([(E, D, EmbeddingLocation.DEVICE, ComputeDevice.CUDA)] * T, optimizer=opt,
                  weights_precision=SparseType.FP16, output_dtype=SparseType.FP32,
                  bounds_check_mode=BoundsCheckMode.NONE, device=torch.device("cuda"))
    m.precompile_first_step = False
    idx = torch.randint(0, E, (T * B * L,), device="cuda")
    off = torch.arange(0, T * B * L + 1, L, device="cuda")
    for _ in range(50):
        m(idx, off)
    host, total = [], []
    for _ in range(15):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(100):
            m(idx, off)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e4)  # µs per forward: seconds / 100 forwards * 1e6
        total.append((t2 - t0) * 1e4)
    tree = torchrec_triton_tbe.__file__.split("/torchrec_triton_tbe/")[0]
    print(f"{tree} {opt.name} host {statistics.median(host):.1f} (min {min(host):.1f}) us/fwd, total "
          f"{statistics.median(total):.1f} (min {min(total):.1f}) us/fwd, iter {int(m.iter)}")


if __name__ == "__main__":
    main()
