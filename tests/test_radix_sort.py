"""ops/radix_sort.py: the run plan's radix sort gives torch.sort(stable=True)'s keys and permutation
(the stable order is unique), for any key width, digit width, block and batch size, and refuses what
it cannot sort."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrec_triton_tbe.config import load_named
from torchrec_triton_tbe.ops.radix_sort import RadixSortPlan, radix_applies, sort_keys


def check_against_torch(keys: torch.Tensor, plan: RadixSortPlan) -> None:
    sorted_keys, perm = sort_keys(keys, plan)
    expected_keys, expected_perm = torch.sort(keys, stable=True)
    assert perm.dtype == torch.int32 and sorted_keys.dtype == torch.int32
    assert torch.equal(sorted_keys, expected_keys)
    assert torch.equal(perm.to(torch.int64), expected_perm)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    n=st.integers(0, 200),
    key_bits=st.integers(1, 31),
    radix_bits=st.integers(1, 8),
    block=st.sampled_from([16, 32, 64]),
    distinct=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_matches_stable_torch_sort(n, key_bits, radix_bits, block, distinct, seed):
    # A few distinct values spread over the key width: long stretches of equal keys (what a hot row's
    # run is) whose order must survive every pass.
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 2**key_bits, (distinct,), generator=g, dtype=torch.int64)
    values[0] = 2**key_bits - 1  # the widest key (the sentinel is the largest key of a run plan)
    keys = values[torch.randint(0, distinct, (n,), generator=g)].to(torch.int32)
    check_against_torch(keys, RadixSortPlan(key_bits=key_bits, radix_bits=radix_bits, block=block, num_warps=1))


@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000])
def test_all_equal_and_descending_keys(n):
    plan = RadixSortPlan(key_bits=10, radix_bits=4, block=16, num_warps=1)
    check_against_torch(torch.full((n,), 7, dtype=torch.int32), plan)
    check_against_torch(torch.arange(n, 0, -1, dtype=torch.int32) % 1024, plan)


def test_empty_input():
    keys = torch.zeros(0, dtype=torch.int32)
    sorted_keys, perm = sort_keys(keys, RadixSortPlan(key_bits=3, radix_bits=2, block=16, num_warps=1))
    assert sorted_keys.numel() == 0 and perm.numel() == 0 and perm.dtype == torch.int32


def test_refuses_what_it_cannot_sort():
    plan = RadixSortPlan(key_bits=5, radix_bits=2, block=16, num_warps=1)
    assert not radix_applies(torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="int32 keys"):
        sort_keys(torch.zeros(3, dtype=torch.int64), plan)
    for bits in (0, 32):
        with pytest.raises(ValueError, match="key_bits"):
            sort_keys(torch.zeros(3, dtype=torch.int32), RadixSortPlan(bits, 2, 16, 1))


def test_config_validates_the_sort_knobs():
    base = load_named("interpreter")
    import dataclasses

    def with_transpose(**changes):
        cfg = dataclasses.replace(base, transpose=dataclasses.replace(base.transpose, **changes))
        cfg.validate()

    with_transpose(sort="torch")
    with pytest.raises(ValueError, match="transpose.sort must be one of"):
        with_transpose(sort="cub")
    with pytest.raises(ValueError, match="sort_block must be a power of two"):
        with_transpose(sort_block=24)
    with pytest.raises(ValueError, match="sort_radix_bits"):
        with_transpose(sort_radix_bits=12, sort_block=2**20)
