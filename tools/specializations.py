"""Which kernel specializations later batches of one module add to its first batch's: Triton compiles a
kernel again for every new combination of argument dtypes, int divisibility by 16 (or == 1) and
pointer alignment, so a batch adding specializations stalls on compiles mid-training (after a
precompiled first step, too). Runs on a CPU: the module on CPU tensors, launches recorded
(torchrec_triton_tbe.aot.recording), nothing compiled.

    TRITON_INTERPRET=0 python tools/specializations.py [--json out.json]

The module: four tables (1,000 x 16, 500 x 64, 3,000 x 128, 100 x 8), fp16, row-wise Adagrad; the
batches: B = 512 with random bag lengths (mean 8) and 0-3 extra ids, then B = 500 and B = 1,024.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("specializations: run with TRITON_INTERPRET=0 (launches are recorded, not interpreted)", file=sys.stderr)
        return 2
    os.environ["TRITON_INTERPRET"] = "0"
    import torch

    from torchrec_triton_tbe import aot
    from torchrec_triton_tbe._fbgemm import EmbOptimType, SparseType
    from torchrec_triton_tbe.module import TritonTBE

    specs = [(1000, 16), (500, 64), (3000, 128), (100, 8)]
    T = len(specs)
    with aot.recording():
        module = TritonTBE(specs, kernel_config="sm90", optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, device="cpu",
                           weights_precision=SparseType.FP16)
    batches = []
    for B, extra in ((512, 0), (512, 1), (512, 2), (512, 3), (500, 0), (1024, 5)):
        g = torch.Generator().manual_seed(B * 7 + extra)
        lengths = torch.randint(0, 16, (T * B,), generator=g)
        lengths[0] += extra
        offsets = torch.zeros(T * B + 1, dtype=torch.int64)
        offsets[1:] = lengths.cumsum(0)
        indices = torch.cat([torch.randint(0, specs[t][0], (int(lengths[t * B:(t + 1) * B].sum()),), generator=g)
                             for t in range(T)])
        with aot.recording() as seen:
            out = module(indices, offsets)
            out.backward(torch.ones_like(out))
        batches.append((B, int(indices.numel()), set(seen)))
    first = batches[0][2]
    rows = [{"B": B, "lookups": n, "lookups_mod_16": n % 16, "specializations": len(s),
             "new_kernels": sorted({k[0] for k in s - first}), "new": len(s - first)} for B, n, s in batches]
    result = {"first_batch": len(first), "distinct": len(set().union(*(s for *_, s in batches))), "batches": rows}
    print(f"first batch: {result['first_batch']} specializations; distinct over {len(rows)} batches: {result['distinct']}")
    for r in rows[1:]:
        print(f"  B={r['B']} lookups={r['lookups']} (mod 16: {r['lookups_mod_16']:2d}): {r['new']:2d} new "
              f"{', '.join(r['new_kernels'])}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
