"""ops/transpose.py: the run plan against a plain PyTorch derivation of the same tables (sort keys,
bag ids, run starts, split-K chunks), and the bag-id encoding's width choice."""

import pytest
import torch
import triton
import triton.language as tl

from tbe_cases import make_pair, skewed_batch
from torchrec_triton_tbe.kernels.grad_gather import split_bag
from torchrec_triton_tbe.config import load_named
from torchrec_triton_tbe.ops import transpose as tr_ops

SPECS = [(30, 8), (20, 12)]
FTM = [0, 1, 1]


@pytest.mark.parametrize(
    "num_features,B,shift,dtype",
    [
        (1, 1, 1, torch.int32),
        (3, 2, 1, torch.int32),
        (3, 3, 2, torch.int32),
        (32, 512, 9, torch.int32),
        (32, 513, 10, torch.int32),
        (2**15, 2**16, 16, torch.int32),  # (t << 16) | b fills 31 bits exactly
        (2**15 + 1, 2**16, 16, torch.int64),
    ],
)
def test_bag_code_width(num_features, B, shift, dtype):
    assert tr_ops.bag_code(num_features, B) == (shift, dtype)
    # Every (t, b) fits and decodes: b in the low `shift` bits, t above them.
    s, _ = tr_ops.bag_code(num_features, B)
    assert B - 1 < 2**s and ((num_features - 1) << s | (B - 1)) < (2**31 if dtype == torch.int32 else 2**63)


@pytest.mark.parametrize("threshold,chunk,wide", [(1, 1, False), (3, 2, False), (4, 3, True), (10**9, 4, False)])
def test_run_plan_matches_a_torch_derivation(threshold, chunk, wide, monkeypatch):
    if wide:  # the 64-bit slot indices of batches past 2**31 lookups, on a small one
        monkeypatch.setattr(tr_ops, "wide_slots", lambda n, block: True)
    cfg = load_named("interpreter").replace_backward(short_threshold=threshold, long_chunk=chunk)
    ours, _ = make_pair(SPECS, FTM, kernel_config=cfg)
    B = 9
    batch = skewed_batch([r for r, _ in SPECS], FTM, B, 6, torch.Generator().manual_seed(3))
    runs = tr_ops.build_runs(ours.spec, batch.indices, batch.offsets, B)
    N = batch.indices.numel()

    # Lookup p of bag (t, b): key = the table's key offset + id; stable sort by key.
    lengths = batch.offsets[1:] - batch.offsets[:-1]
    bag_of = torch.repeat_interleave(torch.arange(len(FTM) * B), lengths)
    t_of, b_of = bag_of // B, bag_of % B
    keys = ours.spec.tensors.feature_key_offset[t_of] + batch.indices
    sorted_keys, perm = torch.sort(keys, stable=True)
    assert torch.equal(runs.sorted_keys.to(torch.int64), sorted_keys)
    assert torch.equal(runs.perm, perm)
    code = runs.sorted_bags.to(torch.int64)
    assert torch.equal(code >> runs.bag_shift, t_of[perm])
    assert torch.equal(code & ((1 << runs.bag_shift) - 1), b_of[perm])

    # Runs: starts where the key changes, N past the last run.
    heads = torch.ones(N, dtype=torch.bool)
    heads[1:] = sorted_keys[1:] != sorted_keys[:-1]
    starts = torch.nonzero(heads).flatten()
    expected_start = torch.full((N + 1,), N, dtype=torch.int64)
    expected_start[: starts.numel()] = starts
    assert torch.equal(runs.run_start.to(torch.int64), expected_start)

    # Split-K chunks: cdiv(L, chunk) for runs of at least `threshold` lookups, in run order.
    lens = expected_start[1:] - expected_start[:-1]
    per_run = torch.where(lens >= threshold, (lens + chunk - 1) // chunk, 0)
    begin = torch.zeros(N + 1, dtype=torch.int64)
    begin[1:] = per_run.cumsum(0)
    # Written up to the run count R (entry R: every chunk); the chunk passes stop there.
    R = starts.numel()
    assert torch.equal(runs.run_chunk_begin[: R + 1].to(torch.int64), begin[: R + 1])
    total = int(begin[-1])
    chunk_run = torch.repeat_interleave(torch.arange(N), per_run)
    assert torch.equal(runs.chunk_run[:total].to(torch.int64), chunk_run)
    assert runs.max_chunks >= total

    # Buckets own contiguous key ranges, hence contiguous runs and chunks: bucket k's runs start at the
    # first run whose key reaches its key bound (the run count when none does).
    bounds = ours.spec.tensors.bucket_key_bounds.to(torch.int64)
    assert bounds.numel() == 3  # two buckets (BLOCK_D 8 and 16)
    run_bounds = torch.searchsorted(sorted_keys[starts], bounds)
    assert torch.equal(runs.bucket_run_bounds.to(torch.int64), run_bounds)
    assert torch.equal(runs.bucket_chunk_bounds.to(torch.int64), begin[run_bounds])
    stats = runs.stats()
    assert stats["runs"] == starts.numel() and stats["long_chunks"] == total


def test_run_block_changes_no_table():
    """transpose.run_block (slots per program of the metadata passes) and scan_block (step of the totals'
    scan) are knobs: one program or many, one scan step or many, the run plan's tables are identical
    (chunk owners compared over the live chunks)."""
    import dataclasses

    ours, _ = make_pair(SPECS, FTM)
    B = 9
    batch = skewed_batch([r for r, _ in SPECS], FTM, B, 6, torch.Generator().manual_seed(4))
    plans = []
    for run_block, scan_block in ((4, 2), (16, 4), (16, 1024), (1024, 8)):
        cfg = ours.spec.config
        cfg = dataclasses.replace(
            cfg, transpose=dataclasses.replace(cfg.transpose, run_block=run_block, scan_block=scan_block)
        )
        plans.append(tr_ops.build_runs(dataclasses.replace(ours.spec, config=cfg), batch.indices, batch.offsets, B))
    R = plans[0].stats()["runs"]
    for other in plans[1:]:
        for name in ("sorted_keys", "perm", "sorted_bags", "run_start", "bucket_run_bounds", "bucket_chunk_bounds"):
            assert torch.equal(getattr(plans[0], name), getattr(other, name)), name
        assert torch.equal(plans[0].run_chunk_begin[: R + 1], other.run_chunk_begin[: R + 1])
        live = int(plans[0].run_chunk_begin[R])
        assert torch.equal(plans[0].chunk_run[:live], other.chunk_run[:live])


def test_empty_batch_plan():
    ours, _ = make_pair(SPECS, FTM)
    B = 4
    idx = torch.zeros(0, dtype=torch.int64)
    off = torch.zeros(len(FTM) * B + 1, dtype=torch.int64)
    runs = tr_ops.build_runs(ours.spec, idx, off, B)
    assert runs.run_start.tolist() == [0]
    assert runs.bucket_run_bounds.tolist() == [0] * 3 and runs.bucket_chunk_bounds.tolist() == [0] * 3
    assert runs.run_chunk_begin.tolist() == [0] and runs.stats()["runs"] == 0


@pytest.mark.parametrize("lengths", [(1,), (1, 2), (0, 1, 3), (5, 9, 17)])
def test_linearize_with_short_bags_matches_a_torch_derivation(lengths):
    """The linearize tile follows the mean bag length (L=1: one id per step, more bags per program):
    keys and bag ids must not depend on it."""
    ours, _ = make_pair(SPECS, FTM)
    B = 11
    T = len(FTM)
    g = torch.Generator().manual_seed(5)
    lens = torch.tensor(lengths)[torch.randint(0, len(lengths), (T * B,), generator=g)]
    offsets = torch.zeros(T * B + 1, dtype=torch.int64)
    offsets[1:] = lens.cumsum(0)
    bag_of = torch.repeat_interleave(torch.arange(T * B), lens)
    t_of, b_of = bag_of // B, bag_of % B
    rows = torch.tensor([SPECS[FTM[t]][0] for t in range(T)])
    ids = (torch.rand(bag_of.numel(), generator=g) * rows[t_of]).long()
    keys, bags, shift = tr_ops.linearize(ours.spec, ids, offsets, B)
    assert torch.equal(keys.to(torch.int64), ours.spec.tensors.feature_key_offset[t_of] + ids)
    assert torch.equal(bags.to(torch.int64), (t_of << shift) | b_of)


def test_linearize_tile_keeps_the_tile_size():
    assert tr_ops.linearize_tile(64, 16, 4_194_304, 131072 * 32) == (1024, 1)  # L=1
    assert tr_ops.linearize_tile(64, 16, 41_943_040, 65536 * 32) == (64, 16)  # L=20
    assert tr_ops.linearize_tile(64, 16, 4 * 1000, 1000) == (256, 4)  # L=4
    assert tr_ops.linearize_tile(64, 16, 0, 0) == (1024, 1)
    for n, bags in ((7, 3), (100, 9), (5, 1)):
        b, s = tr_ops.linearize_tile(4, 4, n, bags)
        assert b * s == 16 and s <= 4


@pytest.mark.parametrize("run_block", [2, 4, 16])
def test_chunk_owners_of_a_row_in_every_bag(run_block):
    """A default id in (almost) every bag: one run holds most chunks, so the program owning its block
    writes them over many rounds of run_block chunks; after the first round's search, rounds wholly
    inside that run store it without one (kernels/transpose.py _chunk_offsets_kernel). The owners match
    a torch derivation whatever the rounds."""
    import dataclasses

    cfg = load_named("interpreter").replace_backward(short_threshold=1, long_chunk=1)
    cfg = dataclasses.replace(cfg, transpose=dataclasses.replace(cfg.transpose, run_block=run_block))
    ours, _ = make_pair(SPECS, FTM, kernel_config=cfg)
    B = 16
    batch = skewed_batch([r for r, _ in SPECS], FTM, B, 6, torch.Generator().manual_seed(9), hot_fraction=0.9,
                         min_L=2)
    runs = tr_ops.build_runs(ours.spec, batch.indices, batch.offsets, B)
    lens = (runs.run_start[1:] - runs.run_start[:-1]).to(torch.int64)
    R = runs.stats()["runs"]
    # chunk 1, threshold 1: every lookup is a chunk; the hot rows' runs span several full rounds.
    assert int(lens.max()) >= 3 * run_block
    chunk_run = torch.repeat_interleave(torch.arange(R), lens[:R])
    assert torch.equal(runs.chunk_run[: chunk_run.numel()].to(torch.int64), chunk_run)


@pytest.mark.parametrize("pooling", ["sum", "none"])
def test_more_features_than_one_grid_holds_take_more_launches(pooling, monkeypatch):
    """CUDA's grid dimension 1 holds at most 65,535 features; FBGEMM takes any count. The sort-key pass
    (and VBE's layout, tests/test_vbe.py) launch once per such slice of the features: with the limit
    shrunk to 2, three features take two launches, and keys, bag ids and a training step equal one
    launch's (the reference)."""
    from tbe_cases import PoolingMode, assert_close, oracle_state, oracle_step
    from torchrec_triton_tbe.kernels.transpose import _linearize_kernel
    from torchrec_triton_tbe.ops import launch as launch_ops

    mode = {"sum": PoolingMode.SUM, "none": PoolingMode.NONE}[pooling]
    specs = [(30, 8), (20, 8)] if pooling == "none" else SPECS
    ours, ref = make_pair(specs, FTM, oracle="reference", pooling_mode=mode, learning_rate=0.3)
    g = torch.Generator().manual_seed(3)
    batch = skewed_batch([r for r, _ in specs], FTM, 5, 4, g)
    whole = tr_ops.linearize(ours.spec, batch.indices, batch.offsets, batch.B)
    grids = []
    real_launch = tr_ops.launch
    monkeypatch.setattr(tr_ops, "launch", lambda k, grid, *a, **kw: (
        grids.append(grid) if k is _linearize_kernel else None, real_launch(k, grid, *a, **kw))[1])
    monkeypatch.setattr(launch_ops, "MAX_GRID_Y", 2)
    sliced = tr_ops.linearize(ours.spec, batch.indices, batch.offsets, batch.B)
    assert [grid[1] for grid in grids] == [2, 1]
    for a, b in zip(whole[:2], sliced[:2]):
        assert torch.equal(a, b)
    out = ours(batch.indices, batch.offsets)
    grad = torch.randn(out.shape, generator=g)
    out.backward(grad)
    expected = oracle_step(ref, batch, grad.double())
    assert_close(out, expected, "forward", atol=1e-6, rtol=1e-6)
    for t, (got, want) in enumerate(zip(ours.split_embedding_weights(), oracle_state(ref)[0])):
        assert_close(got, want, f"table {t} after a step in sliced launches", atol=1e-6, rtol=1e-6)


@triton.jit
def _split_bag_kernel(bags_ptr, t_ptr, b_ptr, bag_shift, N: tl.constexpr):
    i = tl.arange(0, N)
    t, b = split_bag(tl.load(bags_ptr + i), bag_shift)
    tl.store(t_ptr + i, t)
    tl.store(b_ptr + i, b)


@pytest.mark.parametrize("dtype,shift", [(torch.int32, 1), (torch.int32, 20), (torch.int32, 31), (torch.int64, 31),
                                         (torch.int64, 32), (torch.int64, 40)])
def test_bag_ids_split_back_into_feature_and_bag(dtype, shift):
    """The backward splits bag ids (t << shift) | b with a shift and a mask (kernels/grad_gather.py
    split_bag). bag_code gives int64 ids where the shift can reach 32 (a batch or sequence of over 2**31
    bags or lookups), and there the mask must be built in 64 bits: a 32-bit ``1 << 32`` kept t's bits in
    b. Checked on the largest b and t of each width."""
    T = 3 if shift < 31 or dtype == torch.int64 else 1
    ts = torch.tensor([0, T - 1, T - 1, 0], dtype=torch.int64)
    bs = torch.tensor([0, 0, (1 << shift) - 1, (1 << shift) - 1], dtype=torch.int64)
    bags = ((ts << shift) | bs).to(dtype)
    t, b = torch.empty_like(bags), torch.empty_like(bags)
    _split_bag_kernel[(1,)](bags, t, b, shift, N=4)
    assert t.tolist() == ts.tolist() and b.tolist() == bs.tolist()
