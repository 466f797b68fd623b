"""What the GPU test scripts share: the device, the mixed-width table layout (BLOCK_D 64, 128 and 256
buckets, one width not a power of two, a table shared by two features), skewed batches, a module pair
(ours and FBGEMM's CUDA TBE with the same initial weights) and a no-host-sync guard."""

import contextlib

import torch

from torchrec_triton_tbe._fbgemm import ComputeDevice, EmbeddingLocation, SparseType
from torchrec_triton_tbe.module import TritonTBE

DEV = torch.device("cuda")
SPECS = [(20_000, 128), (5_000, 64), (3_000, 72), (50, 256)]
FTM = [0, 1, 1, 2, 3]
B, L = 512, 12
TOL = {SparseType.FP32: dict(atol=1e-4, rtol=1e-4), SparseType.FP16: dict(atol=1e-2, rtol=2e-2)}


def batch(seed, weighted=False, index_dtype=torch.int64, nb=B, psw_grad=False, skew=4):
    """nb bags per feature of 0..2L-1 ids; ids u**skew * rows (a heavy head: long runs beside short ones)."""
    g = torch.Generator().manual_seed(seed)
    T = len(FTM)
    lengths = torch.randint(0, 2 * L, (T * nb,), generator=g)
    offsets = torch.zeros(T * nb + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    ids = []
    for t, k in enumerate(FTM):
        n = int(lengths[t * nb : (t + 1) * nb].sum())
        u = torch.rand(n, generator=g)
        ids.append((SPECS[k][0] * u**skew).long().clamp(max=SPECS[k][0] - 1))
    idx = torch.cat(ids)
    psw = torch.rand(idx.numel(), generator=g).to(DEV) if weighted else None
    if psw is not None and psw_grad:
        psw.requires_grad_(True)
    return idx.to(DEV, index_dtype), offsets.to(DEV, index_dtype), psw


def pair(specs=SPECS, ftm=FTM, kernel_config=None, init=0.5, **kw):
    """(ours, FBGEMM's CUDA TBE) on the same tables and keywords, weights uniform in [-init, init]
    (ours drawn, FBGEMM's copied); ``kernel_config`` is ours only."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    ours = TritonTBE(specs, feature_table_map=ftm, device=DEV, kernel_config=kernel_config, **kw)
    fb = SplitTableBatchedEmbeddingBagsCodegen(
        [(r, d, EmbeddingLocation.DEVICE, ComputeDevice.CUDA) for r, d in specs], feature_table_map=ftm, device=DEV, **kw
    )
    ours.init_embedding_weights_uniform(-init, init)
    for a, b in zip(ours.split_embedding_weights(), fb.split_embedding_weights()):
        b.copy_(a)
    return ours, fb


@contextlib.contextmanager
def no_host_sync(on: bool = True):
    """With ``on``: any host sync inside raises (torch.cuda.set_sync_debug_mode("error"), after a
    synchronize so that earlier work does not count)."""
    if not on:
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
