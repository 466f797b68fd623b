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
# Rounding flips: our per-row gradient sums and FBGEMM's add the same terms in another order, so their last
# fp32 bits may differ, and a value next to a rounding boundary of its storage type (fp16 weights, bf16
# moments) then rounds to the neighbouring value. A bag's output sums up to 2L - 1 copies of a row, so one
# flipped weight element moves an output element by up to that many ulps. Such comparisons hold the tight
# tolerance on all but FLIP_FRACTION of the elements, and those within a bound derived from the flip.
FLIP_FRACTION = 0.01


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


def seeded_grad(out, seed):
    """The output gradient of one step, the same in every run (a failure can be run again)."""
    return torch.randn(out.shape, generator=torch.Generator(out.device).manual_seed(seed), device=out.device)


def assert_close_up_to_flips(a, b, weights, bound, what, why):
    """Within TOL[weights] except on at most FLIP_FRACTION of the elements, and those within ``bound``."""
    a, b, tol = a.float(), b.float(), TOL[weights]
    off = (a - b).abs() > tol["atol"] + tol["rtol"] * b.abs()
    assert off.float().mean().item() <= FLIP_FRACTION, f"{what}: {int(off.sum())} of {off.numel()} outside {tol}"
    torch.testing.assert_close(a, b, atol=bound, rtol=tol["rtol"], msg=lambda m: f"{what} ({why}): {m}")


def fp16_flip_bound(module, steps, copies=2 * L - 1):
    """How far ``steps`` updates of fp16 weights, each of which may round one ulp (at most 2**-10 of the
    largest weight) the other way than FBGEMM's, can move a pooled output of ``copies`` rows."""
    wmax = max(float(w.float().abs().max()) for w in module.split_embedding_weights() if w.numel())
    return TOL[SparseType.FP16]["atol"] + steps * copies * 2.0**-10 * wmax
