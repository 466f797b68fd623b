"""Fuzzed bad input (hypothesis, bounded examples; docs/reliability.md lists the guarantees).

Every example is a small valid batch with one corruption (or none) drawn from the kinds below, fed to
a module in one bounds-check mode. The outcome is decided from the data alone:

* host errors (dtype, rank, length, device): ``TypeError`` / ``ValueError`` naming the argument, in
  every mode, with the inputs, weights and optimizer state bitwise unchanged;
* bad ids or offsets under FATAL: ``ValueError`` naming the first bad thing in the order the check
  reports them (the last offset, then the first bad bag, then the first bad id), nothing changed;
  FBGEMM's CPU bounds check rejects the same batches;
* bad ids or offsets under WARNING / IGNORE: FBGEMM's in-place repair (its CPU ``bounds_check_indices``
  is the oracle; an id of -1, which FBGEMM lets through as its pruned-row marker, is repaired like any
  other, docs/design.md), the forward of the repaired batch, and the documented warning count;
* valid batches (mixed id / offset dtypes, non-contiguous views, B = 0, every bag empty, weighted) in
  every mode: the pure-PyTorch reference's output.

NONE mode gets only batches whose data is valid: it reads bad ids out of bounds, as FBGEMM does.
Modules are built once per (mode, pooling, fused check) and reused: nothing here runs a backward, and
the checks below prove every example leaves the weights as they were.
"""

from __future__ import annotations

import functools
import re

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tbe_cases import BoundsCheckMode, EmbOptimType, PoolingMode, assert_close, expected_warnings, make_pair

SPECS = [(10, 4), (6, 8)]
FTM = [0, 1, 1]
ROWS = [SPECS[k][0] for k in FTM]
T = len(FTM)
FATAL, WARNING, IGNORE, NONE = (BoundsCheckMode.FATAL, BoundsCheckMode.WARNING, BoundsCheckMode.IGNORE,
                                BoundsCheckMode.NONE)

HOST_KINDS = ("offsets_length", "indices_float", "offsets_int16", "indices_uint8", "indices_2d", "offsets_2d",
              "indices_meta", "offsets_meta", "psw_length", "psw_int", "psw_meta", "psw_2d", "not_a_tensor")
DATA_KINDS = ("id_high", "id_negative", "id_minus_one", "offsets_decrease", "offsets_overrun",
              "offsets_underrun", "offsets_first_negative", "offsets_mid_past_end", "ids_and_offsets")
VALID_KINDS = ("valid", "mixed_dtypes", "non_contiguous", "all_empty", "empty_batch", "int32")


@functools.cache
def module_pair(mode: BoundsCheckMode, mean: bool, fused: bool):
    return make_pair(SPECS, FTM, oracle="reference", bounds_check_mode=mode, fused_bounds_check=fused,
                     optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                     pooling_mode=PoolingMode.MEAN if mean else PoolingMode.SUM)


def state(m) -> list[torch.Tensor]:
    return [w.clone() for w in m.split_embedding_weights()] + [m.momentum1.clone(), m.iter.clone()]


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(HOST_KINDS + DATA_KINDS + VALID_KINDS))
    B = 0 if kind == "empty_batch" else draw(st.integers(1, 3))
    max_len = 0 if kind == "all_empty" else 3
    lengths = [draw(st.integers(0, max_len)) for _ in range(T * B)]
    ids = [draw(st.integers(0, ROWS[bag // B] - 1)) for bag, n in enumerate(lengths) for _ in range(n)]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    N = len(ids)
    weighted = draw(st.booleans())
    psw = torch.tensor([draw(st.floats(0.25, 2.0, width=32)) for _ in range(N)]) if weighted else None
    # One corruption; positions and values drawn, so some draws leave the batch valid (those are checked
    # as valid batches: the outcome follows from the data, not from the kind's name).
    if kind in ("id_high", "id_negative", "id_minus_one", "ids_and_offsets") and N:
        for _ in range(draw(st.integers(1, 2))):
            p = draw(st.integers(0, N - 1))
            bag = next(b for b in range(T * B) if offsets[b] <= p < offsets[b + 1])
            ids[p] = {"id_high": ROWS[bag // B] + draw(st.integers(0, 40)), "id_minus_one": -1}.get(
                kind, -draw(st.integers(1, 2**40)))
    if kind in ("offsets_decrease", "ids_and_offsets") and T * B > 1:
        p = draw(st.integers(1, T * B - 1))
        offsets[p] = max(0, offsets[p - 1] - draw(st.integers(1, 3)))
    if kind == "offsets_overrun":
        offsets[-1] += draw(st.integers(1, 5))
    if kind == "offsets_underrun" and N:
        offsets[-1] -= draw(st.integers(1, N))
    if kind == "offsets_first_negative":
        offsets[0] = -draw(st.integers(1, 5))
    if kind == "offsets_mid_past_end" and T * B > 1:
        offsets[draw(st.integers(1, T * B - 1))] = N + draw(st.integers(1, 5))
    index_dtype = torch.int32 if kind == "int32" or draw(st.booleans()) else torch.int64
    idx = torch.tensor(ids, dtype=torch.int64).to(index_dtype)
    off = torch.tensor(offsets, dtype=index_dtype)
    if kind == "mixed_dtypes":
        off = off.to(torch.int64 if index_dtype == torch.int32 else torch.int32)
    if kind == "non_contiguous":
        idx = torch.stack([idx, torch.full_like(idx, 10**6)], 1)[:, 0]  # stride 2; the other column is poison
        off = torch.stack([off, -off], 1)[:, 0]
        if psw is not None:
            psw = torch.stack([psw, torch.full_like(psw, float("nan"))], 1)[:, 0]
    host = {
        "offsets_length": lambda: (idx, off[:-1] if off.numel() > 1 else off.repeat(2), psw),
        "indices_float": lambda: (idx.float(), off, psw),
        "offsets_int16": lambda: (idx, off.to(torch.int16), psw),
        "indices_uint8": lambda: (idx.clamp(0, 5).to(torch.uint8), off, psw),
        "indices_2d": lambda: (idx.reshape(1, -1), off, psw),
        "offsets_2d": lambda: (idx, off.reshape(1, -1), psw),
        "indices_meta": lambda: (idx.to("meta"), off, psw),
        "offsets_meta": lambda: (idx, off.to("meta"), psw),
        "psw_length": lambda: (idx, off, torch.ones(N + draw(st.integers(1, 3)))),
        "psw_int": lambda: (idx, off, torch.ones(N, dtype=torch.int64)),
        "psw_meta": lambda: (idx, off, torch.ones(N, device="meta")),
        "psw_2d": lambda: (idx, off, torch.ones(1, N)),
        "not_a_tensor": lambda: (ids, off, psw),
    }
    if kind in host:
        idx, off, psw = host[kind]()
    mode = draw(st.sampled_from([FATAL, WARNING, IGNORE, NONE]))
    return dict(kind=kind, idx=idx, off=off, psw=psw, B=B, mode=mode, mean=draw(st.booleans()),
                fused=draw(st.booleans()))


# (exception, message) of each host error, in every mode.
HOST_ERRORS = {
    "offsets_length": (ValueError, r"offsets has \d+ elements; expected T\*B\+1 with T=3"),
    "indices_float": (TypeError, "indices must be int32 or int64, got torch.float32"),
    "offsets_int16": (TypeError, "offsets must be int32 or int64, got torch.int16"),
    "indices_uint8": (TypeError, "indices must be int32 or int64, got torch.uint8"),
    "indices_2d": (ValueError, r"indices must be 1-D, got shape \(1, \d+\)"),
    "offsets_2d": (ValueError, r"offsets must be 1-D, got shape \(1, \d+\)"),
    "indices_meta": (ValueError, "indices is on meta, the module's tables are on cpu"),
    "offsets_meta": (ValueError, "offsets is on meta, the module's tables are on cpu"),
    "psw_length": (ValueError, r"per_sample_weights has shape \(\d+,\), indices \(\d+,\): one weight per lookup"),
    "psw_int": (TypeError, "per_sample_weights must be a float32/float16/bfloat16 tensor, got torch.int64"),
    "psw_meta": (ValueError, "per_sample_weights is on meta, the module on cpu"),
    "psw_2d": (ValueError, r"per_sample_weights has shape \(1, \d+\)"),
    "not_a_tensor": (TypeError, "indices must be a torch.Tensor, got list"),
}


def data_verdict(idx: torch.Tensor, off: torch.Tensor, B: int):
    """The first bad thing the FATAL check reports, as a message pattern; None for a valid batch."""
    N = idx.numel()
    o = off.tolist()
    if o[-1] != N:
        return rf"offsets\[-1\] = {o[-1]} but indices has {N} elements"
    for bag in range(len(o) - 1):
        if o[bag] < 0 or o[bag] > o[bag + 1] or o[bag + 1] > N:
            t, b = divmod(bag, B)
            return rf"bag {bag} \(feature {t}, table {FTM[t]}, sample {b}\) spans offsets\[{bag}:{bag + 2}\]"
    for bag in range(len(o) - 1):
        for p in range(o[bag], o[bag + 1]):
            v = int(idx[p])
            t, b = divmod(bag, B)
            if not 0 <= v < ROWS[t]:
                return (rf"indices\[{p}\] = {v} is out of range for feature {t} \(table {FTM[t]}, {ROWS[t]} rows\), "
                        rf"sample {b}")
    return None


def fbgemm_repair(idx: torch.Tensor, off: torch.Tensor, psw, mode: BoundsCheckMode):
    """FBGEMM's CPU repair of a copy. -1 (FBGEMM's pruned-row marker, which it skips) is given as an
    out-of-range id, since this module repairs it like any other (docs/design.md)."""
    fb_idx = torch.where(idx == -1, torch.full_like(idx, max(ROWS)), idx).to(torch.int64)
    fb_off = off.clone().to(torch.int64)
    warning = torch.zeros(1, dtype=torch.int64)
    torch.ops.fbgemm.bounds_check_indices(torch.tensor(ROWS, dtype=torch.int64), fb_idx, fb_off, int(mode),
                                          warning, psw)
    return fb_idx, fb_off, int(warning)


@settings(max_examples=2500, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(case=cases())
def test_malformed_batches_raise_or_repair_as_documented(case):
    kind, idx, off, psw, B, mode = (case[k] for k in ("kind", "idx", "off", "psw", "B", "mode"))
    if kind not in HOST_ERRORS and mode == NONE and data_verdict(idx, off, B) is not None:
        mode = FATAL  # NONE reads bad ids out of bounds (FBGEMM's NONE too): give the batch to FATAL
    m, ref = module_pair(mode, case["mean"], case["fused"] and mode in (WARNING, IGNORE))
    before = state(m)
    warnings_before = int(m.bounds_check_warning)
    given_inputs = [x.clone() if isinstance(x, torch.Tensor) and x.device.type != "meta" else x
                    for x in (idx, off, psw)]

    def unchanged(steps: int = 0) -> None:
        """Weights and optimizer state as before; the step count advanced by ``steps`` (each forward
        that ran advances it, as FBGEMM's; a rejected one does not)."""
        after = state(m)
        for a, b in zip(before[:-1], after[:-1]):
            assert torch.equal(a, b)
        assert int(after[-1]) == int(before[-1]) + steps
        for a, b in zip(given_inputs, (idx, off, psw)):
            if isinstance(a, torch.Tensor) and a.device.type != "meta":
                assert torch.equal(a, b), "a rejected batch was modified"

    if kind in HOST_ERRORS:
        error, match = HOST_ERRORS[kind]
        try:
            m(idx, off, psw)
        except error as e:
            assert re.search(match, str(e)), (kind, str(e))
        else:
            raise AssertionError(f"{kind} was accepted")
        unchanged()
        return

    verdict = data_verdict(idx, off, B)
    if verdict is not None and mode == FATAL:
        try:
            m(idx, off, psw)
        except ValueError as e:
            assert re.search(r"bounds check \(FATAL\): " + verdict, str(e)), (verdict, str(e))
        else:
            raise AssertionError(f"FATAL accepted {kind}: {idx.tolist()} {off.tolist()}")
        unchanged()
        if not (idx == -1).any():  # FBGEMM lets -1 through; everything else it rejects too
            try:
                fbgemm_repair(idx, off, psw, FATAL)
            except RuntimeError:
                pass
            else:
                raise AssertionError("FBGEMM's FATAL check accepted a batch ours rejects")
        return

    if verdict is None:
        expected = ref.output(ref.forward(idx.long(), off.long(), psw)).detach()
        out = m(idx, off, psw)
        assert_close(out, expected, f"forward of a valid {kind} batch", atol=1e-6, rtol=1e-6)
        assert int(m.bounds_check_warning) == warnings_before
        unchanged(steps=1)
        return

    # WARNING / IGNORE: FBGEMM's repair, in place.
    fb_idx, fb_off, fb_warnings = fbgemm_repair(idx, off, psw, mode)
    count = expected_warnings(idx, off, fb_idx)
    our_idx, our_off = idx.clone(), off.clone()
    out = m(our_idx, our_off, psw)
    assert torch.equal(our_off.long(), fb_off), (off.tolist(), our_off.tolist(), fb_off.tolist())
    assert torch.equal(our_idx.long(), fb_idx), (idx.tolist(), our_idx.tolist(), fb_idx.tolist())
    expected = ref.output(ref.forward(fb_idx, fb_off, psw)).detach()
    assert_close(out, expected, f"forward of the repaired {kind} batch", atol=1e-6, rtol=1e-6)
    got = int(m.bounds_check_warning) - warnings_before
    if mode == WARNING:
        assert got == count and (count > 0) == (fb_warnings > 0 or bool((idx == -1).any())), (got, count, fb_warnings)
    else:
        assert got == 0
    unchanged(steps=1)


# ---------------------------------------------------------------------------------------------- non-finite
GOOD_IDX = torch.tensor([1, 9, 0, 5, 2, 3, 0, 5])
GOOD_OFF = torch.tensor([0, 2, 3, 4, 6, 6, 8])  # T=3 features, B=2


def nan_mask(tables) -> list[torch.Tensor]:
    return [~torch.isfinite(w) for w in tables]


def test_non_finite_inputs_propagate_like_fbgemm():
    """Unguarded (the default, as in FBGEMM): a NaN per-sample weight poisons its bag's output and,
    through the backward, exactly the rows FBGEMM's CPU TBE poisons; an infinite output gradient
    likewise. Nothing else changes."""
    from tbe_cases import Batch, oracle_step

    for poison in ("psw", "grad"):
        ours, fb = make_pair(SPECS, FTM, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1)
        psw = torch.rand(8) + 0.5
        if poison == "psw":
            psw[3] = float("nan")  # lookup 3: bag 3 = feature 1, sample 1
        out = ours(GOOD_IDX, GOOD_OFF, psw)
        grad = torch.ones_like(out)
        if poison == "grad":
            grad[0, 4] = float("inf")  # sample 0, feature 1's first element
        out.backward(grad)
        expected = oracle_step(fb, Batch(GOOD_IDX, GOOD_OFF, psw, 2), grad)
        assert torch.equal(torch.isnan(out), torch.isnan(expected))
        assert torch.isnan(out).any() == (poison == "psw")
        ours_bad, fb_bad = nan_mask(ours.split_embedding_weights()), nan_mask(fb.split_embedding_weights())
        for a, b in zip(ours_bad, fb_bad):
            assert torch.equal(a, b)
        assert any(m.any() for m in ours_bad) and not all(m.all() for m in ours_bad)


def test_check_finite_guard_raises_before_any_update():
    m, _ = make_pair(SPECS, FTM, oracle="reference", optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    m.check_finite = True
    before = state(m)
    psw = torch.ones(8)
    psw[5] = float("-inf")
    try:
        m(GOOD_IDX, GOOD_OFF, psw)
    except ValueError as e:
        assert "per_sample_weights[5] = -inf is not finite (1 non-finite of 8)" in str(e), str(e)
    else:
        raise AssertionError("a non-finite weight passed the guard")
    out = m(GOOD_IDX, GOOD_OFF, torch.ones(8))
    grad = torch.ones_like(out)
    grad[1, 2] = float("nan")
    try:
        out.backward(grad)
    except ValueError as e:
        assert "grad_output[1, 2] = nan is not finite (1 non-finite of 40)" in str(e), str(e)
    else:
        raise AssertionError("a non-finite gradient passed the guard")
    after = state(m)
    for a, b in zip(before[:-1], after[:-1]):
        assert torch.equal(a, b)
    assert int(after[-1]) == int(before[-1]) + 1  # the forward that ran counted its step, as FBGEMM's
    m(GOOD_IDX, GOOD_OFF).sum().backward()  # still trains afterwards
    assert not torch.equal(before[0], m.split_embedding_weights()[0])
