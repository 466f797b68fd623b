"""Pooled forward against FBGEMM's CPU TBE (and the pure-PyTorch reference where FBGEMM's CPU TBE
lacks the combination): SUM/MEAN x weighted x weights dtype x output dtype x index dtype x bag lanes
(1: the sequential path, 2: the interpreter's lanes path), mixed D, shared tables, empty bags; the
lanes path against the sequential one over lanes / gather / bags, B not a multiple of the lanes, widths
that need a column mask, and the fused bounds repair."""

import dataclasses
import itertools

import pytest
import torch

from tbe_cases import (
    DTYPE,
    BoundsCheckMode,
    PoolingMode,
    SparseType,
    assert_close,
    fbgemm_supports,
    make_pair,
    oracle_step,
    skewed_batch,
    tolerance,
)
from test_vbe import vbe_batch
from torchrec_triton_tbe.config import KnobTable, load_named
from torchrec_triton_tbe.ops.forward import lanes_gather, short_bag_lanes
from torchrec_triton_tbe.ops.launch import bucket_streams

SPECS = [(40, 8), (30, 12), (25, 16), (9, 4)]  # BLOCK_D buckets 4, 8 and 16; width 12 is not a power of 2
# (FBGEMM requires D % 4 == 0; other widths are checked against the reference in test_properties.py.)
FTM = [0, 1, 1, 2, 3]

CASES = list(
    itertools.product(
        [PoolingMode.SUM, PoolingMode.MEAN],
        [False, True],
        [SparseType.FP32, SparseType.FP16, SparseType.BF16],
        [SparseType.FP32, SparseType.FP16, SparseType.BF16],
        [torch.int64, torch.int32],
        [1, 2],
    )
)
INTERPRETER = load_named("interpreter")


def with_lanes(lanes: int, **changes):
    return INTERPRETER.replace_forward(bag_lanes=KnobTable(lanes), **changes)


@pytest.mark.parametrize(
    "pooling,weighted,weights,output,index_dtype,lanes",
    CASES,
    ids=[f"{p.name}-{'w' if w else 'u'}-{a.name}-{b.name}-{str(i)[6:]}-lanes{n}" for p, w, a, b, i, n in CASES],
)
def test_forward_matches_oracle(pooling, weighted, weights, output, index_dtype, lanes):
    oracle = "fbgemm" if fbgemm_supports(weights, output, pooling, weighted, FTM) else "reference"
    ours, other = make_pair(
        SPECS, FTM, oracle=oracle, pooling_mode=pooling, weights_precision=weights, output_dtype=output,
        embedding_table_index_type=index_dtype, embedding_table_offset_type=index_dtype,
        kernel_config=with_lanes(lanes),
    )
    g = torch.Generator().manual_seed(7)
    batch = skewed_batch([r for r, _ in SPECS], FTM, B=4, max_L=5, generator=g, weighted=weighted,
                         index_dtype=index_dtype)
    with torch.no_grad():
        out = ours(batch.indices, batch.offsets, batch.per_sample_weights)
    assert out.dtype == DTYPE[output]
    assert out.shape == (4, sum(SPECS[k][1] for k in FTM))
    if oracle == "fbgemm":
        with torch.no_grad():
            expected = other(batch.indices.clone(), batch.offsets.clone(), batch.per_sample_weights)
    else:
        expected = other.output(other.forward(batch.indices, batch.offsets, batch.per_sample_weights)).detach()
    assert_close(out, expected, f"[{oracle}] forward", **tolerance(DTYPE[weights], DTYPE[output]))


@pytest.mark.parametrize("pooling", [PoolingMode.SUM, PoolingMode.MEAN])
def test_empty_bags_pool_to_zero(pooling):
    ours, _ = make_pair([(10, 6)], oracle="reference", pooling_mode=pooling)
    indices = torch.tensor([1, 2, 3])
    offsets = torch.tensor([0, 0, 3, 3])  # bags 0 and 2 are empty
    out = ours(indices, offsets)
    assert torch.equal(out[0], torch.zeros(6)) and torch.equal(out[2], torch.zeros(6))
    w = ours.split_embedding_weights()[0]
    expected = w[1:4].sum(0) / (3 if pooling == PoolingMode.MEAN else 1)
    assert_close(out[1], expected, "bag 1", atol=1e-6, rtol=1e-6)


def test_empty_batch_and_no_lookups():
    ours, _ = make_pair([(10, 8), (5, 4)], oracle="reference")
    out = ours(torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    assert out.shape == (0, 12)
    out = ours(torch.zeros(0, dtype=torch.int64), torch.zeros(7, dtype=torch.int64))  # B=3, all bags empty
    assert out.shape == (3, 12) and torch.equal(out, torch.zeros(3, 12))
    out.sum().backward()  # nothing to update, must not fail


def test_output_columns_follow_feature_order():
    # Feature t's columns are [D_offsets[t], D_offsets[t+1]) and features may share a table.
    ours, _ = make_pair([(6, 4), (6, 2)], [1, 0, 1], oracle="reference")
    w0, w1 = ours.split_embedding_weights()
    indices = torch.tensor([5, 0, 3])
    offsets = torch.tensor([0, 1, 2, 3])  # B=1
    out = ours(indices, offsets)[0]
    assert_close(out, torch.cat([w1[5], w0[0], w1[3]]), "columns", atol=0, rtol=0)


def test_forward_positional_order_is_fbgemms():
    ours, _ = make_pair([(10, 4)], oracle="reference")
    indices, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3])
    psw = torch.tensor([1.0, 2.0, 0.5])
    a = ours(indices, offsets, psw, None, None, None)
    b = ours(indices=indices, offsets=offsets, per_sample_weights=psw)
    assert torch.equal(a, b)


# (bag_lanes, gather, bags_per_program): lanes wider than B, lanes with a partial last group, one-id
# steps, several groups per program, groups per program by BLOCK_D (configs/sm90.yaml's kind of table).
LANE_KNOBS = [(2, 4, 2), (4, 1, 1), (8, 2, 1), (4, 8, 3), (16, 4, 1), (4, 2, KnobTable(2, ((32, 1), (64, 3))))]
WIDE_SPECS = [(40, 32), (30, 20), (25, 64), (9, 12), (11, 6)]  # BLOCK_D 32, 32 (masked), 64, 16, 8
WIDE_FTM = [0, 1, 2, 3, 4, 2]


def assert_baseline_matches_reference(ref, x, got, weights, what):
    """The sequential baseline these knob tests compare with, against the reference itself: a bug shared
    by every knob setting would otherwise pass them."""
    want = ref.output(ref.forward(x.indices, x.offsets, x.per_sample_weights)).detach()
    assert_close(got, want, f"{what}: the sequential baseline vs the reference", **tolerance(DTYPE[weights]))


@pytest.mark.parametrize(
    "pooling,weighted,weights,index_dtype",
    [
        (PoolingMode.SUM, False, SparseType.FP32, torch.int64),
        (PoolingMode.MEAN, True, SparseType.FP16, torch.int32),
        (PoolingMode.MEAN, False, SparseType.BF16, torch.int64),
    ],
    ids=["sum-fp32-i64", "mean-w-fp16-i32", "mean-bf16-i64"],
)
def test_bag_lanes_match_sequential(pooling, weighted, weights, index_dtype):
    kw = dict(pooling_mode=pooling, weights_precision=weights, embedding_table_index_type=index_dtype,
              embedding_table_offset_type=index_dtype)
    seq, ref = make_pair(WIDE_SPECS, WIDE_FTM, oracle="reference", kernel_config=with_lanes(1), **kw)
    g = torch.Generator().manual_seed(5)
    rows = [r for r, _ in WIDE_SPECS]
    batches = [  # B not a multiple of the lanes; one-id bags; long bags
        skewed_batch(rows, WIDE_FTM, B=B, max_L=L, generator=g, weighted=weighted, index_dtype=index_dtype)
        for B, L in [(7, 6), (3, 1), (5, 11)]
    ]
    with torch.no_grad():
        expected = [seq(x.indices, x.offsets, x.per_sample_weights) for x in batches]
    for x, e in zip(batches, expected):
        assert_baseline_matches_reference(ref, x, e, weights, f"B={x.B}")
    for lanes, gather, bags in LANE_KNOBS:
        cfg = with_lanes(lanes, gather=KnobTable(gather), bags_per_program=bags)
        ours, _ = make_pair(WIDE_SPECS, WIDE_FTM, oracle="reference", kernel_config=cfg, **kw)
        for x, e in zip(batches, expected):
            with torch.no_grad():
                out = ours(x.indices, x.offsets, x.per_sample_weights)
            # Same rows per bag; only the step grouping of the sums may differ (fp32 accumulation).
            assert_close(out, e, f"lanes {lanes} gather {gather} bags {bags} vs sequential, B={x.B}",
                         **tolerance(torch.float32))


@pytest.mark.parametrize("mode", [BoundsCheckMode.WARNING, BoundsCheckMode.IGNORE])
@pytest.mark.parametrize("lanes", [1, 2, 8])
@pytest.mark.parametrize("launch", ["per_bucket", "one_launch", "narrow"])
def test_bag_lanes_fused_repair(mode, lanes, launch):
    # Bad ids in several lanes of one group and in the last, partial group: each repaired once, in place.
    # one_launch (forward.grouped_max_batch, 16-wide slices): feature 0 (32 wide) takes two slices; both
    # pool row 0 for a bad id, the one at column 0 writes and counts it. narrow (32-wide slices,
    # forward.grouped_narrow): the 12-wide feature pools 16-wide tiles, two bags side by side per lane.
    specs, ftm = [(10, 32), (6, 12)], [0, 1]
    cfg = {"per_bucket": with_lanes(lanes, grouped_max_batch=0), "one_launch": grouped(lanes),
           "narrow": narrow(lanes, widths=(16,), narrow_lanes=KnobTable(2))}[launch]
    ours, ref = make_pair(specs, ftm, oracle="reference", bounds_check_mode=mode, fused_bounds_check=True,
                          kernel_config=cfg)
    assert ours.spec.tensors.grouped_features.numel() == (2 if launch == "narrow" else 3)
    indices = torch.tensor([3, 10, -1, 2, 9, 11, 0, 5, 6, 7, 100, 1, 4])
    offsets = torch.tensor([0, 2, 3, 3, 6, 7, 9, 12, 13])  # T=2, B=4 (bag 2 of feature 0 is empty)
    expected_ids = torch.tensor([3, 0, 0, 2, 9, 0, 0, 5, 0, 0, 0, 1, 4])
    idx = indices.clone()
    out = ours(idx, offsets.clone())
    assert torch.equal(idx, expected_ids), idx
    assert_close(out, ref.output(ref.forward(expected_ids, offsets)).detach(), "forward on repaired ids",
                 atol=1e-6, rtol=1e-6)
    assert int(ours.bounds_check_warning) == (6 if mode == BoundsCheckMode.WARNING else 0)
    if launch == "narrow":
        (plan,) = [p for key, p in ours.spec.launch_plans.items() if key[0] == "forward"]
        assert plan[0][3]["NARROW"] == 16 and plan[0][3]["NARROW_LANES"] == 2


def test_lanes_gather_follows_the_mean_bag_length():
    # Host ints only: len(indices) / (B * T), rounded up to a power of two, never above the knob.
    assert lanes_gather(8, num_lookups=4096, num_bags=4096) == 1  # L = 1
    assert lanes_gather(8, num_lookups=3 * 512, num_bags=1024) == 2  # L = 1.5
    assert lanes_gather(8, num_lookups=3 * 1024, num_bags=1024) == 4  # L = 3
    assert lanes_gather(8, num_lookups=20 * 1024, num_bags=1024) == 8  # L = 20: the knob
    assert lanes_gather(4, num_lookups=0, num_bags=1024) == 1  # no lookups


def test_short_bags_widen_the_lanes_up_to_the_knob():
    # (table lanes, table gather, gather after lanes_gather, forward.short_bag_max_lanes)
    assert short_bag_lanes(2, 4, 1, 8) == 8  # one id per bag: 2 lanes x 4 ids -> 8 lanes x 1 id
    assert short_bag_lanes(2, 4, 2, 8) == 4  # two ids per bag
    assert short_bag_lanes(2, 4, 1, 4) == 4  # capped by the knob
    assert short_bag_lanes(2, 4, 4, 8) == 2  # bags as long as the gather: the table's lanes
    assert short_bag_lanes(8, 4, 1, 4) == 8  # never fewer than the table's
    assert short_bag_lanes(2, 4, 1, 0) == 2  # off


@pytest.mark.parametrize("B", [13, 4], ids=["per_bucket", "one_launch"])
def test_short_bag_lanes_match_sequential(B):
    # Bags of 0-1 ids (mean 1): GATHER shrinks to 1 and LANES widens from 2 to 8 (B = 13: a partial last
    # group), in the bucket launches and in the one launch (the interpreter's grouped_max_batch is 4).
    kw = dict(pooling_mode=PoolingMode.MEAN, weights_precision=SparseType.FP16)
    seq, ref = make_pair(WIDE_SPECS, WIDE_FTM, oracle="reference", kernel_config=with_lanes(1), **kw)
    cfg = with_lanes(2, gather=KnobTable(4), short_bag_max_lanes=8)
    ours, _ = make_pair(WIDE_SPECS, WIDE_FTM, oracle="reference", kernel_config=cfg, **kw)
    x = skewed_batch([r for r, _ in WIDE_SPECS], WIDE_FTM, B=B, max_L=1, generator=torch.Generator().manual_seed(3),
                     weighted=True)
    with torch.no_grad():
        out = ours(x.indices, x.offsets, x.per_sample_weights)
        expected = seq(x.indices, x.offsets, x.per_sample_weights)
    assert_baseline_matches_reference(ref, x, expected, kw["weights_precision"], f"short bags, B={B}")
    assert_close(out, expected, f"short-bag lanes vs sequential, B={B}", **tolerance(torch.float32))
    (plan,) = [p for key, p in ours.spec.launch_plans.items() if key[0] == "forward"]
    assert {(launch[3]["LANES"], launch[3]["GATHER"]) for launch in plan} == {(8, 1)}
    assert len(plan) == (1 if B == 4 else len(ours.spec.plan.buckets))


def test_bucket_streams_only_fork_large_cuda_forwards():
    # Host ints only; the side-stream launches themselves run in tests/gpu (no streams here).
    cfg = INTERPRETER.forward
    streams = dataclasses.replace(cfg, bucket_streams=4, bucket_streams_min_lookups=1000)
    cpu = torch.device("cpu")
    assert cfg.bucket_streams == 1 and bucket_streams(cfg, 7, 10**6, cpu) == []
    assert bucket_streams(streams, 7, 10**6, cpu) == []  # not CUDA
    assert bucket_streams(streams, 1, 10**6, torch.device("cuda")) == []  # one launch: nothing to overlap
    assert bucket_streams(streams, 7, 999, torch.device("cuda")) == []  # below the threshold
    # The backward's knobs of the same names (config.BackwardConfig): the same rule.
    bwd = dataclasses.replace(INTERPRETER.backward, bucket_streams=4, bucket_streams_min_lookups=1000)
    assert INTERPRETER.backward.bucket_streams == 1 and bucket_streams(INTERPRETER.backward, 7, 10**6, cpu) == []
    assert bucket_streams(bwd, 7, 10**6, cpu) == [] and bucket_streams(bwd, 7, 999, torch.device("cuda")) == []


def test_small_batch_knobs_apply_at_small_batches_for_every_weight_width():
    cfg = dataclasses.replace(INTERPRETER.forward, small_batch=8, bags_per_program_small=1,
                              gather_small=KnobTable(16, ((64, 8),)), bag_lanes_small=KnobTable(4))
    assert cfg.knobs(64, 2, 8) == (1, 4, 8)
    assert cfg.knobs(32, 2, 8) == (1, 4, 16)
    regular = (cfg.bags_per_program.get(64), cfg.lanes(64, 2), cfg.gather.get(64))
    assert cfg.knobs(64, 2, 9) == regular  # above small_batch
    assert cfg.knobs(64, 4, 8) == (1, 4, 8)  # fp32 rows too
    assert cfg.knobs(64, 4, 9) == (cfg.bags_per_program.get(64), cfg.lanes(64, 4), cfg.gather.get(64))
    assert dataclasses.replace(cfg, small_batch=0).knobs(64, 2, 1) == regular


def test_small_batch_knobs_match_sequential():
    """The small-batch tables only regroup the sums: same output as the sequential path."""
    kw = dict(pooling_mode=PoolingMode.MEAN, weights_precision=SparseType.FP16)
    seq, ref = make_pair(WIDE_SPECS, WIDE_FTM, oracle="reference", kernel_config=with_lanes(1), **kw)
    small = INTERPRETER.replace_forward(small_batch=8, bags_per_program_small=1, gather_small=KnobTable(16),
                                        bag_lanes_small=KnobTable(4))
    ours, _ = make_pair(WIDE_SPECS, WIDE_FTM, oracle="reference", kernel_config=small, **kw)
    g = torch.Generator().manual_seed(9)
    x = skewed_batch([r for r, _ in WIDE_SPECS], WIDE_FTM, B=7, max_L=20, generator=g, weighted=True)
    with torch.no_grad():
        expected = seq(x.indices, x.offsets, x.per_sample_weights)
        assert_close(ours(x.indices, x.offsets, x.per_sample_weights), expected,
                     "small-batch knobs vs sequential", **tolerance(torch.float32))
    assert_baseline_matches_reference(ref, x, expected, kw["weights_precision"], "small-batch knobs")
    plans = [p for key, p in ours._spec.launch_plans.items() if key[0] == "forward"]
    assert plans and all(cx["LANES"] == 4 and cx["BAGS"] == 1 for p in plans for _, _, _, cx, _, _ in p)


# One launch for every D bucket (forward.grouped_max_batch): 16-wide column slices, so WIDE_SPECS'
# 32-, 20- and 64-wide tables take 2, 2 and 4 slices (the 20-wide one's second slice masked to 4
# columns) and the 12- and 6-wide ones one each.
def grouped(lanes: int = 2, max_batch: int = 64, block_d: int = 16, **changes):
    return with_lanes(lanes, grouped_max_batch=max_batch, grouped_block_d=block_d, **changes)


def test_grouped_entries_cover_every_column_once():
    m, _ = make_pair(WIDE_SPECS, WIDE_FTM, oracle="reference", kernel_config=grouped())
    tensors, plan = m.spec.tensors, m.spec.plan
    entries = list(zip(tensors.grouped_features.tolist(), tensors.grouped_cols.tolist()))
    expected = sorted((t, c) for t, d in enumerate(plan.feature_dims) for c in range(0, d, 16))
    assert sorted(entries) == expected and len(set(entries)) == len(entries)
    dims = [plan.feature_dims[t] for t, _ in entries]
    assert dims == sorted(dims, reverse=True)  # widest features first
    assert tensors.grouped_generic == len(entries) and tensors.chunk_width == 16


def test_grouped_launch_only_at_small_batches_over_several_buckets():
    from torchrec_triton_tbe.ops.forward import _launches

    m, _ = make_pair(WIDE_SPECS, WIDE_FTM, oracle="reference", kernel_config=grouped(max_batch=8))
    spec = m.spec
    one = _launches(spec, 8, 40, False, 4)
    assert len(one) == 1 and one[0][3]["COL_CHUNKS"] and one[0][3]["BLOCK_D"] == 16
    assert one[0][2][1] == spec.tensors.grouped_features.numel()
    per_bucket = _launches(spec, 9, 40, False, 4)  # above grouped_max_batch
    assert len(per_bucket) == len(spec.plan.buckets) and not any(x[3]["COL_CHUNKS"] for x in per_bucket)
    single, _ = make_pair([(40, 32), (30, 20)], [0, 1], oracle="reference", kernel_config=grouped(max_batch=8))
    assert len(_launches(single.spec, 8, 40, False, 4)) == 1  # one bucket: its own launch, whole rows
    assert not _launches(single.spec, 8, 40, False, 4)[0][3]["COL_CHUNKS"]
    # Every table narrower than the slice width: one entry per feature, the widest bucket's tile.
    narrow, _ = make_pair([(40, 8), (30, 4)], [0, 1], oracle="reference",
                          kernel_config=grouped(max_batch=8, block_d=64))
    (x,) = _launches(narrow.spec, 8, 40, False, 4)
    assert x[3]["BLOCK_D"] == 8 and x[2][1] == 2


GROUPED_CASES = [
    (PoolingMode.SUM, False, SparseType.FP32, torch.int64, 1),
    (PoolingMode.MEAN, True, SparseType.FP16, torch.int32, 2),
    (PoolingMode.SUM, True, SparseType.BF16, torch.int64, 4),
    (PoolingMode.MEAN, False, SparseType.FP32, torch.int32, 8),
]


@pytest.mark.parametrize("pooling,weighted,weights,index_dtype,lanes", GROUPED_CASES,
                         ids=[f"{p.name}-{'w' if w else 'u'}-{a.name}-{str(i)[6:]}-lanes{n}"
                              for p, w, a, i, n in GROUPED_CASES])
def test_grouped_forward_matches_per_bucket(pooling, weighted, weights, index_dtype, lanes):
    kw = dict(pooling_mode=pooling, weights_precision=weights, embedding_table_index_type=index_dtype,
              embedding_table_offset_type=index_dtype)
    base, ref = make_pair(WIDE_SPECS, WIDE_FTM, oracle="reference", kernel_config=with_lanes(lanes), **kw)
    ours, _ = make_pair(WIDE_SPECS, WIDE_FTM, oracle="reference", kernel_config=grouped(lanes), **kw)
    g = torch.Generator().manual_seed(11)
    rows = [r for r, _ in WIDE_SPECS]
    for B, L in [(7, 6), (3, 1), (5, 13)]:
        x = skewed_batch(rows, WIDE_FTM, B=B, max_L=L, generator=g, weighted=weighted, index_dtype=index_dtype)
        with torch.no_grad():
            out = ours(x.indices, x.offsets, x.per_sample_weights)
            expected = base(x.indices, x.offsets, x.per_sample_weights)
        # The same rows and steps per bag and column: only the tile's width differs.
        assert_close(out, expected, f"one launch vs per bucket, B={B}", **tolerance(torch.float32))
        assert_baseline_matches_reference(ref, x, expected, weights, f"per bucket, B={B}")


def test_grouped_forward_trains_like_fbgemm():
    # The backward is unchanged; the one-launch forward's output feeds it (FBGEMM's CPU TBE oracle).
    ours, other = make_pair(SPECS, FTM, kernel_config=grouped(max_batch=1 << 20))
    assert len({b.block_d for b in ours.spec.plan.buckets}) > 1
    g = torch.Generator().manual_seed(3)
    for step in range(2):
        x = skewed_batch([r for r, _ in SPECS], FTM, B=6, max_L=5, generator=g)
        out = ours(x.indices, x.offsets)
        ref = other(x.indices, x.offsets)
        assert_close(out, ref, f"forward step {step}", **tolerance(torch.float32))
        grad = torch.randn(out.shape, generator=g)
        out.backward(grad)
        ref.backward(grad)
    for a, b in zip(ours.split_embedding_weights(), other.split_embedding_weights()):
        assert_close(a, b, "weights after two steps", atol=1e-5, rtol=1e-5)


def test_grouped_forward_with_vbe_matches_per_bucket():
    sizes = [[3, 1], [2, 4], [0, 3], [5, 0], [1, 1], [2, 2]]  # features x ranks (an empty feature-rank)
    base, _ = make_pair(WIDE_SPECS, WIDE_FTM, oracle="reference", kernel_config=with_lanes(2))
    ours, _ = make_pair(WIDE_SPECS, WIDE_FTM, oracle="reference", kernel_config=grouped(2))
    idx, offsets, _ = vbe_batch(sizes, torch.Generator().manual_seed(4), specs=WIDE_SPECS, ftm=WIDE_FTM)
    with torch.no_grad():
        out = ours(idx, offsets, batch_size_per_feature_per_rank=sizes)
        expected = base(idx, offsets, batch_size_per_feature_per_rank=sizes)
    assert_close(out, expected, "VBE: one launch vs per bucket", **tolerance(torch.float32))


def test_grouped_forward_leaves_small_tables_to_their_path():
    # Small tables (kernels/small_table.py) keep their own launches; the one launch takes the rest.
    specs, ftm = [(40, 32), (12, 16), (30, 8), (9, 12)], [0, 1, 2, 3]
    cfg = grouped(2).replace_small_table(max_rows=16)
    base, _ = make_pair(specs, ftm, oracle="reference", kernel_config=with_lanes(2))
    ours, _ = make_pair(specs, ftm, oracle="reference", kernel_config=cfg)
    tensors = ours.spec.tensors
    assert 0 < tensors.grouped_generic < tensors.grouped_features.numel()
    g = torch.Generator().manual_seed(8)
    x = skewed_batch([r for r, _ in specs], ftm, B=5, max_L=6, generator=g)
    with torch.no_grad():
        assert_close(ours(x.indices, x.offsets), base(x.indices, x.offsets), "small tables + one launch",
                     **tolerance(torch.float32))


def test_grouped_launch_leaves_grids_too_tall_to_the_bucket_launches(monkeypatch):
    # More slices than one grid's second dimension holds: the per-bucket launches, which fit, run instead.
    from torchrec_triton_tbe.ops import forward as fwd_ops
    from torchrec_triton_tbe.ops import launch as launch_ops

    m, _ = make_pair(WIDE_SPECS, WIDE_FTM, oracle="reference", kernel_config=grouped(max_batch=8))
    slices = m.spec.tensors.grouped_features.numel()
    assert len(fwd_ops._launches(m.spec, 8, 40, False, 4)) == 1
    monkeypatch.setattr(launch_ops, "MAX_GRID_Y", slices - 1)
    m.spec.launch_plans.clear()
    launches = fwd_ops._launches(m.spec, 8, 40, False, 4)
    assert len(launches) == len(m.spec.plan.buckets) and not any(x[3]["COL_CHUNKS"] for x in launches)


def test_buckets_of_more_features_than_one_grid_holds_launch_in_slices(monkeypatch):
    """CUDA's grid dimension 1 holds at most 65,535 features; FBGEMM takes any count. The forward and the
    per-sample weights' gradient launch once per such slice of a bucket's features (as the sort-key and
    VBE-layout passes do): with the limit shrunk to 2, the 3-feature bucket takes two launches of each,
    and the output, that gradient and the tables after a step equal one launch's."""
    from torchrec_triton_tbe.kernels.forward import _pooled_forward_kernel
    from torchrec_triton_tbe.kernels.psw_grad import _psw_grad_kernel
    from torchrec_triton_tbe.ops import backward as bwd_ops
    from torchrec_triton_tbe.ops import forward as fwd_ops
    from torchrec_triton_tbe.ops import launch as launch_ops

    g = torch.Generator().manual_seed(5)
    x = skewed_batch([r for r, _ in SPECS], FTM, B=6, max_L=5, generator=g, weighted=True)
    grad = torch.randn(6, sum(SPECS[t][1] for t in FTM), generator=g)
    grids = {_pooled_forward_kernel: [], _psw_grad_kernel: []}

    def spy(module):
        real = module.launch
        monkeypatch.setattr(module, "launch", lambda kernel, grid, *a, **kw: (
            grids[kernel].append(grid[1]) if kernel in grids else None, real(kernel, grid, *a, **kw))[1])

    def step():
        # B = 6 is above the interpreter config's grouped_max_batch: one launch per bucket.
        ours, _ = make_pair(SPECS, FTM, oracle="reference", kernel_config=with_lanes(2), learning_rate=0.3)
        psw = x.per_sample_weights.clone().requires_grad_()
        out = ours(x.indices, x.offsets, psw)
        out.backward(grad)
        return [out, psw.grad, *ours.split_embedding_weights()]

    whole = step()
    spy(fwd_ops)
    spy(bwd_ops)
    monkeypatch.setattr(launch_ops, "MAX_GRID_Y", 2)
    sliced = step()
    # Buckets 4, 8 and 16 (features 4; 0; 1, 2, 3), the last in slices of 2 and 1.
    assert grids[_pooled_forward_kernel] == [1, 1, 2, 1] and grids[_psw_grad_kernel] == [1, 1, 2, 1]
    names = ["output", "per-sample weights' gradient"] + [f"table {t} after the step" for t in range(len(SPECS))]
    assert len(whole) == len(sliced) == len(names)
    for what, a, b in zip(names, whole, sliced):
        assert torch.equal(a.detach(), b.detach()), what


@pytest.mark.parametrize("kernel_config", ["per_bucket", "grouped"])
def test_forward_launch_keys_equal_the_arguments_key(monkeypatch, kernel_config):
    # pooled_forward builds launch()'s key from the call's and the plan's parts: it must equal
    # arg_key(args), the key precompile stores its kernels under, for fixed batches and VBE alike.
    from torchrec_triton_tbe.ops import forward as fwd_ops
    from torchrec_triton_tbe.ops.launch import arg_key

    seen = []
    real = fwd_ops.launch

    def spy(kernel, grid, args, constexprs, num_warps, key=None, stream=None, maxnreg=None):
        seen.append((key, arg_key(args)))
        return real(kernel, grid, args, constexprs, num_warps, key=key, stream=stream, maxnreg=maxnreg)

    monkeypatch.setattr(fwd_ops, "launch", spy)
    cfg = with_lanes(2) if kernel_config == "per_bucket" else grouped(2)
    ours, _ = make_pair(WIDE_SPECS, WIDE_FTM, oracle="reference", kernel_config=cfg)
    x = skewed_batch([r for r, _ in WIDE_SPECS], WIDE_FTM, B=5, max_L=6, generator=torch.Generator().manual_seed(3),
                     weighted=True)
    sizes = [[3, 1], [2, 4], [0, 3], [5, 0], [1, 1], [2, 2]]
    idx, offsets, _ = vbe_batch(sizes, torch.Generator().manual_seed(4), specs=WIDE_SPECS, ftm=WIDE_FTM)
    with torch.no_grad():
        ours(x.indices, x.offsets)
        ours(x.indices, x.offsets, x.per_sample_weights)
        ours(idx, offsets, batch_size_per_feature_per_rank=sizes)
    launches = 1 if kernel_config == "grouped" else len(ours.spec.plan.buckets)
    assert len(seen) == 3 * launches
    assert all(key == expected for key, expected in seen)


# Narrow features in the one launch (forward.grouped_narrow): 32-wide slices, WIDE_SPECS' 6-wide feature on
# 8-wide tiles, the 12-wide one on 16-wide tiles, the 20-, 32- and 64-wide ones on the slices.
def narrow(lanes: int = 2, widths=(8, 16), narrow_lanes=KnobTable(1), **changes):
    return grouped(lanes, block_d=32, grouped_narrow=tuple(widths), grouped_narrow_lanes=narrow_lanes, **changes)


def test_narrow_levels_are_the_widths_some_feature_takes():
    cfg = narrow(widths=(8, 16), narrow_lanes=KnobTable(1, ((8, 8), (16, 2)))).forward
    assert cfg.narrow_levels(32, [32, 20, 64, 12, 6]) == ((8, 4), (16, 2))  # 8-wide: lanes capped at 32 / 8
    assert cfg.narrow_levels(32, [32, 12]) == ((16, 2),)  # nothing at most 8 wide: no 8-wide branch
    assert cfg.narrow_levels(32, [32, 6]) == ((8, 4),)  # nothing in (8, 16]
    assert cfg.narrow_levels(16, [16, 12, 6]) == ((8, 2),)  # 16 is the slice itself; lanes capped at 16 / 8
    assert cfg.narrow_levels(32, [64, 32]) == ()
    assert INTERPRETER.forward.narrow_levels(64, [4, 8]) == ()  # off unless configured


def test_narrow_constexprs_only_in_the_one_launch():
    from torchrec_triton_tbe.ops.forward import _launches

    m, _ = make_pair(WIDE_SPECS, WIDE_FTM, oracle="reference", kernel_config=narrow(max_batch=8))
    (one,) = _launches(m.spec, 8, 40, False, 4)
    cx = one[3]
    assert cx["COL_CHUNKS"] and cx["BLOCK_D"] == 32
    assert (cx["NARROW"], cx["NARROW_LANES"], cx["NARROW2"], cx["NARROW2_LANES"]) == (8, 1, 16, 1)
    per_bucket = _launches(m.spec, 9, 40, False, 4)  # above grouped_max_batch: no slices, no narrow tiles
    assert not any("NARROW" in x[3] for x in per_bucket)


NARROW_CASES = [
    (PoolingMode.SUM, False, SparseType.FP32, torch.int64, 1, (1, 1)),
    (PoolingMode.MEAN, True, SparseType.FP16, torch.int32, 2, (4, 2)),
    (PoolingMode.SUM, True, SparseType.BF16, torch.int64, 4, (2, 1)),
    (PoolingMode.MEAN, False, SparseType.FP32, torch.int32, 1, (4, 2)),
]


@pytest.mark.parametrize("pooling,weighted,weights,index_dtype,lanes,narrow_lanes", NARROW_CASES,
                         ids=[f"{p.name}-{'w' if w else 'u'}-{a.name}-{str(i)[6:]}-lanes{n}-x{m[0]}{m[1]}"
                              for p, w, a, i, n, m in NARROW_CASES])
def test_narrow_tiles_match_per_bucket(pooling, weighted, weights, index_dtype, lanes, narrow_lanes):
    # Narrow tiles regroup a narrow feature's sums (more ids per step, or more bags side by side): the
    # same output as the per-bucket launches up to fp32 rounding, B not a multiple of any lane count.
    kw = dict(pooling_mode=pooling, weights_precision=weights, embedding_table_index_type=index_dtype,
              embedding_table_offset_type=index_dtype)
    base, ref = make_pair(WIDE_SPECS, WIDE_FTM, oracle="reference", kernel_config=with_lanes(lanes), **kw)
    table = KnobTable(1, ((8, narrow_lanes[0]), (16, narrow_lanes[1])))
    ours, _ = make_pair(WIDE_SPECS, WIDE_FTM, oracle="reference", kernel_config=narrow(lanes, narrow_lanes=table),
                        **kw)
    g = torch.Generator().manual_seed(12)
    rows = [r for r, _ in WIDE_SPECS]
    for B, L in [(7, 6), (3, 1), (5, 19)]:
        x = skewed_batch(rows, WIDE_FTM, B=B, max_L=L, generator=g, weighted=weighted, index_dtype=index_dtype)
        with torch.no_grad():
            out = ours(x.indices, x.offsets, x.per_sample_weights)
            expected = base(x.indices, x.offsets, x.per_sample_weights)
        assert_close(out, expected, f"narrow tiles vs per bucket, B={B}", **tolerance(torch.float32))
        assert_baseline_matches_reference(ref, x, expected, weights, f"per bucket, B={B}")
    (plan,) = [p for key, p in ours.spec.launch_plans.items() if key[0] == "forward" and key[1] == 5]
    assert plan[0][3]["NARROW"] == 8  # the batches above took the one launch with its narrow tiles


def test_narrow_tiles_with_vbe_match_per_bucket():
    sizes = [[3, 1], [2, 4], [0, 3], [5, 0], [1, 1], [2, 2]]  # features x ranks (an empty feature-rank)
    base, _ = make_pair(WIDE_SPECS, WIDE_FTM, oracle="reference", kernel_config=with_lanes(2))
    ours, _ = make_pair(WIDE_SPECS, WIDE_FTM, oracle="reference",
                        kernel_config=narrow(2, narrow_lanes=KnobTable(2)))
    idx, offsets, _ = vbe_batch(sizes, torch.Generator().manual_seed(6), specs=WIDE_SPECS, ftm=WIDE_FTM)
    with torch.no_grad():
        out = ours(idx, offsets, batch_size_per_feature_per_rank=sizes)
        expected = base(idx, offsets, batch_size_per_feature_per_rank=sizes)
    assert_close(out, expected, "VBE: narrow tiles vs per bucket", **tolerance(torch.float32))
