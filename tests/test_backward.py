"""Training against the oracles: weights and optimizer state after several steps, per-sample-weight
gradients, feature_requires_grad; every test uses skewed ids and asserts both backward paths ran."""

import dataclasses
import itertools

import pytest
import torch

from tbe_cases import (
    STATE_TOLERANCE,
    DTYPE,
    EmbOptimType,
    PoolingMode,
    SparseType,
    assert_both_paths,
    assert_close,
    fbgemm_supports,
    make_pair,
    oracle_state,
    oracle_step,
    skewed_batch,
    tolerance,
)

# Mixed D (two BLOCK_D buckets, one width not a power of two) and a table shared by two features.
SPECS = [(40, 8), (30, 12), (25, 16)]
FTM = [0, 1, 1, 2]
STEPS = 3

CASES = list(
    itertools.product(
        [PoolingMode.SUM, PoolingMode.MEAN],
        [False, True],
        [SparseType.FP32, SparseType.FP16, SparseType.BF16],
        [EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ROWWISE_ADAGRAD],
        [torch.int64, torch.int32],
    )
)


def _id(case):
    pm, weighted, wp, opt, it = case
    return f"{pm.name}-{'weighted' if weighted else 'plain'}-{wp.name}-{opt.name}-{str(it)[6:]}"


def train_and_compare(specs, ftm, pooling, weighted, weights, optimizer, index_dtype, output=SparseType.FP32, seed=0,
                      fbgemm_cpu=True, **extra):
    """Trains ours and an oracle side by side; ``fbgemm_cpu``: whether FBGEMM's CPU TBE implements the
    optimizer configuration (else the pure-PyTorch reference is the oracle); ``extra``: more
    constructor keywords (optimizer hyper-parameters)."""
    usable = fbgemm_cpu and fbgemm_supports(weights, output, pooling, weighted, ftm)
    oracle = "fbgemm" if usable else "reference"
    kwargs = dict(
        pooling_mode=pooling,
        weights_precision=weights,
        output_dtype=output,
        optimizer=optimizer,
        learning_rate=0.2,
        eps=0.1,
        stochastic_rounding=False,
        embedding_table_index_type=index_dtype,
        embedding_table_offset_type=index_dtype,
        **extra,
    )
    ours, other = make_pair(specs, ftm, oracle=oracle, seed=seed, **kwargs)
    ours.collect_backward_stats = True
    g = torch.Generator().manual_seed(seed + 1)
    wdt, odt = DTYPE[weights], DTYPE[output]
    for step in range(STEPS):
        batch = skewed_batch([r for r, _ in specs], ftm, B=5, max_L=6, generator=g, weighted=weighted,
                             index_dtype=index_dtype)
        out = ours(batch.indices, batch.offsets, batch.per_sample_weights)
        grad = torch.randn(out.shape, generator=g).to(out.dtype)
        ref_out = oracle_step(other, batch, grad)
        assert_close(out, ref_out, f"[{oracle}] forward step {step}", **tolerance(wdt, odt, *_state_dtypes(ours)))
        out.backward(grad)
        assert_both_paths(ours.backward_stats())
    assert_same_state(ours, other, oracle, f"after {STEPS} steps", wdt, odt)
    return ours, oracle


def _state_dtypes(module) -> list:
    # Narrow optimizer state (bf16 moments) rounds what the next steps read: an fp32-level difference in a
    # gradient sum can flip one of its roundings, so results are compared at that state's precision.
    spec = getattr(module, "spec", None)  # a TritonTBE; FBGEMM's modules keep fp32 state here
    return [s.dtype for s in spec.optimizer.states] if spec is not None else []


def assert_same_state(ours, other, oracle: str, when: str, wdt, odt) -> None:
    """Weights and every optimizer state tensor of every table, against the oracle."""
    ref_w, ref_states = oracle_state(other)
    for t, (a, b) in enumerate(zip(ours.split_embedding_weights(), ref_w)):
        assert_close(a, b, f"[{oracle}] table {t} weights {when}", **tolerance(wdt, odt, *_state_dtypes(ours)))
    ours_states = ours.split_optimizer_states()
    assert len(ours_states) == len(ref_states)
    for t, (mine, theirs) in enumerate(zip(ours_states, ref_states)):
        assert len(mine) == len(theirs), f"table {t}: {len(mine)} state tensors, oracle {len(theirs)}"
        for i, (a, b) in enumerate(zip(mine, theirs)):
            tol = tolerance(wdt, odt, *_state_dtypes(ours), table=STATE_TOLERANCE)
            assert_close(a, b, f"[{oracle}] table {t} state {i} {when}", **tol)


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_training_matches_oracle(case):
    pooling, weighted, weights, optimizer, index_dtype = case
    train_and_compare(SPECS, FTM, pooling, weighted, weights, optimizer, index_dtype)


@pytest.mark.parametrize("output", [SparseType.FP16, SparseType.BF16])
def test_training_low_precision_outputs(output):
    train_and_compare(SPECS, FTM, PoolingMode.SUM, True, SparseType.FP16, EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                      torch.int64, output=output)


def test_shared_tables_in_any_order():
    # Features 0 and 3 share table 0 and are not adjacent: their gradients must merge into one run.
    train_and_compare(SPECS, [0, 1, 2, 0], PoolingMode.SUM, False, SparseType.FP32,
                      EmbOptimType.EXACT_ROWWISE_ADAGRAD, torch.int64)


def test_one_update_per_row_not_per_lookup():
    # The section-5 trap: a per-lookup Adagrad would differ from one step with the summed gradient.
    ours, ref = make_pair([(4, 4)], oracle="reference", optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                          learning_rate=0.5, eps=1e-8)
    ours.collect_backward_stats = True
    indices = torch.tensor([0, 0, 0, 0, 0, 0, 2])  # one bag: row 0 six times (a long run), row 2 once
    offsets = torch.tensor([0, 7])
    grad = torch.tensor([[1.0, -2.0, 0.5, 3.0]])
    ours(indices, offsets).backward(grad)
    out64 = ref.forward(indices, offsets)
    out64.backward(grad.double())
    ref.step()
    assert_close(ours.split_embedding_weights()[0], ref.tables[0], "rows 0 and 2", atol=1e-6, rtol=1e-6)
    stats = ours.backward_stats()
    assert stats["runs"] == 2
    assert_both_paths(stats)


@pytest.mark.parametrize("pooling", [PoolingMode.SUM, PoolingMode.MEAN])
@pytest.mark.parametrize("weights", [SparseType.FP32, SparseType.FP16])
def test_per_sample_weight_gradient(pooling, weights):
    specs, ftm = SPECS, FTM
    oracle = "fbgemm" if fbgemm_supports(weights, SparseType.FP32, pooling, True, ftm) else "reference"
    ours, other = make_pair(specs, ftm, oracle=oracle, pooling_mode=pooling, weights_precision=weights,
                            learning_rate=0.0)
    g = torch.Generator().manual_seed(3)
    batch = skewed_batch([r for r, _ in specs], ftm, B=4, max_L=5, generator=g, weighted=True)
    psw = batch.per_sample_weights.clone().requires_grad_(True)
    ours.collect_backward_stats = True
    out = ours(batch.indices, batch.offsets, psw)
    grad = torch.randn(out.shape, generator=g)
    out.backward(grad)
    assert_both_paths(ours.backward_stats())
    if oracle == "fbgemm":
        psw_ref = batch.per_sample_weights.clone().requires_grad_(True)
        other(batch.indices.clone(), batch.offsets.clone(), psw_ref).backward(grad)
        expected = psw_ref.grad
    else:
        expected = other.psw_grad(batch.indices, batch.offsets, batch.per_sample_weights, grad)
    assert_close(psw.grad, expected, f"[{oracle}] d out / d psw", **tolerance(DTYPE[weights]))


def test_per_sample_weight_gradient_fp16_weights_given():
    ours, ref = make_pair(SPECS, FTM, oracle="reference", weights_precision=SparseType.FP16, learning_rate=0.0)
    g = torch.Generator().manual_seed(4)
    batch = skewed_batch([r for r, _ in SPECS], FTM, B=3, max_L=4, generator=g, weighted=True)
    psw = batch.per_sample_weights.half().requires_grad_(True)
    ours.collect_backward_stats = True
    out = ours(batch.indices, batch.offsets, psw)
    grad = torch.randn(out.shape, generator=g)
    out.backward(grad)
    assert_both_paths(ours.backward_stats())
    assert psw.grad.dtype == torch.float16
    expected = ref.psw_grad(batch.indices, batch.offsets, psw.detach().float(), grad)
    assert_close(psw.grad, expected, "fp16 psw grad", **tolerance(torch.float16))


def test_feature_requires_grad_masks_psw_gradient():
    ours, ref = make_pair(SPECS, FTM, oracle="reference", learning_rate=0.0)
    g = torch.Generator().manual_seed(5)
    batch = skewed_batch([r for r, _ in SPECS], FTM, B=3, max_L=4, generator=g, weighted=True, min_L=1)
    psw = batch.per_sample_weights.clone().requires_grad_(True)
    mask = torch.tensor([1, 0, 1, 0])
    ours.collect_backward_stats = True
    out = ours(batch.indices, batch.offsets, psw, mask)
    grad = torch.randn(out.shape, generator=g)
    out.backward(grad)
    assert_both_paths(ours.backward_stats())
    expected = ref.psw_grad(batch.indices, batch.offsets, batch.per_sample_weights, grad)
    B = batch.B
    for t in range(len(FTM)):
        lo, hi = int(batch.offsets[t * B]), int(batch.offsets[(t + 1) * B])
        want = expected[lo:hi] if mask[t] else torch.zeros(hi - lo, dtype=torch.float64)
        assert_close(psw.grad[lo:hi], want, f"feature {t} psw grad (mask {int(mask[t])})", atol=1e-5, rtol=1e-5)
    assert (psw.grad[int(batch.offsets[B]) : int(batch.offsets[2 * B])] == 0).all()


def test_stochastic_rounding_is_unbiased_and_close():
    # fp16 weights with SR, every element at 1.5 and an SGD step of 0.61 fp16 ulp (2**-10 in [1, 2)):
    # each stored value must be one of the two neighbours of the exact 1.5 - 0.61 ulp, the lower one
    # with probability 0.61 (round-to-nearest would store it every time), and the mean error ~ 0.
    # Row 0 is looked up 12 times (a long run), the others once (short runs).
    rows, D, lr, ulp, frac = 256, 16, 1e-3, 2.0**-10, 0.61
    g_step = frac * ulp / lr
    ours, _ = make_pair([(rows, D)], oracle="reference", weights_precision=SparseType.FP16,
                        stochastic_rounding=True, learning_rate=lr)
    ours.collect_backward_stats = True
    ours.split_embedding_weights()[0].fill_(1.5)
    indices = torch.cat([torch.zeros(11, dtype=torch.int64), torch.arange(rows)])
    offsets = torch.arange(indices.numel() + 1)
    ours(indices, offsets).backward(torch.full((indices.numel(), D), g_step))
    assert_both_paths(ours.backward_stats())
    stored = ours.split_embedding_weights()[0].double()
    # The long run's row: 12 steps of 0.61 ulp = 7.32 ulp, between 1.5 - 8 ulp and 1.5 - 7 ulp.
    assert set(stored[0].tolist()) <= {1.5 - 8 * ulp, 1.5 - 7 * ulp}, stored[0]
    once = stored[1:]
    low = once == 1.5 - ulp
    assert (low | (once == 1.5)).all(), "a value that is neither neighbour of the exact update"
    n = low.numel()
    # Binomial(n, 0.61): the lower neighbour's share within 5 standard deviations (0.038 for n = 4080).
    sigma = (frac * (1 - frac) / n) ** 0.5
    share = float(low.double().mean())
    assert abs(share - frac) < 5 * sigma, (share, frac, sigma)
    mean_err_ulps = float(((once - (1.5 - frac * ulp)) / ulp).mean())
    assert abs(mean_err_ulps) < 5 * sigma, mean_err_ulps


def test_persistent_grid_fills_whole_waves(monkeypatch):
    """ops/backward._launch_persistent: the first launch of a specialization uses the configured grid;
    later ones are `waves` full waves at the occupancy its compiled registers allow (grid and NPROG
    argument always agree); a different specialization learns its own."""
    import types

    from torchrec_triton_tbe.config import load_named
    from torchrec_triton_tbe.ops import backward as bwd_ops

    launches = []

    class FakeKernel:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                launches.append((grid[0], args[-1], kwargs["TILE"]))
                regs = 154 if kwargs["TILE"] == 8 else 64
                return types.SimpleNamespace(n_regs=regs, metadata=types.SimpleNamespace(num_warps=1, shared=0))

            return run

    props = types.SimpleNamespace(
        major=9, multi_processor_count=132, max_threads_per_multi_processor=2048, regs_per_multiprocessor=65536,
        shared_memory_per_multiprocessor=233472,
    )
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(bwd_ops, "_WAVE_GRID", {})
    bcfg = load_named("sm90").backward
    kernel, dev = FakeKernel(), torch.device("cuda")
    for tile in (8, 8, 16, 16):
        bwd_ops._launch_persistent(kernel, bcfg, dev, (torch.empty(1), 3), dict(TILE=tile), 1)
    first = bcfg.programs_per_sm * 132
    assert launches == [
        (first, first, 8), (bcfg.waves * 132 * 12, bcfg.waves * 132 * 12, 8),
        (first, first, 16), (bcfg.waves * 132 * 32, bcfg.waves * 132 * 32, 16),
    ]


def _record_update_launches(monkeypatch) -> list:
    """Every launch ops/backward.py makes from now on, as launch_ops.Launch records (they still run)."""
    from torchrec_triton_tbe.ops import backward as bwd_ops
    from torchrec_triton_tbe.ops import launch as launch_ops

    seen = []
    real = bwd_ops.launch

    def spy(kernel, grid, args, constexprs, num_warps, key=None, stream=None, maxnreg=None):
        seen.append(launch_ops.Launch(kernel, tuple(grid), tuple(args), dict(constexprs), num_warps, maxnreg))
        return real(kernel, grid, args, constexprs, num_warps, key=key, stream=stream, maxnreg=maxnreg)

    monkeypatch.setattr(bwd_ops, "launch", spy)
    return seen


def _long_step_launches(monkeypatch, long_path: str, **knobs) -> dict:
    """{kernel name: {(TILE, APPLY_TILE, SCAN, warps)}} of one backward over two 64-wide tables with long
    runs, under the interpreter config with a short tile of 4 on one warp and ``knobs``."""
    from torchrec_triton_tbe.config import KnobTable, load_named

    launches = _record_update_launches(monkeypatch)
    cfg = load_named("interpreter").replace_backward(short_threshold=2, long_chunk=3, long_path=long_path,
                                                      tile=KnobTable(4), num_warps=KnobTable(1), **knobs)
    specs = [(40, 64), (30, 64)]
    ours, _ = make_pair(specs, [0, 1], oracle="reference", kernel_config=cfg,
                        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    batch = skewed_batch([r for r, _ in specs], [0, 1], B=5, max_L=6, generator=torch.Generator().manual_seed(5),
                         hot_fraction=0.5)
    out = ours(batch.indices, batch.offsets)
    out.backward(torch.ones_like(out))
    seen = {}
    for r in launches:
        c = r.constexprs
        seen.setdefault(r.kernel.__name__, set()).add((c.get("TILE"), c.get("APPLY_TILE"), c.get("SCAN"), r.num_warps))
    return seen


@pytest.mark.parametrize("long_path", ["split", "fused"])
def test_long_path_takes_its_own_tile_and_warps(monkeypatch, long_path):
    """backward.long_tile / long_warps reach the long path's kernels (partials and apply, or the fused
    one) and leave the short kernel on backward.tile / num_warps. Tables of width 64, so the warps differ
    after tile_warps' cap (8 x 64 elements hold two warps, 4 x 64 one)."""
    from torchrec_triton_tbe.config import KnobTable, tile_warps

    seen = _long_step_launches(monkeypatch, long_path, long_tile=KnobTable(8), long_warps=KnobTable(2))
    assert tile_warps(2, 8 * 64) == 2 and tile_warps(1, 4 * 64) == 1
    assert seen["_backward_short_kernel"] == {(4, None, None, 1)}
    if long_path == "split":
        assert seen["_backward_long_partials_kernel"] == {(8, None, None, 2)}
        assert seen["_backward_long_apply_kernel"] == {(8, None, 1, 2)}  # no apply knobs: the long path's
    else:
        assert seen["_backward_long_fused_kernel"] == {(8, 8, None, 2)}


@pytest.mark.parametrize("long_path", ["split", "fused"])
def test_apply_takes_its_own_tile_warps_and_scan(monkeypatch, long_path):
    """backward.apply_tile / apply_warps / apply_scan reach the apply kernel (TILE, warps, SCAN); the fused
    kernel sums a run's partials with the same tile (APPLY_TILE) and keeps the long path's warps. The
    partials kernel stays on the long path's knobs."""
    from torchrec_triton_tbe.config import KnobTable

    seen = _long_step_launches(monkeypatch, long_path, long_tile=KnobTable(2), long_warps=KnobTable(1),
                               apply_tile=KnobTable(8), apply_warps=KnobTable(2), apply_scan=16)
    if long_path == "split":
        assert seen["_backward_long_partials_kernel"] == {(2, None, None, 1)}
        assert seen["_backward_long_apply_kernel"] == {(8, None, 16, 2)}
    else:
        assert seen["_backward_long_fused_kernel"] == {(2, 8, None, 1)}


def test_short_kernel_takes_its_register_cap_and_nothing_else_does(monkeypatch):
    """backward.max_registers reaches the short kernel's launch as Triton's maxnreg, per BLOCK_D (0: no
    cap), and no other kernel's; the interpreter ignores the cap, so the weights match the uncapped run.
    Whether ptxas honours it is tests/test_aot.py's."""
    from torchrec_triton_tbe.config import KnobTable, load_named

    launches = _record_update_launches(monkeypatch)
    base = load_named("interpreter").replace_backward(short_threshold=2, long_chunk=3)
    specs = [(40, 64), (30, 16)]
    batch = skewed_batch([r for r, _ in specs], [0, 1], B=5, max_L=6, generator=torch.Generator().manual_seed(6),
                         hot_fraction=0.5)
    weights = []
    for cfg in (base, base.replace_backward(max_registers=KnobTable(0, ((64, 96),)))):
        launches.clear()
        ours, _ = make_pair(specs, [0, 1], oracle="reference", kernel_config=cfg,
                            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
        out = ours(batch.indices, batch.offsets)
        out.backward(torch.ones_like(out))
        weights.append([w.clone() for w in ours.split_embedding_weights()])
        seen = {}
        for r in launches:
            seen.setdefault(r.kernel.__name__, set()).add((r.constexprs.get("BLOCK_D"), r.maxnreg))
        capped = {name for name, uses in seen.items() if any(cap is not None for _, cap in uses)}
        if cfg is base:
            assert not capped and "_backward_short_kernel" in seen
    assert capped == {"_backward_short_kernel"}
    assert seen["_backward_short_kernel"] == {(64, 96), (16, None)}
    assert any(n.startswith("_backward_long") for n in seen)
    for a, b in zip(*weights):
        assert torch.equal(a, b)


@pytest.mark.parametrize("weights,expected", [(SparseType.FP32, 2), (SparseType.FP16, 4)])
def test_fp32_weights_take_their_own_tile_and_the_same_result(monkeypatch, weights, expected):
    """backward.tile_fp32 sets the short kernel's runs per tile for fp32 weights only (fp32 rows are
    twice as wide); like every knob it changes no result: weights and state match the `tile` run bitwise."""
    from torchrec_triton_tbe.config import KnobTable, load_named
    from torchrec_triton_tbe.ops import backward as bwd_ops

    launches = _record_update_launches(monkeypatch)
    base = load_named("interpreter")
    states = []
    for cfg in (base, base.replace_backward(tile_fp32=KnobTable(2))):
        ours, _ = make_pair(SPECS, FTM, oracle="reference", kernel_config=cfg, weights_precision=weights,
                            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, stochastic_rounding=False)
        batch = skewed_batch([r for r, _ in SPECS], FTM, B=5, max_L=6, generator=torch.Generator().manual_seed(5))
        out = ours(batch.indices, batch.offsets)
        out.backward(torch.ones_like(out))
        states.append([w.clone() for w in ours.split_embedding_weights()] + [ours.momentum1.clone()])
    tiles = [r.constexprs["TILE"] for r in launches if r.kernel is bwd_ops._backward_short_kernel]
    assert set(tiles[: len(tiles) // 2]) == {base.backward.tile.default} and set(tiles[len(tiles) // 2:]) == {expected}
    for a, b in zip(*states):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "knobs,split",
    [
        (dict(split_paths=False), (False, False)),
        (dict(split_paths=True), (True, True)),  # two buckets, four streams: each bucket's paths take two
        (dict(split_paths=True, bucket_streams=3), (False, False)),  # the buckets' paths would not fit
        (dict(split_paths=True, split_paths_min_lookups=10**9), (False, False)),  # too few lookups
        (dict(split_paths=True, split_paths_max_lookups=1), (False, False)),  # too many
        (dict(split_paths=True, split_paths_min_lookups=1, split_paths_max_lookups=10**9), (True, True)),
        # three streams for two buckets: the heavier one (three features of BLOCK_D 16 against one of 8)
        # takes two of them, the other the third
        (dict(split_heaviest=True, bucket_streams=3), (False, True)),
        (dict(split_heaviest=True, bucket_streams=3, split_paths_min_lookups=10**9), (False, False)),
        (dict(split_heaviest=True, split_paths=True), (True, True)),  # all fit: every bucket's split
    ],
    ids=["off", "on", "streams_3", "below_min_lookups", "above_max_lookups", "inside_the_window",
         "heaviest", "heaviest_below_min_lookups", "heaviest_and_all_fit"],
)
def test_split_paths_put_short_and_long_kernels_on_their_own_streams(monkeypatch, knobs, split):
    """backward.split_paths: with bucket streams, each bucket's short kernel takes one stream and its
    long path (partials, then apply: in order on one stream) the next, so the number of lanes asked of
    bucket_streams doubles, where 2 x buckets fit the streams and the backward's lookups are within
    [split_paths_min_lookups, split_paths_max_lookups]; otherwise a bucket's three kernels share a
    stream. backward.split_heaviest: where they do not fit, the heaviest bucket alone splits. The streams
    are stand-ins here (no CUDA), so the kernels run on the interpreter as usual and the result is
    checked too."""
    from torchrec_triton_tbe.config import load_named
    from torchrec_triton_tbe.ops import backward as bwd_ops
    from torchrec_triton_tbe.ops import launch as launch_ops

    fake = ["s0", "s1", "s2", "s3"]
    asked, placed = [], []
    real = bwd_ops._launch_persistent

    def streams(cfg, num_launches, num_lookups, device):
        asked.append(num_launches)
        return fake[: min(cfg.bucket_streams, num_launches)]

    def spy(kernel, bcfg, device, args, constexprs, num_warps, stream=None, maxnreg=None):
        placed.append((kernel, stream))
        return real(kernel, bcfg, device, args, constexprs, num_warps, maxnreg=maxnreg)

    monkeypatch.setattr(bwd_ops, "bucket_streams", streams)
    monkeypatch.setattr(launch_ops, "join_streams", lambda streams, device: None)
    monkeypatch.setattr(bwd_ops, "_launch_persistent", spy)
    base = load_named("interpreter").replace_backward(long_path="split")
    cfg = base.replace_backward(**{"bucket_streams": 4, **knobs})
    results = []
    for c in (base, cfg):
        ours, _ = make_pair(SPECS, FTM, oracle="reference", kernel_config=c, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
        batch = skewed_batch([r for r, _ in SPECS], FTM, B=6, max_L=8, generator=torch.Generator().manual_seed(3))
        placed.clear()
        out = ours(batch.indices, batch.offsets)
        out.backward(torch.ones_like(out))
        results.append([w.clone() for w in ours.split_embedding_weights()] + [ours.momentum1.clone()])
    buckets = len(ours._spec.plan.buckets)
    assert buckets == 2 and asked[-1] == buckets + sum(split)
    kinds = [bwd_ops._backward_short_kernel, bwd_ops._backward_long_partials_kernel, bwd_ops._backward_long_apply_kernel]
    assert [k for k, _ in placed] == kinds * buckets
    for j in range(buckets):
        short, partials, apply = (s for _, s in placed[3 * j: 3 * j + 3])
        assert partials == apply  # the apply reads its partials: one stream, in order
        assert (short != partials) == split[j]
    assert len({s for _, s in placed}) == buckets + sum(split)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("small", [0, 1])
def test_split_heaviest_lanes(small):
    """ops/backward.update_lanes, backward.split_heaviest: seven buckets on four streams (the production
    shapes'); the heaviest takes the first two lanes (the small-table kernels' lane 0 before them), the
    others one lane each after them, so lane i % 4 puts the heaviest's short kernel and long path on
    streams no other bucket shares first; the lookups gate it; with the knob off, one lane per bucket."""
    from torchrec_triton_tbe.config import load_named
    from torchrec_triton_tbe.ops.backward import update_lanes

    weights = [8, 40, 112, 160, 448, 1280, 1024]  # prod_t40: features x BLOCK_D per bucket
    on = dataclasses.replace(load_named("interpreter").backward, bucket_streams=4, split_heaviest=True,
                             split_paths=True, split_paths_min_lookups=100, split_paths_max_lookups=200)
    num_lanes, lanes = update_lanes(on, weights, 1000, bool(small))
    assert num_lanes == 8
    assert lanes[5] == (small, small + 1)
    others = [lanes[j] for j in range(7) if j != 5]
    assert all(a == b for a, b in others) and [a for a, _ in others] == list(range(small + 2, small + 8))
    assert [lane % 4 for lane, _ in others][:2] == [(small + 2) % 4, (small + 3) % 4]
    # below the lookups' floor, above split_heaviest_max_lookups, or off: one lane per bucket, in plan order
    assert update_lanes(dataclasses.replace(on, split_heaviest_max_lookups=1000), weights, 1000, bool(small))[0] == 8
    for cfg, lookups in ((on, 99), (dataclasses.replace(on, split_heaviest=False), 1000),
                         (dataclasses.replace(on, split_heaviest_max_lookups=999), 1000)):
        assert update_lanes(cfg, weights, lookups, bool(small)) == (7, [(j + small, j + small) for j in range(7)])
    # equal weights: the first in plan order; one stream: nothing to split
    assert update_lanes(on, [5, 5, 5], 1000, False)[1][0] == (0, 1)
    assert update_lanes(dataclasses.replace(on, bucket_streams=1), weights, 1000, False)[0] == 7


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_side_streams_are_joined_when_a_launch_raises(monkeypatch, where):
    """Buckets on side streams (GPU): kernels already queued there read tensors the failing call frees,
    and only the join orders the reuse of that memory, so a launch that raises (a first-call compile
    error) still joins them. Streams and launches are stand-ins here (no GPU)."""
    from torchrec_triton_tbe.ops import backward as bwd_ops
    from torchrec_triton_tbe.ops import forward as fwd_ops

    from torchrec_triton_tbe.ops import launch as launch_ops

    ops = fwd_ops if where == "forward" else bwd_ops
    joined = []
    monkeypatch.setattr(ops, "bucket_streams", lambda *args: ["main", "side"])
    monkeypatch.setattr(launch_ops, "join_streams", lambda streams, device: joined.append(list(streams)))

    def fail(*args, **kwargs):
        raise RuntimeError("compile failed")

    monkeypatch.setattr(ops, "launch" if where == "forward" else "_launch_persistent", fail)
    ours, _ = make_pair(SPECS, FTM, oracle="reference", optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    batch = skewed_batch([r for r, _ in SPECS], FTM, B=3, max_L=4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="compile failed"):
        ours(batch.indices, batch.offsets).sum().backward()
    assert joined == [["main", "side"]]

    # A join that fails too (a sticky CUDA error) is noted on the launch's error, which stays the one raised.
    def broken_join(streams, device):
        raise RuntimeError("sticky error")

    monkeypatch.setattr(launch_ops, "join_streams", broken_join)
    with pytest.raises(RuntimeError, match="compile failed") as info:
        ours(batch.indices, batch.offsets).sum().backward()
    assert any("sticky error" in note for note in getattr(info.value, "__notes__", []))
