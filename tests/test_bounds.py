"""Bad input. FATAL: a clear ValueError/TypeError naming the feature, table and position, and the
weights and optimizer state untouched. WARNING / IGNORE: FBGEMM's repair, checked against FBGEMM's own
bounds_check_indices on the CPU, fused into the forward kernel or not."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tbe_cases import BoundsCheckMode, EmbOptimType, assert_close, checked_optimizer_spec, expected_warnings, make_pair
from torchrec_triton_tbe import TritonTBE

SPECS = [(10, 4), (6, 8)]
FTM = [0, 1, 1]


def fatal_module():
    ours, _ = make_pair(SPECS, FTM, oracle="reference", bounds_check_mode=BoundsCheckMode.FATAL,
                        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    return ours


def snapshot(m):
    return [w.clone() for w in m.split_embedding_weights()] + [m.momentum1.clone(), m.iter.clone()]


GOOD_IDX = [1, 9, 0, 5, 2, 3, 0, 5]
GOOD_OFF = [0, 2, 3, 4, 6, 6, 8]  # T=3 features, B=2


@pytest.mark.parametrize(
    "indices,offsets,match",
    [
        ([1, 10, 0, 5, 2, 3, 0, 5], GOOD_OFF, r"indices\[1\] = 10 is out of range for feature 0 \(table 0, 10 rows\), sample 0"),
        ([1, 9, 0, 5, 2, 3, 0, -1], GOOD_OFF, r"indices\[7\] = -1 is out of range for feature 2 \(table 1, 6 rows\), sample 1"),
        ([1, 9, 0, 6, 2, 3, 0, 5], GOOD_OFF, r"indices\[3\] = 6 is out of range for feature 1 \(table 1"),
        (GOOD_IDX, [0, 2, 3, 4, 2, 6, 8], r"bag 3 \(feature 1, table 1, sample 1\).*non-decreasing"),
        (GOOD_IDX, [0, 2, 3, 4, 6, 6, 7], r"offsets\[-1\] = 7 but indices has 8 elements"),
        (GOOD_IDX, [-1, 2, 3, 4, 6, 6, 8], r"bag 0 \(feature 0, table 0, sample 0\)"),
        (GOOD_IDX, [0], r"offsets\[-1\] = 0 but indices has 8 elements"),  # B = 0 with ids, as FBGEMM refuses
    ],
)
def test_fatal_rejects_bad_input_and_changes_nothing(indices, offsets, match):
    m = fatal_module()
    before = snapshot(m)
    with pytest.raises(ValueError, match=match):
        m(torch.tensor(indices), torch.tensor(offsets))
    for a, b in zip(before, snapshot(m)):
        assert torch.equal(a, b)
    out = m(torch.tensor(GOOD_IDX), torch.tensor(GOOD_OFF))  # still usable afterwards
    out.sum().backward()


def test_fatal_names_tables_by_name_when_given():
    m, _ = make_pair(SPECS, FTM, oracle="reference", bounds_check_mode=BoundsCheckMode.FATAL,
                     table_names=["users", "items"])
    with pytest.raises(ValueError, match=r"table 1 \('items'\), 6 rows"):
        m(torch.tensor([1, 9, 0, 7, 2, 3, 0, 5]), torch.tensor(GOOD_OFF))


@pytest.mark.parametrize("indices,offsets,psw", [
    ([1, 10, 0, 5, 2, 3, 0, 5], GOOD_OFF, None),  # an id past its table (FATAL)
    ([1, 9, 0, 5, 2, 3, 0, -1], GOOD_OFF, None),  # a negative id
    (GOOD_IDX, [0, 2, 3, 4, 2, 6, 8], None),  # decreasing offsets
    (GOOD_IDX, GOOD_OFF, [1.0] * 7),  # per-sample weights one short
    ([1.0, 9, 0, 5, 2, 3, 0, 5], GOOD_OFF, None),  # float ids
], ids=["id-past-table", "negative-id", "decreasing-offsets", "psw-length", "float-ids"])
def test_bad_input_raises_what_fbgemm_raises_too(indices, offsets, psw):
    """FBGEMM's TBE raises RuntimeError for these (checked on its CPU module): ours are ValueError /
    TypeError, as documented, and RuntimeError as well, so code catching FBGEMM's errors catches them."""
    from torchrec_triton_tbe.errors import InputError, InputTypeError

    m, fbgemm = make_pair(SPECS, FTM, oracle="fbgemm", bounds_check_mode=BoundsCheckMode.FATAL)
    args = (torch.tensor(indices), torch.tensor(offsets), None if psw is None else torch.tensor(psw))
    with pytest.raises(RuntimeError):
        fbgemm(*args)
    with pytest.raises(RuntimeError) as raised:
        m(*args)
    assert isinstance(raised.value, (InputError, InputTypeError))
    assert isinstance(raised.value, TypeError if isinstance(raised.value, InputTypeError) else ValueError)


def test_fatal_says_when_the_table_is_a_shard():
    """TorchRec hands its shards FBGEMM's embedding_shard_info: a FATAL error then says which part of the
    table this module holds and that its ids and positions are the shard's (TorchRec's row-wise
    bucketization maps an id past the table to another rank's local id), so a user does not look for
    them in the batch as given."""
    m = TritonTBE([(5, 4), (6, 8)], feature_table_map=FTM, device="cpu", table_names=["items", "users"],
                  bounds_check_mode=BoundsCheckMode.FATAL, embedding_shard_info=[(10, 4, 5, 0), (6, 8, 0, 0)])
    with pytest.raises(ValueError, match=r"indices\[1\] = 8 is out of range for feature 0 \(table 0 \('items'\), "
                       r"5 rows\).*holds a shard of that table: rows \[5, 10\) and columns \[0, 4\) of its 10 x 4"):
        m(torch.tensor([1, 8, 0, 5, 2, 3, 0, 5]), torch.tensor(GOOD_OFF))
    with pytest.raises(ValueError, match=r"indices\[7\] = 6 .*table 1 \('users'\), 6 rows\), sample 1; ids must "
                       r"lie in \[0, 6\)$"):  # a whole table: no note
        m(torch.tensor([1, 4, 0, 5, 2, 3, 0, 6]), torch.tensor(GOOD_OFF))
    with pytest.raises(ValueError, match="embedding_shard_info has 1 entries for 2 tables"):
        TritonTBE([(5, 4), (6, 8)], device="cpu", embedding_shard_info=[(10, 4, 5, 0)])


@pytest.mark.parametrize(
    "indices,offsets,per_sample_weights,error,match",
    [
        (torch.tensor([1.0, 2.0]), torch.tensor([0, 1, 1, 2]), None, TypeError, "indices must be int32 or int64"),
        (torch.tensor([1, 2]), torch.tensor([0, 1, 1, 2], dtype=torch.int16), None, TypeError, "offsets must be int32"),
        (torch.tensor([1, 2]), torch.tensor([0, 1, 2]), None, ValueError, r"T\*B\+1 with T=3 features"),
        (torch.tensor([[1, 2]]), torch.tensor([0, 1, 1, 2]), None, ValueError, "indices must be 1-D"),
        (torch.tensor([1, 2]), torch.tensor([0, 1, 1, 2]), torch.tensor([1, 2]), TypeError, "per_sample_weights must be"),
        (torch.tensor([1, 2]), torch.tensor([0, 1, 1, 2]), torch.ones(3), ValueError, "one weight per lookup"),
    ],
)
def test_wrong_types_and_shapes_raise_in_every_mode(indices, offsets, per_sample_weights, error, match):
    for mode in (BoundsCheckMode.FATAL, BoundsCheckMode.NONE):
        m, _ = make_pair(SPECS, FTM, oracle="reference", bounds_check_mode=mode)
        before = snapshot(m)
        with pytest.raises(error, match=match):
            m(indices, offsets, per_sample_weights)
        for a, b in zip(before, snapshot(m)):
            assert torch.equal(a, b)


BAD_CASES = [
    ([1, 12, -3, 4, 9, 7, 2, 5], [0, 2, 3, 4, 6, 6, 8]),  # bad ids in several tables
    ([1, 2, 3, 4, 1, 2, 3, 0], [0, 3, 2, 5, 9, 9, 12]),  # decreasing offsets, offsets past the end
    ([1, 2, 3, 4, 1, 2, 3, 0], [-2, 3, 4, 5, 6, 7, 7]),  # negative start, last offset short
    ([0, 11, 2, 3, 7, 1, 2, 30], [0, 1, 3, 3, 5, 8, 6]),  # both at once
    ([1, 2, 3, 4, 1, 2, 3, 0], [3]),  # B = 0 with ids: no bag, but the last offset is still repaired
]


@pytest.mark.parametrize("mode", [BoundsCheckMode.WARNING, BoundsCheckMode.IGNORE])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("case", range(len(BAD_CASES)))
def test_warning_and_ignore_repair_like_fbgemm(mode, fused, case):
    indices, offsets = (torch.tensor(x) for x in BAD_CASES[case])
    # FBGEMM's own CPU repair of the same input is the oracle.
    fb_idx, fb_off = indices.clone(), offsets.clone()
    rows_per_feature = torch.tensor([SPECS[k][0] for k in FTM], dtype=torch.int64)
    fb_warning = torch.zeros(1, dtype=torch.int64)
    torch.ops.fbgemm.bounds_check_indices(rows_per_feature, fb_idx, fb_off, int(mode), fb_warning)

    m, ref = make_pair(SPECS, FTM, oracle="reference", bounds_check_mode=mode, fused_bounds_check=fused)
    our_idx, our_off = indices.clone(), offsets.clone()
    out = m(our_idx, our_off)
    assert torch.equal(our_off, fb_off), (our_off, fb_off)
    assert torch.equal(our_idx, fb_idx), (our_idx, fb_idx)
    expected = ref.output(ref.forward(fb_idx, fb_off)).detach()
    assert_close(out, expected, "forward on repaired input", atol=1e-6, rtol=1e-6)
    if mode == BoundsCheckMode.WARNING:
        # The documented count (FBGEMM counts some repairs differently, nonzero exactly when it is).
        assert int(m.bounds_check_warning) == expected_warnings(indices, offsets, fb_idx) > 0
        assert int(fb_warning) > 0
    else:
        assert int(m.bounds_check_warning) == 0
    # The backward applies the repaired batch: the reference's step on FBGEMM's repair.
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(case))
    out.backward(grad)
    ref.backward(ref.forward(fb_idx, fb_off), grad)
    ref.step()
    for t, (got, want) in enumerate(zip(m.split_embedding_weights(), ref.tables)):
        assert_close(got, want, f"table {t} after the backward of the repaired batch", atol=1e-6, rtol=1e-6)


def test_none_mode_does_not_touch_valid_input():
    m, _ = make_pair(SPECS, FTM, oracle="reference", bounds_check_mode=BoundsCheckMode.NONE)
    idx, off = torch.tensor(GOOD_IDX), torch.tensor(GOOD_OFF)
    m(idx, off)
    assert idx.tolist() == GOOD_IDX and off.tolist() == GOOD_OFF


@pytest.mark.parametrize("mode", [BoundsCheckMode.WARNING, BoundsCheckMode.IGNORE])
def test_offsets_repair_across_blocks_counts_and_clears(monkeypatch, mode):
    """More bags than one block of the offsets check / repair (ops/bounds.OFFSETS_BLOCK, shrunk here to
    keep the interpreter fast): bad offsets on both sides of block edges, repaired as FBGEMM's CPU
    bounds_check_indices does; WARNING counts every bad bag, the wrong last offset and every bad id
    once. The check's scratch (count, tickets) comes back to zero, so the next, valid batch passes
    through untouched."""
    from torchrec_triton_tbe.ops import bounds as bounds_ops

    block = 16
    monkeypatch.setattr(bounds_ops, "OFFSETS_BLOCK", block)
    g = torch.Generator().manual_seed(11)
    B = 2 * block + 5  # 3 features: 3 B + 1 offsets span seven blocks
    T = len(FTM)
    lengths = torch.randint(0, 3, (T * B,), generator=g)
    offsets = torch.zeros(T * B + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    N = int(offsets[-1])
    indices = torch.cat([torch.randint(0, SPECS[k][0], (int(lengths[t * B:(t + 1) * B].sum()),), generator=g)
                         for t, k in enumerate(FTM)])
    good_idx, good_off = indices.clone(), offsets.clone()
    for pos, value in ((block - 1, -5), (block, N + 9), (block + 3, 0), (4 * block, 4), (4 * block + 1, 2)):
        offsets[pos] = value
    offsets[-1] = N - 2
    indices[5], indices[N // 2] = -2, 1000  # (FBGEMM leaves -1, its pruned-row id, alone)
    bad_bags = ((offsets[:-1] < 0) | (offsets[:-1] > offsets[1:]) | (offsets[1:] > N)).sum()
    fb_idx, fb_off = indices.clone(), offsets.clone()
    rows = torch.tensor([SPECS[k][0] for k in FTM], dtype=torch.int64)
    torch.ops.fbgemm.bounds_check_indices(rows, fb_idx, fb_off, int(mode), torch.zeros(1, dtype=torch.int64))
    bad_ids = int((fb_idx != indices).sum())
    assert bad_ids >= 2 and int(bad_bags) >= 4

    m, _ = make_pair(SPECS, FTM, oracle="reference", bounds_check_mode=mode)
    m(indices, offsets)
    assert torch.equal(offsets, fb_off) and torch.equal(indices, fb_idx)
    expected = int(bad_bags) + 1 + bad_ids if mode == BoundsCheckMode.WARNING else 0
    assert int(m.bounds_check_warning) == expected
    assert m._bounds_scratch.tolist() == [0, 0], "the offsets check leaves its scratch zero"
    m(good_idx, good_off)
    assert int(m.bounds_check_warning) == expected


@settings(max_examples=25, deadline=None, derandomize=True)
@given(data=st.data())
def test_flat_id_check_attributes_each_id_to_its_feature(data):
    """The id check is one flat pass whose programs find each id's feature by a binary search over the
    features' first offsets (kernels/bounds.py). Random feature counts (one included: Triton's 1
    constant), empty features and bags, ids just outside their own table but inside another's, blocks
    smaller than a feature: repaired ids and the WARNING count equal FBGEMM's CPU bounds_check_indices,
    and FATAL names the first bad position."""
    from torchrec_triton_tbe.ops import bounds as bounds_ops

    rows = data.draw(st.lists(st.integers(1, 12), min_size=1, max_size=4), label="rows")
    ftm = data.draw(st.lists(st.integers(0, len(rows) - 1), min_size=1, max_size=6), label="ftm")
    B = data.draw(st.integers(1, 5), label="B")
    T = len(ftm)
    lengths = data.draw(st.lists(st.integers(0, 4), min_size=T * B, max_size=T * B), label="lengths")
    offsets = torch.zeros(T * B + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    ids, bad = [], []
    for t in range(T):
        n = int(offsets[(t + 1) * B] - offsets[t * B])
        # No -1: FBGEMM's CPU check leaves it alone (its pruned-row marker), ours repairs it (docs/design.md).
        drawn = data.draw(st.lists(st.integers(-3, rows[ftm[t]] + 2).filter(lambda v: v != -1), min_size=n,
                                   max_size=n), label=f"ids{t}")
        bad += [len(ids) + j for j, v in enumerate(drawn) if not 0 <= v < rows[ftm[t]]]
        ids += drawn
    indices = torch.tensor(ids, dtype=torch.int64)
    specs = [(r, 4) for r in rows]
    saved = bounds_ops.IDS_BLOCK
    bounds_ops.IDS_BLOCK = 16  # several programs per feature (the interpreter stays fast)
    try:
        for mode in (BoundsCheckMode.WARNING, BoundsCheckMode.IGNORE):
            fb_idx, fb_off, fb_warning = indices.clone(), offsets.clone(), torch.zeros(1, dtype=torch.int64)
            rows_per_feature = torch.tensor([rows[k] for k in ftm], dtype=torch.int64)
            torch.ops.fbgemm.bounds_check_indices(rows_per_feature, fb_idx, fb_off, int(mode), fb_warning)
            m, _ = make_pair(specs, ftm, oracle="reference", bounds_check_mode=mode)
            our_idx = indices.clone()
            m(our_idx, offsets.clone())
            assert torch.equal(our_idx, fb_idx), (our_idx, fb_idx)
            if mode == BoundsCheckMode.WARNING:
                assert int(m.bounds_check_warning) == int(fb_warning) == len(bad)
        m, _ = make_pair(specs, ftm, oracle="reference", bounds_check_mode=BoundsCheckMode.FATAL)
        if bad:
            with pytest.raises(ValueError, match=rf"indices\[{bad[0]}\] = "):
                m(indices.clone(), offsets.clone())
        else:
            m(indices.clone(), offsets.clone())
    finally:
        bounds_ops.IDS_BLOCK = saved


def test_the_offsets_scratch_survives_to_empty_and_the_precompile_dry_run():
    """The offsets check repairs in its last program, found by a ticket counted up from the module's
    scratch (kernels/bounds.py): a scratch left non-zero would turn the repair off. ``to_empty`` (meta
    construction, then materialising) zeroes it, and precompile's dry run, which writes no buffer, leaves it
    alone; a bad batch after either is still repaired and counted."""
    from torchrec_triton_tbe.ops import precompile as precompile_ops

    m, _ = make_pair(SPECS, FTM, oracle="reference", bounds_check_mode=BoundsCheckMode.WARNING)
    m._bounds_scratch.fill_(7)
    m.bounds_check_warning.fill_(5)
    m.to_empty(device="cpu")
    assert m._bounds_scratch.tolist() == [0, 0]
    assert int(m.bounds_check_warning) == 0  # no count to keep: to_empty zeroes it too
    precompile_ops.record_step(m, torch.tensor(GOOD_IDX), torch.tensor(GOOD_OFF))
    for round_ in (1, 2):
        offsets = torch.tensor([0, 2, 9, 4, 6, 6, 8])  # bag 1 ends past N, bag 2 starts after it ends
        m(torch.tensor(GOOD_IDX), offsets)
        assert offsets.tolist() == [0, 2, 8, 8, 8, 8, 8], round_
        assert m._bounds_scratch.tolist() == [0, 0] and int(m.bounds_check_warning) == 2 * round_


@pytest.mark.parametrize("mode", [BoundsCheckMode.WARNING, BoundsCheckMode.IGNORE])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("pooling", ["sum", "mean", "none"])
def test_ids_of_a_table_of_zero_rows_read_zeros_and_update_nothing(mode, fused, pooling):
    """A table of 0 rows (a row-wise shard of a table with fewer rows than ranks) has no row for an id:
    WARNING / IGNORE repair its ids to 0 as FBGEMM's check does, but where FBGEMM's kernels then read the
    next table's row 0, or past the weights after the last table, and update there, these read a zero row
    past every table and the backward drops them. Oracle: the reference with each empty table replaced by
    one zero row and its ids by 0, on every table but the empty ones; tables first, middle and last."""
    from tbe_cases import PoolingMode
    from torchrec_triton_tbe.reference import ReferenceTBE

    D = 4
    rows = [0, 5, 0, 7, 0]
    m, _ = make_pair([(r, D) for r in rows], oracle="reference", bounds_check_mode=mode, fused_bounds_check=fused,
                     optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.5, eps=0.1,
                     pooling_mode={"sum": PoolingMode.SUM, "mean": PoolingMode.MEAN, "none": PoolingMode.NONE}[pooling])
    assert m.weights.numel() == 12 * D + D  # the tables, then the zero row at a 16-element boundary
    m.weights[12 * D:].fill_(3.0)  # to_empty's garbage: the module zeroes the row again
    m.to_empty(device="cpu")
    assert not m.weights[12 * D:].any()
    g = torch.Generator().manual_seed(1)
    for w in m.split_embedding_weights():
        w.copy_(torch.rand(w.shape, generator=g) * 2 - 1)
    m.momentum1.zero_()
    m.bounds_check_warning.zero_()
    m.iter.zero_()
    # B = 2; every table's feature has ids, the empty tables' all out of range (any id is).
    indices = torch.tensor([3, 1, 4, 0, 4, 2, 0, 1, 6, 6, 5, 9, 0])
    offsets = torch.tensor([0, 1, 2, 4, 5, 6, 7, 9, 10, 11, 13])
    empty_ids = [0, 1, 5, 6, 10, 11, 12]  # positions of ids in tables 0, 2 and 4
    tables = [w.clone() if r else torch.zeros(1, D) for w, r in zip(m.split_embedding_weights(), rows)]
    ref = ReferenceTBE(tables, list(range(5)), mean=pooling == "mean", nobag=pooling == "none",
                       optimizer=checked_optimizer_spec(m, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD),
                       learning_rate=0.5, eps=0.1)
    ref_idx = indices.clone()
    ref_idx[empty_ids] = 0
    out = m(indices, offsets)
    assert indices[empty_ids].tolist() == [0] * len(empty_ids)  # repaired in place, as FBGEMM's check
    assert int(m.bounds_check_warning) == (len(empty_ids) if mode == BoundsCheckMode.WARNING else 0)
    out64 = ref.forward(ref_idx, offsets)
    grad = torch.randn(out.shape, generator=g)
    assert_close(out, ref.output(out64).detach(), "forward with empty tables", atol=1e-6, rtol=1e-6)
    out.backward(grad)
    ref.backward(out64, grad)
    ref.step()
    for k, r in enumerate(rows):
        if r:
            assert_close(m.split_embedding_weights()[k], ref.tables[k], f"table {k}", atol=1e-6, rtol=1e-6)
            assert_close(m.split_optimizer_states()[k][0], ref.states[k][0], f"state {k}", atol=1e-6, rtol=1e-6)
    assert not m.weights[12 * D:].any()  # the zero row: never updated
