"""The README's A/B job (torchrec_triton_tbe.torchrec_demo) on a tiny size: it runs, prints one row per
step with both losses, and reports a match."""

import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import plugin_cases  # noqa: F401  (imports the plugin before torchrec)
import torch
from torchrec_triton_tbe import torchrec_demo

ROOT = Path(__file__).resolve().parents[1]


def test_demo_ab_matches(capsys):
    rc = torchrec_demo.main(["--steps", "2", "--batch-size", "4", "--num-tables", "2", "--num-embeddings", "40",
                             "--sharding", "row_wise", "--index-dtype", "int32", "--hoist-transpose"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s+\d+\s", line)]
    assert [r[0] for r in rows] == ["0", "1"], out
    for _, loss_fused, loss_triton, *_ in rows:
        assert abs(float(loss_fused) - float(loss_triton)) < 1e-5, out
    assert "MATCH" in out and "MISMATCH" not in out


def test_a_run_gone_nan_or_infinite_is_a_mismatch():
    """The verdict's differences: NaN (Python's max() would drop it by argument order, and a MAX
    all-reduce may too) and equal infinities both count as +inf, so MATCH needs finite values."""
    nan, one, inf = ({"w": torch.tensor(v)} for v in ([float("nan"), 1.0], [0.5, 1.0], [math.inf, 1.0]))
    assert torchrec_demo._max_rel_diff(nan, one) == math.inf
    assert torchrec_demo._max_rel_diff(one, nan) == math.inf
    assert torchrec_demo._max_rel_diff(inf, inf) == math.inf
    assert torchrec_demo._max_rel_diff(one, {"w": torch.tensor([0.5, 2.0])}) == 1 / 3  # |1 - 2| / (1 + 2)
    assert torchrec_demo._inf_if_not_finite(float("nan")) == math.inf
    assert torchrec_demo._inf_if_not_finite(0.25) == 0.25


def test_the_verdicts_difference_is_taken_slice_by_slice(monkeypatch):
    """_max_rel_diff compares _DIFF_SLICE elements at a time (a whole production table in float64 ran an
    80 GB GPU out of memory): the same worst difference wherever it lies, 2-D tables, NaN in a later
    slice, and 0 for empty tables."""
    monkeypatch.setattr(torchrec_demo, "_DIFF_SLICE", 2)
    a = {"w": torch.zeros(3, 3), "e": torch.zeros(0)}
    b = {"w": torch.zeros(3, 3), "e": torch.zeros(0)}
    b["w"][2, 1] = 3.0  # the fourth slice of two
    assert torchrec_demo._max_rel_diff(a, b) == 3.0 / 4.0
    a["w"][2, 2] = float("nan")  # the last, one-element slice
    assert torchrec_demo._max_rel_diff(a, b) == math.inf
    assert torchrec_demo._max_rel_diff({"e": torch.zeros(0)}, {"e": torch.zeros(0)}) == 0.0


def test_demo_sequence_and_vbe_modes_match(capsys):
    """--sequence (an EmbeddingCollection beside the bags) and --vbe (variable batch per feature) together."""
    rc = torchrec_demo.main(["--steps", "2", "--batch-size", "4", "--num-tables", "2", "--num-embeddings", "40",
                             "--sequence", "--vbe"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "sequence_tables=1" in out and "vbe=" in out
    assert "MATCH" in out and "MISMATCH" not in out


def _rank_demo(rank: int, world_size: int, argv: list) -> None:
    import contextlib
    import io

    expect = argv[argv.index("--expect") + 1].split(",")
    demo_argv = argv[:argv.index("--expect")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = torchrec_demo.main(demo_argv)
    text = out.getvalue()
    assert rc == 0, text
    if rank == 0:  # rank 0 prints the table, every rank compares its own shards
        assert f"world_size={world_size}" in text and "MATCH" in text and "MISMATCH" not in text, text
        if "--replicas" in demo_argv:
            r = int(demo_argv[demo_argv.index("--replicas") + 1])
            assert f"{r} replicas x {world_size // r}-rank sharding groups" in text, text
            assert "replicas after the last sync(): bitwise identical" in text, text
        for kind in expect:
            assert f"={kind}@" in text, (kind, text)
    else:
        assert text == "", text


SMALL = ["--steps", "2", "--batch-size", "4", "--num-tables", "4", "--num-embeddings", "40"]


def test_demo_on_two_ranks_every_sharding_type_with_the_train_pipeline():
    """torchrun's case on two gloo ranks: TrainPipelineSparseDist (the default loop), the four sharding
    types at once (--sharding mixed), every rank's shards against fused's, checkpoints both ways."""
    argv = SMALL + ["--sharding", "mixed", "--expect", "table_wise,row_wise,column_wise,table_row_wise"]
    plugin_cases.spawn(_rank_demo, 2, argv)


def _two_dimensional_shardings(rank: int, world_size: int) -> None:
    for sharding in ("table_column_wise", "grid_shard"):
        _rank_demo(rank, world_size, SMALL + ["--sharding", sharding, "--loop", "plain", "--expect", sharding])


def test_demo_on_two_ranks_table_column_wise_and_grid():
    """--sharding table_column_wise / grid_shard (plugin.plans' generators: two column shards, or two
    column blocks each row-wise over both ranks), checked against fused on every rank."""
    plugin_cases.spawn(_two_dimensional_shardings, 2)


def test_demo_on_two_ranks_planner_plain_loop_with_sequence_tables():
    argv = SMALL + ["--sharding", "planner", "--loop", "plain", "--sequence", "--expect", "table_wise"]
    plugin_cases.spawn(_rank_demo, 2, argv)


def test_demo_refuses_tables_without_rows():
    import pytest

    with pytest.raises(SystemExit, match=r"--num-embeddings 2: some tables would get no rows .* give at least 3"):
        torchrec_demo.main(["--steps", "1", "--batch-size", "4", "--num-tables", "4", "--num-embeddings", "2"])


def _row_split_refusal(rank: int, world_size: int) -> None:
    import pytest

    # Rows 3, 1, 1, 3: two tables of fewer rows than ranks, whose row-wise shards are empty on rank 1.
    with pytest.raises(SystemExit, match=r"tables \['t1', 't2'\] get a shard of 0 rows on some of the 2 ranks"):
        torchrec_demo.main(["--steps", "1", "--batch-size", "4", "--num-tables", "4", "--num-embeddings", "3",
                            "--sharding", "row_wise", "--loop", "plain"])


def test_demo_refuses_row_split_tables_smaller_than_the_world_on_cpu():
    """FBGEMM's CPU TBE mis-trains the table after a 0-row shard (docs/torchrec.md): the A/B would report
    fused's error as a mismatch, so the demo refuses the plan on CPU ranks and says why."""
    plugin_cases.spawn(_row_split_refusal, 2)


def test_demo_on_several_ranks_without_master_port_is_refused_not_hung():
    """Ranks started by hand with WORLD_SIZE but no MASTER_PORT each picked a port of their own and waited."""
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    env.update(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="localhost")
    proc = subprocess.run([sys.executable, "-m", "torchrec_triton_tbe.torchrec_demo", "--steps", "1"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode != 0 and "MASTER_PORT is not set" in proc.stderr, proc.stderr[-2000:]


def test_shape_note_names_what_the_demo_does_not_take():
    """--shape takes rows, dims, bag sizes and Zipf exponents; a shape's other traits are named, unless the
    demo's own options give the same."""
    import types

    from torchrec_triton_tbe.bench.case import load_suite

    (shape,) = load_suite("smoke", {}, ["mixed_weighted_int32"])[1]
    args = types.SimpleNamespace(index_dtype="int64", weights="fp32")
    note = torchrec_demo._shape_note(shape.case, args)
    assert "per-sample weights" in note and "32-bit ids" in note, note
    args.index_dtype = "int32"
    assert "32-bit ids" not in torchrec_demo._shape_note(shape.case, args)


def test_demo_on_production_shaped_tables(tmp_path, capsys):
    """--shape: a suite shape's per-table rows, dims, bag sizes (drawn with the shape's sigmas) and Zipf
    exponents (here a tiny suite of three tables of different dims, one uniform), the concatenating
    model, the train pipeline."""
    import types

    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    suite = tmp_path / "tiny.yaml"
    suite.write_text(
        "name: tiny\nshapes:\n"
        "  - name: prod_tiny\n    num_tables: 3\n    batch_size: 4\n"
        "    num_embeddings_list: [50, 7, 300]\n    embedding_dim_list: [8, 12, 4]\n"
        "    bag_size_list: [3, 1, 5]\n    bag_size_sigma_list: [2, 0, 3]\n    alpha_list: [1.15, 1.0, 1.15]\n")
    # The sigmas reach the batches: sigma 0 gives every bag its table's size, the others vary.
    configs = [EmbeddingBagConfig(name=f"t{k}", embedding_dim=8, num_embeddings=50, feature_names=[f"f{k}"])
               for k in range(2)]
    kjt = torchrec_demo._kjt(configs, types.SimpleNamespace(batch_size=64, bag_size=0, alpha=1.0),
                             torch.Generator().manual_seed(0), torch.int64, False, [3, 3], [1.0, 1.0], [0, 2])
    fixed, drawn = kjt.lengths().view(2, 64)
    assert (fixed == 3).all() and len(set(drawn.tolist())) > 2 and (drawn >= 0).all()
    rc = torchrec_demo.main(["--shape", "prod_tiny", "--suite", str(suite), "--steps", "2", "--sharding", "mixed"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "tables=3 shape=prod_tiny" in out and "dims 4..12" in out and "B=4" in out, out
    assert "loop=TrainPipelineSparseDist" in out and "MATCH" in out and "MISMATCH" not in out, out


def test_demo_with_fp16_tables(capsys):
    """--weights fp16: both kernels hold fp16 tables (and round each update stochastically on their own):
    they agree within four fp16 ulps, and the round trip of checkpoints stays exact."""
    rc = torchrec_demo.main(SMALL + ["--weights", "fp16", "--sharding", "table_wise", "--no-precompile"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "weights=fp16" in out and "tolerance 2e-03" in out and "MATCH" in out and "MISMATCH" not in out, out
    # --no-precompile (the plugin's precompile is on by default): no module precompiled
    assert "precompile=False" in out and not any(line.startswith("precompile: ") for line in out.splitlines()), out
    assert "largest difference 0.0e+00" in out, out


def test_demo_with_precompile_reports_each_kernels_precompile(capsys):
    """precompile, on by default in the plugin and the demo: each Triton kernel module's first training
    step precompiles (under the interpreter it compiles nothing, and the demo's line says so); training
    matches as without it."""
    rc = torchrec_demo.main(SMALL + ["--sharding", "table_wise"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "precompile=True" in out and "MATCH" in out and "MISMATCH" not in out, out
    lines = [line for line in out.splitlines() if line.startswith("precompile: ")]
    # One line per kernel module: SMALL's SUM and MEAN tables are two groups.
    assert len(lines) == 2 and all(
        re.fullmatch(r"precompile: \d+ specializations, nothing compiled \(Triton's interpreter\)", line)
        for line in lines), out


def test_demo_profile_tool_runs_as_the_device_session_calls_it(tmp_path):
    """tools/demo_profile.py as `tools/device_session.sh demo-prod` runs it (a suite shape, a batch size,
    fp16 tables, --json), here on a tiny suite on the CPU: it once reached the device broken."""
    suite = tmp_path / "tiny.yaml"
    suite.write_text(
        "name: tiny\nshapes:\n"
        "  - name: prod_tiny\n    num_tables: 3\n    batch_size: 8\n"
        "    num_embeddings_list: [50, 7, 300]\n    embedding_dim_list: [8, 12, 4]\n"
        "    bag_size_list: [3, 1, 5]\n    alpha_list: [1.15, 1.0, 1.15]\n")
    out = tmp_path / "profile.json"
    # A fresh process of its own, as on the device: not the rendezvous variables the in-process demo
    # tests left in this process's environment (their port may still be held here).
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "demo_profile.py"), "--shape", "prod_tiny", "--suite", str(suite),
         "--batch-size", "4", "--weights", "fp16", "--steps", "2", "--cprofile", "1", "--pipeline-rounds", "2",
         "--pipeline-block", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["args"]["weights"] == "fp16" and res["args"]["batch_size"] == 4
    assert res["interleaved_steps"] == 2 and res["fused_over_triton_median"] > 0
    for name in ("fused", "triton"):
        assert len(res[name]["ms"]) == 2 and res[name]["host"], name
        own = res["cprofile_own_ms_per_step"][name]
        assert own["total"] > 0 and own["top"], name
        assert 0 < res[name]["issue_median_ms"] and len(res[name]["issue_ms"]) == 2, name
    assert res["cprofile_own_ms_per_step"]["triton"]["in_torchrec_triton_tbe"] > 0
    assert res["graphs_after_timing"] == [[0, 0]]  # one module of ours, no graphs on a CPU
    diff = [v for _, v in res["cprofile_own_ms_per_step"]["triton_minus_fused"]]
    assert diff and [abs(v) for v in diff] == sorted((abs(v) for v in diff), reverse=True)
    pipe = res["pipeline"]  # the pipelined loop's rounds, on two more models
    assert (pipe["rounds"], pipe["block"], pipe["pinned"]) == (2, 2, False) and pipe["fused_over_triton_median"] > 0
    for name in ("fused", "triton"):
        assert len(pipe[name]["ms"]) == 2 and 0 < pipe[name]["median_ms"] == statistics.median(pipe[name]["ms"])


def test_demo_profile_pinned_batches_need_a_gpu():
    """--pipeline-pinned on a machine without CUDA: refused up front, before any model is built."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "demo_profile.py"), "--pipeline-rounds", "1",
                           "--pipeline-pinned"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0 and "pinned host memory needs CUDA" in proc.stderr, proc.stderr[-2000:]


def test_demo_in_train_pipeline_base_matches(capsys):
    """--loop base: TorchRec's TrainPipelineBase (batch copy overlapped, no pipelined input dist)."""
    rc = torchrec_demo.main(SMALL + ["--loop", "base", "--sharding", "table_wise"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "loop=TrainPipelineBase" in out and "MATCH" in out and "MISMATCH" not in out, out


def test_demo_semi_sync_needs_a_gpu():
    import pytest

    with pytest.raises(SystemExit, match="TrainPipelineSemiSync needs CUDA streams"):
        torchrec_demo.main(SMALL + ["--loop", "semi-sync"])


def _torchrun(target: list) -> str:
    # torchrun itself, as docs/torchrec.md has users launch it: its env:// rendezvous, LOCAL_RANK, etc.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master-port",
           str(plugin_cases.free_port()), *target] + SMALL + ["--sharding", "mixed"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def test_torchrun_launches_one_two_rank_job():
    out = _torchrun(["-m", "torchrec_triton_tbe.torchrec_demo"])
    assert out.count("world_size=2") == 1 and "MATCH" in out and "MISMATCH" not in out, out
    # Throughput counts both ranks' batches (SMALL: 4 examples per rank and step) over the slowest rank's step.
    m = re.search(r"fused ([\d.]+), triton ([\d.]+); examples/s over 2 rank\(s\): fused ([\d,]+), triton ([\d,]+)", out)
    assert m, out
    ms_f, ms_o, ex_f, ex_o = (float(v.replace(",", "")) for v in m.groups())
    for ms, ex in ((ms_f, ex_f), (ms_o, ex_o)):
        assert abs(ex - 2 * 4 * 1e3 / ms) <= 0.02 * ex + 1, (ms, ex, out)


def test_torchrun_launches_the_console_script():
    import shutil
    import sys
    from pathlib import Path

    script = shutil.which("torchrec-triton-tbe-torchrec-demo") or str(Path(sys.executable).parent / "torchrec-triton-tbe-torchrec-demo")
    assert Path(script).exists(), "the console script is not installed (pip install -e .)"
    out = _torchrun([script])
    assert out.count("world_size=2") == 1 and "MATCH" in out and "MISMATCH" not in out, out


def _two_d_demo(rank: int, world_size: int, argv: list) -> None:
    # TorchRec's DMPCollection asserts CUDA: the demo takes the CPU stand-in tests use (plugin_cases).
    torchrec_demo.DMP_COLLECTION_CLASS = plugin_cases.cpu_dmp_collection()
    _rank_demo(rank, world_size, argv)


def test_demo_2d_parallel_two_replicas_of_one_rank():
    """--replicas 2 on 2 ranks: DMPCollection, one-rank sharding groups, sync() after every step."""
    argv = SMALL + ["--replicas", "2", "--sharding", "mixed", "--expect", "table_wise,row_wise"]
    plugin_cases.spawn(_two_d_demo, 2, argv)


def test_demo_2d_parallel_two_replicas_of_two_rank_groups_every_sharding_type():
    argv = SMALL + ["--replicas", "2", "--sharding", "mixed", "--expect", "table_wise,row_wise,column_wise,table_row_wise"]
    plugin_cases.spawn(_two_d_demo, 4, argv)


def test_demo_2d_parallel_needs_gpus_or_a_divisor():
    import pytest

    with pytest.raises(SystemExit, match="must divide the world size"):
        torchrec_demo.main(SMALL + ["--replicas", "2"])
