"""tools/config_variants.py: variant kernel configs for A/B device runs change exactly the knobs named,
load as valid configs, and refuse a knob the config does not have (the loader would ignore it)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import config_variants  # noqa: E402
from torchrec_triton_tbe.config import KnobTable, load_named  # noqa: E402

BASE = Path(__file__).resolve().parent.parent / "configs" / "sm90.yaml"


def test_writes_the_changed_knobs_only(tmp_path):
    paths = config_variants.write_variants(
        BASE, str(tmp_path / "v_"),
        ["chunk=backward.long_chunk:128,transpose.run_block:512", "tile=backward.tile:{default: 8, 64: 4}"],
    )
    assert [p.name for p in paths] == ["v_chunk.yaml", "v_tile.yaml"]
    base, chunk, tile = load_named(str(BASE)), load_named(str(paths[0])), load_named(str(paths[1]))
    assert chunk.backward.long_chunk == 128 and chunk.transpose.run_block == 512
    assert chunk.forward == base.forward and chunk.small_table == base.small_table
    assert tile.backward.tile == KnobTable.parse({"default": 8, 64: 4}, "t")
    assert tile.backward.long_chunk == base.backward.long_chunk


def test_one_entry_of_a_per_width_table(tmp_path):
    """section.key.entry:value changes one width's entry and keeps the table's others (a space-free
    argument, as tools/device_session.sh's VARIANTS list needs); a knob that is no table is refused."""
    (path,) = config_variants.write_variants(
        BASE, str(tmp_path / "v_"), ["d4=forward.gather.4:2,forward.bag_lanes.4:2"])
    base, var = load_named(str(BASE)), load_named(str(path))
    assert var.forward.gather.get(4) == 2 and var.forward.bag_lanes.get(4) == 2
    for width in (8, 16, 32, 64, 128, 256):
        assert var.forward.gather.get(width) == base.forward.gather.get(width)
        assert var.forward.bag_lanes.get(width) == base.forward.bag_lanes.get(width)
    assert (base.forward.gather.get(4), base.forward.bag_lanes.get(4)) != (2, 2)  # a change, not the base again
    with pytest.raises(ValueError, match="not a per-width table"):
        config_variants.write_variants(BASE, str(tmp_path / "w_"), ["x=backward.long_chunk.64:64"])


@pytest.mark.parametrize("arg,match", [
    ("x=backward.merge_duplicates:true", "backward has no knob 'merge_duplicates'"),
    ("x=backwards.long_chunk:4", "unknown section 'backwards'"),
    ("x=backward.long_chunk", "is not section.key:value"),
    ("backward.long_chunk:4", "expected name="),
])
def test_refuses_unknown_knobs_and_bad_syntax(tmp_path, arg, match):
    with pytest.raises(ValueError, match=match):
        config_variants.write_variants(BASE, str(tmp_path / "v_"), [arg])


def test_a_written_config_is_validated(tmp_path):
    with pytest.raises(ValueError, match="run_block must be a power of two"):
        config_variants.write_variants(BASE, str(tmp_path / "v_"), ["bad=transpose.run_block:24"])
