"""Plan options: their fused_params form (hashable, groupable), the round trip to the kernel, and
their validation. That each option never changes results is proven by the A/B tests in
test_plugin_sharding.py and test_plugin_lookup.py."""

import pytest
import torch

import plugin_cases  # noqa: F401  (imports the plugin before torchrec)
from torchrec_triton_tbe.config import load_config
from torchrec_triton_tbe.plugin.options import (
    CHECK_FINITE_KEY,
    PRECOMPILE_KEY,
    FUSED_BOUNDS_CHECK_KEY,
    HOIST_TRANSPOSE_KEY,
    INDEX_TYPE_KEY,
    KERNEL_CONFIG_KEY,
    MARKER,
    MARKER_KEY,
    OFFSET_TYPE_KEY,
    TritonTBEOptions,
    is_triton_tbe,
    reject_plugin_keys,
)

ALL = TritonTBEOptions(
    index_dtype=torch.int32, fused_bounds_check=True, hoist_transpose=True, kernel_config="interpreter",
    check_finite=True, precompile=False,
)


def test_defaults_keep_torchrec_keys_untouched():
    params = TritonTBEOptions().to_fused_params()
    assert params == {
        MARKER_KEY: MARKER, FUSED_BOUNDS_CHECK_KEY: False, HOIST_TRANSPOSE_KEY: False, KERNEL_CONFIG_KEY: None,
        CHECK_FINITE_KEY: False, PRECOMPILE_KEY: True,
    }
    assert INDEX_TYPE_KEY not in params and OFFSET_TYPE_KEY not in params


def test_index_dtype_sets_both_torchrec_keys():
    params = TritonTBEOptions(index_dtype=torch.int32).to_fused_params()
    assert params[INDEX_TYPE_KEY] is torch.int32 and params[OFFSET_TYPE_KEY] is torch.int32


@pytest.mark.parametrize("options", [TritonTBEOptions(), ALL, TritonTBEOptions(kernel_config=load_config(
    torch.device("cpu"), "sm90"))], ids=["default", "all", "KernelConfig"])
def test_fused_params_are_groupable(options):
    # TorchRec's grouping key is tuple(sorted(fused_params.items())): it must hash, be equal for equal
    # options (one kernel for those tables) and differ otherwise.
    def key(o):
        return tuple(sorted(o.to_fused_params().items()))

    assert isinstance(hash(key(options)), int)
    assert key(options) == key(TritonTBEOptions(**{f: getattr(options, f) for f in options.__dataclass_fields__}))
    assert key(options) != key(TritonTBEOptions(hoist_transpose=not options.hoist_transpose))


def test_pop_from_round_trip_leaves_torchrec_keys():
    params = dict(ALL.to_fused_params(), learning_rate=0.1)
    assert is_triton_tbe(params)
    assert TritonTBEOptions.pop_from(params) == ALL
    assert params == {"learning_rate": 0.1, INDEX_TYPE_KEY: torch.int32, OFFSET_TYPE_KEY: torch.int32}
    assert not is_triton_tbe(params)


def test_pop_from_refuses_other_markers():
    with pytest.raises(ValueError, match="not a Triton TBE group"):
        TritonTBEOptions.pop_from({MARKER_KEY: "other_plugin"})


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(index_dtype=torch.int16), ValueError),
        (dict(index_dtype=torch.float32), ValueError),
        (dict(fused_bounds_check=1), TypeError),
        (dict(hoist_transpose="yes"), TypeError),
        (dict(check_finite=None), TypeError),
        (dict(precompile=1), TypeError),
        (dict(kernel_config={"forward": {}}), TypeError),
    ],
)
def test_invalid_options(kwargs, error):
    with pytest.raises(error, match="TritonTBEOptions"):
        TritonTBEOptions(**kwargs)


def test_plugin_keys_rejected_from_sharder_level_fused_params():
    reject_plugin_keys({"learning_rate": 0.1, INDEX_TYPE_KEY: torch.int32}, "here")  # TorchRec keys are fine
    with pytest.raises(ValueError, match="reach FBGEMM"):
        reject_plugin_keys({HOIST_TRANSPOSE_KEY: True}, "here")
