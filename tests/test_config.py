"""configs/*.yaml: every shipped config loads and validates; bad knobs are rejected with the knob
named; selection by name, path, environment variable; knob tables fall back to their default."""

import pytest
import torch
import yaml

import types

from torchrec_triton_tbe.config import (
    KnobTable,
    KernelConfig,
    config_dir,
    load_config,
    load_named,
    resident_programs,
    tile_warps,
)


@pytest.mark.parametrize("name", ["interpreter", "sm90", "sm100"])
def test_shipped_configs_load(name):
    cfg = load_named(name)
    assert cfg.target == name
    assert cfg.backward.short_threshold >= 1 and cfg.backward.long_chunk >= 1


def test_sm100_is_marked_untuned():
    assert load_named("sm100").tuned is False
    assert "UNTUNED" in (config_dir() / "sm100.yaml").read_text()


def test_knob_table_lookup():
    t = KnobTable.parse({"default": 4, 128: 2}, "x")
    assert t.get(128) == 2 and t.get(64) == 4
    assert KnobTable.parse(8, "x").get(1024) == 8


@pytest.mark.parametrize(
    "patch,match",
    [
        (("forward", "gather", {"default": 3}), "forward.gather values must be powers of two"),
        (("forward", "bag_lanes", {"default": 1, 32: 6}), "forward.bag_lanes values must be powers of two"),
        (("forward", "bag_lanes", {"default": 0}), "forward.bag_lanes values must be powers of two"),
        (("forward", "bag_lanes_fp32", {"default": 3}), "forward.bag_lanes_fp32 values must be powers of two"),
        (("backward", "short_threshold", 0), "short_threshold must be >= 1"),
        (("backward", "long_path", "atomic"), "backward.long_path must be one of"),
        (("backward", "waves", -1), "backward.waves must be >= 0"),
        (("backward", "tile", {128: 4}), "needs a 'default' entry"),
        (("backward", "tile_fp32", {"default": 4, 128: 6}), "backward.tile_fp32 values must be powers of two"),
        (("backward", "long_tile", {"default": 4, 128: 3}), "backward.long_tile values must be powers of two"),
        (("backward", "long_warps", 0), "backward.long_warps values must be powers of two"),
        (("backward", "apply_tile", {"default": 8, 128: 24}), "backward.apply_tile values must be powers of two"),
        (("backward", "apply_warps", 3), "backward.apply_warps values must be powers of two"),
        (("backward", "apply_scan", 0), "backward.apply_scan values must be powers of two"),
        (("backward", "max_registers", {"default": 0, 128: 100}), "backward.max_registers values must be 0"),
        (("backward", "max_registers", 256), "backward.max_registers values must be 0"),
        (("backward", "max_registers", 16), "backward.max_registers values must be 0"),
        (("transpose", "lookups_per_step", 12), "transpose.lookups_per_step must be a power of two"),
        (("forward", "bucket_streams", 0), "forward.bucket_streams must be >= 1"),
        (("forward", "short_bag_max_lanes", 6), "forward.short_bag_max_lanes must be 0 .off. or a power of two"),
        (("forward", "bucket_streams_min_lookups", -1), "forward.bucket_streams_min_lookups must be >= 0"),
        (("backward", "bucket_streams", 0), "backward.bucket_streams must be >= 1"),
        (("backward", "bucket_streams_min_lookups", -1), "backward.bucket_streams_min_lookups must be >= 0"),
        (("backward", "split_paths", 2), "backward.split_paths must be true or false"),
        (("backward", "split_paths", "yes"), "backward.split_paths must be true or false"),
        (("backward", "split_paths_min_lookups", -1), "backward.split_paths_min_lookups must be >= 0"),
        (("backward", "split_paths_max_lookups", -1), "backward.split_paths_max_lookups must be >= 0"),
        (("backward", "split_heaviest", "no"), "backward.split_heaviest must be true or false"),
        (("backward", "split_heaviest_max_lookups", -1), "backward.split_heaviest_max_lookups must be >= 0"),
        (("small_table", "positions", 24), "small_table.positions must be a power of two >= 16"),
        (("small_table", "apply_chunks", 6), "small_table.apply_chunks a power of two"),
        (("small_table", "backward_groups", 0), "small_table.backward_groups must be >= 1"),
        (("small_table", "forward", 2), "small_table.forward and small_table.backward must be 0 or 1"),
        (("small_table", "num_warps", 8), "small_table.num_warps must be at most 4"),
        (("small_table", "backward_min_bag", -1), "small_table.backward_min_bag and small_table.backward_min_batch"),
        (("small_table", "backward_min_batch", -2), "small_table.backward_min_bag and small_table.backward_min_batch"),
    ],
)
def test_bad_knobs_are_rejected(patch, match, tmp_path):
    doc = yaml.safe_load((config_dir() / "interpreter.yaml").read_text())
    section, key, value = patch
    doc[section][key] = value
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ValueError, match=match):
        load_named(str(path))


@pytest.mark.parametrize("section,key", [("forward", "gathers"), ("transpose", "run_blocks"),
                                         ("backward", "graph_max_lookup"), ("small_table", "min_bag"), (None, "smal_table")])
def test_unknown_keys_are_rejected_not_dropped(section, key, tmp_path):
    # A misspelt knob must not silently fall back to its default.
    doc = yaml.safe_load((config_dir() / "interpreter.yaml").read_text())
    (doc if section is None else doc[section])[key] = 1
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ValueError, match=rf"unknown .*keys \['{key}'\]"):
        load_named(str(path))


def test_selection_order(monkeypatch, tmp_path):
    cpu = torch.device("cpu")
    assert load_config(cpu).target == "interpreter"
    monkeypatch.setenv("TORCHREC_TRITON_TBE_CONFIG", "sm90")
    assert load_config(cpu).target == "sm90"
    explicit = load_named("sm100")
    assert load_config(cpu, explicit) is explicit
    assert load_config(cpu, "interpreter").target == "interpreter"
    monkeypatch.setenv("TORCHREC_TRITON_TBE_CONFIG", "no-such-target")
    with pytest.raises(FileNotFoundError, match="no-such-target"):
        load_config(cpu)


def test_tile_warps_caps_replication():
    assert tile_warps(8, 16 * 128) == 8
    assert tile_warps(4, 8 * 32) == 1
    assert tile_warps(4, 32 * 8) == 1
    assert tile_warps(2, 64 * 8) == 2


def test_replace_helpers_keep_the_rest():
    cfg = load_named("interpreter")
    other = cfg.replace_backward(short_threshold=7)
    assert isinstance(other, KernelConfig) and other.backward.short_threshold == 7
    assert other.forward == cfg.forward and other.transpose == cfg.transpose


def test_long_path_knobs_fall_back_to_the_short_kernels(tmp_path):
    # Without long_tile / long_warps the long path takes the short kernel's tile (by weight width) and warps.
    bwd = load_named("interpreter").backward
    assert bwd.long_tile is None and bwd.long_warps is None
    assert bwd.long_knobs(16, 2) == (bwd.tiles(16, 2), bwd.num_warps.get(16))
    doc = yaml.safe_load((config_dir() / "interpreter.yaml").read_text())
    doc["backward"]["long_tile"] = {"default": 2, 128: 16}
    doc["backward"]["long_warps"] = {"default": 1, 128: 4}
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(doc))
    bwd = load_named(str(path)).backward
    # One table for every weight width: the partials kernel reads fp32 gradients, never weights.
    assert bwd.long_knobs(128, 2) == bwd.long_knobs(128, 4) == (16, 4)
    assert bwd.long_knobs(64, 4) == (2, 1)


def test_apply_knobs_fall_back_to_the_long_paths(tmp_path):
    # Without apply_tile / apply_warps the apply takes the long path's tile and warps; it scans one chunk
    # at a time unless apply_scan says more.
    bwd = load_named("interpreter").backward
    assert (bwd.apply_tile, bwd.apply_warps, bwd.apply_scan) == (None, None, 1)
    assert bwd.apply_knobs(128, 4) == bwd.long_knobs(128, 4)
    doc = yaml.safe_load((config_dir() / "interpreter.yaml").read_text())
    doc["backward"]["apply_tile"] = {"default": 4, 128: 32}
    doc["backward"]["apply_warps"] = {"default": 1, 128: 4}
    doc["backward"]["apply_scan"] = 64
    path = tmp_path / "apply.yaml"
    path.write_text(yaml.safe_dump(doc))
    bwd = load_named(str(path)).backward
    assert bwd.apply_knobs(128, 2) == bwd.apply_knobs(128, 4) == (32, 4)
    assert bwd.apply_knobs(64, 4) == (4, 1) and bwd.apply_scan == 64


def test_short_kernel_register_cap_by_block_d(tmp_path):
    # No table, or 0 at a width: no cap (Triton's maxnreg left out of the launch).
    bwd = load_named("interpreter").backward
    assert bwd.max_registers is None and bwd.short_maxnreg(128) is None
    doc = yaml.safe_load((config_dir() / "interpreter.yaml").read_text())
    doc["backward"]["max_registers"] = {"default": 0, 128: 96, 256: 128}
    path = tmp_path / "regs.yaml"
    path.write_text(yaml.safe_dump(doc))
    bwd = load_named(str(path)).backward
    assert (bwd.short_maxnreg(64), bwd.short_maxnreg(128), bwd.short_maxnreg(256)) == (None, 96, 128)


def test_bags_per_program_by_block_d(tmp_path):
    # A table by BLOCK_D (sm90: one group per program at 32 and 64) or one int for every width, as before.
    fwd = load_named("sm90").forward
    assert [fwd.knobs(d, 2, 1 << 16)[0] for d in (16, 32, 64, 128)] == [2, 1, 1, 2]
    assert fwd.knobs(32, 2, 16)[0] == fwd.bags_per_program_small  # small batches keep their own knob
    assert load_named("interpreter").forward.bags_per_program == KnobTable(2)
    assert load_named("sm90").replace_forward(bags_per_program=3).forward.bags_per_program == KnobTable(3)
    doc = yaml.safe_load((config_dir() / "interpreter.yaml").read_text())
    doc["forward"]["bags_per_program"] = {"default": 2, 64: 0}
    path = tmp_path / "bad_bags.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ValueError, match="forward.bags_per_program values must be >= 1"):
        load_named(str(path))


def test_sequence_block_defaults_to_what_triton_3_6_compiles(tmp_path):
    # A config without sequence_block takes 32, as the shipped GPU configs do: Triton 3.6 (torch 2.11's)
    # fails to compile the sequence kernel at 16 (measured on the H200 and by tools/compile_specs.py).
    doc = yaml.safe_load((config_dir() / "sm90.yaml").read_text())
    del doc["forward"]["sequence_block"]
    path = tmp_path / "no_sequence_block.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert load_named(str(path)).forward.sequence_block == 32
    for name in ("sm90", "sm100"):
        assert load_named(name).forward.sequence_block >= 32


def test_bag_lanes_default_to_the_sequential_path(tmp_path):
    # Configs written before the lanes mode have no bag_lanes: every width pools one bag at a time.
    doc = yaml.safe_load((config_dir() / "interpreter.yaml").read_text())
    del doc["forward"]["bag_lanes"]
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert load_named(str(path)).forward.bag_lanes == KnobTable(1)
    sm90 = load_named("sm90").forward.bag_lanes
    assert sm90.get(32) > 1 and sm90.get(64) > 1 and sm90.get(128) == 2  # lanes where they were measured to win
    fwd = load_named("sm90").forward
    assert fwd.lanes(128, 2) == fwd.lanes(128, 4) == 2  # no fp32 table on the H200 (measured alike)
    assert load_named(str(path)).forward.lanes(32, 4) == 1  # no fp32 table: bag_lanes
    doc["forward"]["bag_lanes"] = {"default": 4}
    doc["forward"]["bag_lanes_fp32"] = {"default": 1, 128: 2}
    lanes_fp32 = tmp_path / "lanes_fp32.yaml"
    lanes_fp32.write_text(yaml.safe_dump(doc))
    fwd = load_named(str(lanes_fp32)).forward
    assert (fwd.lanes(32, 4), fwd.lanes(128, 4), fwd.lanes(32, 2)) == (1, 2, 4)  # 4-byte rows read the fp32 table
    bwd = load_named("sm90").backward
    assert bwd.tiles(128, 4) == 2 < bwd.tiles(128, 2) == 8  # fp32 rows: fewer runs per tile (measured)
    assert load_named(str(path)).backward.tiles(128, 4) == load_named(str(path)).backward.tiles(128, 2)
    # A config without long_path keeps the split (atomic-free) schedule.
    del doc["backward"]["long_path"]
    path.write_text(yaml.safe_dump(doc))
    assert load_named(str(path)).backward.long_path == "split"
    assert load_named("interpreter").forward.bag_lanes.get(16) > 1  # the CPU tests run the lanes path


H200 = types.SimpleNamespace(
    major=9, max_threads_per_multi_processor=2048, regs_per_multiprocessor=65536,
    shared_memory_per_multiprocessor=233472,
)


@pytest.mark.parametrize(
    "n_regs,num_warps,shared,expected",
    [
        (154, 1, 1024, 12),  # the short-run kernel at D=128: registers bound (5,120 per warp)
        (224, 1, 0, 8),  # 7,168 per warp: two per 16,384-register partition (Nsight Compute: 8)
        (166, 1, 0, 12),  # Nsight Compute: 12
        (32, 1, 0, 32),  # the block limit
        (64, 4, 0, 8),  # 2,048 registers per warp x 4 warps
        (32, 8, 0, 8),  # the warp limit: 64 warps per SM
        (32, 1, 100_000, 2),  # shared memory (+1 KiB reserved per block)
    ],
)
def test_resident_programs(n_regs, num_warps, shared, expected):
    assert resident_programs(n_regs, num_warps, shared, H200) == expected


@pytest.mark.parametrize("value,expected", [(True, True), (False, False), (1, True), (0, False), (None, False)])
def test_split_paths_reads_yaml_booleans(value, expected, tmp_path):
    doc = yaml.safe_load((config_dir() / "interpreter.yaml").read_text())
    if value is None:
        doc["backward"].pop("split_paths", None)  # absent: off
    else:
        doc["backward"]["split_paths"] = value
    path = tmp_path / "split.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert load_named(str(path)).backward.split_paths is expected


def test_waves_default_off():
    assert load_named("interpreter").backward.waves == 0
    assert load_named("sm90").backward.waves >= 1


def test_precompile_order_names_kernels_of_the_package(tmp_path):
    """compile_first names @triton.jit kernels of torchrec_triton_tbe.kernels (a typo would silently
    never match); malformed sections are refused with the knob named."""
    import importlib
    import pkgutil

    import torchrec_triton_tbe.kernels as kernels_pkg

    names = set()
    for info in pkgutil.iter_modules(kernels_pkg.__path__):
        mod = importlib.import_module(f"{kernels_pkg.__name__}.{info.name}")
        names |= {n for n, v in vars(mod).items() if hasattr(v, "fn") and hasattr(v, "run")}
    for name in ("sm90", "sm100"):
        first = load_named(name).precompile.compile_first
        assert first and set(first) <= names, (name, sorted(set(first) - names))
    assert load_named("interpreter").precompile.compile_first == ()
    doc = yaml.safe_load((config_dir() / "interpreter.yaml").read_text())
    for section, match in (({"compile_first": "_backward_short_kernel"}, "must be a list of kernel names"),
                           ({"first": []}, "unknown precompile keys"),
                           ({"load_threads": -1}, "load_threads must be an int >= 0"),
                           ({"load_threads": 1.5}, "load_threads must be an int >= 0"),
                           ({"max_workers": -2}, "max_workers must be an int >= 0")):
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump({**doc, "precompile": section}))
        with pytest.raises(ValueError, match=match):
            load_named(str(path))
