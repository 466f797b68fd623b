"""The A/B benchmark harness (torchrec_triton_tbe.bench) on CPU: options mirror FBGEMM's benchmark,
FBGEMM's byte model and log format, the generator statistics, suites, and the CLI end to end on the
smoke suite under Triton's interpreter (times there are meaningless; the structure is what's tested)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
import time

import numpy as np
import pytest
import torch

import torchrec_triton_tbe  # noqa: F401  (sets TRITON_INTERPRET before kernels load)
from torchrec_triton_tbe.bench import cli, peers
from torchrec_triton_tbe.bench.batches import generate_requests, generator_stats, make_workload, run_lengths
from torchrec_triton_tbe.bench.case import (
    BenchCase,
    build_parser,
    case_from_mapping,
    check_fbgemm_only_options,
    device_with_spec_options,
    explicit_options,
    load_suite,
    resolve_optimizers,
)
from torchrec_triton_tbe.bench.report import gbps, log_line, merge, parse_log_line, read_write_bytes, spec_log_line
from torchrec_triton_tbe.bench.runner import RunOptions
from torchrec_triton_tbe.bench.timing import time_steps

logging.getLogger("fbgemm_gpu").setLevel(logging.ERROR)


# ------------------------------------------------------------------------------------------ options
def test_defaults_mirror_fbgemm_benchmark_options():
    """Every option FBGEMM's `device` command shares with us has the same spelling and default
    (read from FBGEMM's own click interface), and `device`'s own options match its source."""
    import click  # FBGEMM's benchmark CLI is built on it (requirements-cpu.txt)
    from fbgemm_gpu.tbe.bench import TbeBenchClickInterface as Fbgemm

    @click.command()
    @Fbgemm.common_options
    @Fbgemm.device_options
    @Fbgemm.table_options
    def device(**_):  # pragma: no cover - never invoked
        pass

    ours = {a.option_strings[0]: a for a in build_parser()._actions if a.option_strings}
    ours_args = build_parser().parse_args([])
    checked = 0
    for param in device.params:
        if param.name == "row_wise":  # FBGEMM: --row-wise (default) = EXACT_ROWWISE_ADAGRAD
            assert param.default is True and ours_args.optimizers == ("exact_rowwise_adagrad",)
            assert "--row-wise" in ours and "--no-row-wise" in ours["--row-wise"].option_strings
            continue
        assert param.opts[0] in ours, f"missing FBGEMM option {param.opts[0]}"
        default = getattr(param.default, "value", param.default)  # SparseType.FP32 -> "fp32"
        assert getattr(ours_args, param.name) == default, param.name
        checked += 1
    assert checked == 19  # managed, cache_precision and tables too: accepted at FBGEMM's default only
    # The `device` command's own options (FBGEMM source): output fp32, indices 64, num-requests -1.
    assert (ours_args.output_dtype, ours_args.indices_dtype, ours_args.num_requests) == ("fp32", 64, -1)
    assert BenchCase().requests_count == 100  # -1 means one batch per iteration, as FBGEMM


def test_option_handling():
    parser = build_parser()
    argv = ["--iters", "7", "--weighted", "--optimizer", "exact_sgd,exact_rowwise_adagrad"]
    assert explicit_options(parser, argv) == {
        "iters": 7, "weighted": True, "optimizers": ("exact_sgd", "exact_rowwise_adagrad")}
    # FBGEMM's --row-wise / --no-row-wise select row-wise Adagrad / EXACT_ADAGRAD; contradicting --optimizer exits.
    args = build_parser().parse_args(["--no-row-wise"])
    assert resolve_optimizers(args, explicit_options(build_parser(), ["--no-row-wise"])) == ("exact_adagrad",)
    with pytest.raises(SystemExit):
        cli.main(["--row-wise", "--optimizer", "exact_sgd"])
    with pytest.raises(SystemExit):
        cli.main(["--no-row-wise", "--optimizer", "adam"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--optimizer", "shampoo"])
    with pytest.raises(SystemExit):
        cli.main(["--check"])  # needs --compare fbgemm
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--pooling", "max"])
    with pytest.raises(ValueError, match="one embedding dim"):
        BenchCase(pooling="none", mixed=True)
    with pytest.raises(ValueError, match="batch_size_list has 2 entries for 3 tables"):
        BenchCase(num_tables=3, batch_size_list=(4, 4))
    with pytest.raises(ValueError, match="embedding_dim_list"):
        BenchCase(num_tables=2, embedding_dim_list=(8, 8, 8))
    # Lists of the wrong length are named, not an IndexError of the per-table checks after them.
    with pytest.raises(ValueError, match="alpha_list has 1 entries for 32 tables"):
        BenchCase(bag_size_list=(2,) * 32, alpha_list=(1.2,))
    # FBGEMM's rules and spellings: D a multiple of 4, pooling in any case, BoundsCheckMode 0-6.
    with pytest.raises(ValueError, match="multiple of 4"):
        BenchCase(embedding_dim=6)
    assert build_parser().parse_args(["--pooling", "SUM"]).pooling == "sum"
    assert BenchCase(bounds_check_mode=5).bounds_check_mode == 5  # V2_WARNING
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--bounds-check-mode", "7"])


def test_fbgemm_only_options_are_accepted_at_their_defaults_and_refused_otherwise():
    """FBGEMM's `device` options for caches, UVM, SSD, the dense module, request files and traces: a
    command line that leaves them at FBGEMM's defaults (or sets what FBGEMM reads only with a cache)
    runs; one that asks for them is refused with the reason, as an error of the command line."""
    def refused(argv):
        return check_fbgemm_only_options(build_parser().parse_args(argv))

    for argv in ([], ["--managed", "DEVICE"], ["--cache-load-factor", "0.5"], ["--cache-precision", "fp16"]):
        assert refused(argv) is None, argv
    for argv, why in ((["--managed", "managed_caching"], "device memory"), (["--ssd"], "SSD"),
                      (["--export-trace"], "trace"), (["--requests_data_file", "r.pt"], "request files"),
                      (["--dense"], "dense"), (["--weighted-num-requires-grad", "2"], "per-sample")):
        assert why in refused(argv), argv
    with pytest.raises(SystemExit):
        cli.main(["--uvm-host-mapped"])


def test_fbgemms_command_name_and_line(capsys, tmp_path):
    """FBGEMM's command line starts with its command, `device`; the lines carry FBGEMM's `a:` (alpha); the
    JSON records the command line as typed, command word included, so it reruns as written."""
    argv = ["device", "--batch-size", "4", "--num-tables", "1", "--num-embeddings", "20", "--embedding-dim", "8",
            "--bag-size", "2", "--iters", "1", "--passes", "fwd", "--optimizer", "exact_sgd", "--alpha", "1.15"]
    assert cli.main(argv + ["--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "Forward, B: 4, E: 20, T: 1, D: 8, L: 2, W: False, a: 1.15, BW:" in out, out
    command_line = json.loads((tmp_path / "r.json").read_text())["environment"]["command_line"]
    assert " device --batch-size 4 " in command_line, command_line


def test_weighted_sequence_lookups_are_refused_up_front(capsys):
    """Per-sample weights weight a pooled sum: --weighted with --pooling none is an argument error, before
    any module is built."""
    with pytest.raises(SystemExit):
        cli.main(["--pooling", "none", "--weighted", "--batch-size", "2", "--num-tables", "1",
                  "--num-embeddings", "20", "--embedding-dim", "8", "--bag-size", "2", "--iters", "1"])
    assert "pooling none with weighted" in capsys.readouterr().err


def _spec_case(argv):
    """The BenchCase a command line describes (what cli.main would run)."""
    parser = build_parser()
    command = argv[0] if argv and argv[0] in ("device", "device-with-spec") else None
    argv = argv[1:] if command else argv
    args = parser.parse_args(argv)
    given = explicit_options(parser, argv)
    if command == "device-with-spec":
        given = device_with_spec_options(args, given)
    return cli._shapes(args, given)[1][0].case


def test_device_with_spec_command_line():
    """FBGEMM's `device-with-spec`: T is the length of --embedding-dim-list, its list defaults are FBGEMM's
    ('128', '100000', and --bag-size-list '20' / --bag-size-sigma-list 'None' read from FBGEMM's click
    interface), and `device`'s one-value table options, which it does not have, are refused."""
    import click
    from fbgemm_gpu.tbe.bench import TbeBenchClickInterface as Fbgemm

    @click.command()
    @Fbgemm.vbe_options
    def spec(**_):  # pragma: no cover - never invoked
        pass

    defaults = {p.name: p.default for p in spec.params}
    assert defaults == {"bag_size_list": "20", "bag_size_sigma_list": "None"}
    case = _spec_case(["device-with-spec"])
    assert (case.command, case.num_tables, case.embedding_dim_list, case.num_embeddings_list) == (
        "device-with-spec", 1, (128,), (100_000,))
    assert case.bag_size_list == (int(defaults["bag_size_list"]),) and case.bag_size_sigma_list is None
    case = _spec_case(["device-with-spec", "--embedding-dim-list", "8,16,4", "--num-embeddings-list", "5,6,7",
                       "--bag-size-list", "1,2,3", "--bag-size-sigma-list", "0,1,2", "--alpha-list", "None"])
    assert (case.num_tables, case.bag_size_sigma_list, case.alpha_list) == (3, (0, 1, 2), None)
    # One --alpha-list value is every table's (as FBGEMM's vbe reads its --alpha-list).
    assert _spec_case(["device-with-spec", "--embedding-dim-list", "8,16", "--num-embeddings-list", "50,60",
                       "--bag-size-list", "1,2", "--alpha-list", "1.1"]).alpha_list == (1.1, 1.1)
    assert case.per_table and case.label().endswith("_fp32_Lsigma_spec")
    # Without the command word, the lists are `device`'s per-table lists (ours): T is --num-tables.
    assert _spec_case(["device", "--num-tables", "2", "--embedding-dim-list", "8,8"]).command == "device"
    for argv, why in ((["--num-tables", "3"], "--num-tables: not options of FBGEMM's device-with-spec"),
                      (["--mixed", "--bag-size", "4"], "--bag-size, --mixed"),
                      (["--suite", "smoke"], "say their own command"),
                      (["--embedding-dim-list", "8,8"], "num_embeddings_list has 1 entries for 2 tables"),
                      (["--num-requests", "3"], "--num-requests: not options"),
                      (["--batch-size-list", "4"], "--batch-size-list: not options"),
                      # `device` options it has in no version: click refuses them even at their defaults.
                      (["--cache-load-factor", "0.2"], "--cache-load-factor: not options of FBGEMM's device-with"),
                      (["--ssd-prefix", "/tmp/ssd_benchmark"], "--ssd-prefix: not options")):
        with pytest.raises((ValueError, SystemExit), match=why):
            _spec_case(["device-with-spec", *argv])
        with pytest.raises(SystemExit):
            cli.main(["device-with-spec", *argv])
    with pytest.raises(ValueError, match="reuse > 0"):
        BenchCase(num_tables=1, bag_size_list=(3,), bag_size_sigma_list=(1,), reuse=0.1)
    with pytest.raises(ValueError, match="bag_size_sigma_list entries must be >= 0"):
        BenchCase(num_tables=1, bag_size_sigma_list=(-1,))
    with pytest.raises(ValueError, match="command 'cache'"):
        BenchCase(command="cache")
    with pytest.raises(ValueError, match="command vbe takes per-table lists: batch_size_list"):
        BenchCase(command="vbe")
    spec = dict(command="device-with-spec", num_tables=1, embedding_dim_list=(8,), num_embeddings_list=(9,),
                bag_size_list=(2,))
    with pytest.raises(ValueError, match="one batch per iteration"):
        BenchCase(**spec, num_requests=3)  # from a suite's defaults, say
    with pytest.raises(ValueError, match="one batch size"):
        BenchCase(**spec, batch_size_list=(4,))
    # Ours that only add to it stay; FBGEMM's "None" reads as absent in suite files too.
    case = case_from_mapping({**spec, "indices_dtype": 32, "alpha_list": "None", "bag_size_sigma_list": "None"}, "s")
    assert (case.indices_dtype, case.alpha_list, case.bag_size_sigma_list) == (32, None, None)
    # A bag drawn larger than its Zipf table (known only once drawn): FBGEMM's generator asserts; the
    # error names the case and the table.
    big = BenchCase(name="tight", command="device-with-spec", num_tables=1, embedding_dim_list=(8,),
                    num_embeddings_list=(11,), bag_size_list=(8,), bag_size_sigma_list=(4,), alpha=1.15,
                    batch_size=2000, iters=1)
    assert big.bag_size_bound(0) == 8 + 24
    with pytest.raises(ValueError, match="tight: FBGEMM's request generator refused a table.*E=11"):
        make_workload(big, torch.device("cpu"))


def test_device_with_spec_batches_are_fbgemms():
    """The batches of a device-with-spec case are FBGEMM's: its per-table generate_requests calls (sigma_L,
    Zipf oversampled 5x for bags of at most 5 ids) after np/torch seeds of 42, laid end to end. The one
    difference: deterministic_output, without which FBGEMM's Zipf ids differ in every process."""
    argv = ["device-with-spec", "--embedding-dim-list", "8,16,12", "--num-embeddings-list", "400,3000,50",
            "--bag-size-list", "4,9,2", "--bag-size-sigma-list", "3,4,2", "--batch-size", "16", "--alpha", "1.15",
            "--iters", "2"]
    case = _spec_case(argv)
    ours = make_workload(case, torch.device("cpu")).requests

    np.random.seed(42)
    torch.manual_seed(42)
    per_table = []
    for E, L, sigma in ((400, 4, 3), (3000, 9, 4), (50, 2, 2)):
        per_table.append(generate_requests(2, 16, 1, L, E, reuse=0.0, alpha=1.15, weighted=False, sigma_L=sigma,
                                           zipf_oversample_ratio=3 if L > 5 else 5, use_cpu=True,
                                           index_dtype=torch.long, offset_dtype=torch.long,
                                           deterministic_output=True))
    for i, mine in enumerate(ours):
        indices = torch.cat([r[i].indices for r in per_table])
        offsets, shift = [per_table[0][i].offsets], int(per_table[0][i].offsets[-1])
        for r in per_table[1:]:
            offsets.append(r[i].offsets[1:] + shift)
            shift += int(r[i].offsets[-1])
        assert torch.equal(mine.indices, indices) and torch.equal(mine.offsets, torch.cat(offsets))
    lengths = ours[0].offsets.diff()
    assert lengths.numel() == 3 * 16 and len(set(lengths.tolist())) > 3  # sizes vary per sample...
    assert (lengths == 0).any()  # ...and some bags are empty (negative draws clip to 0)
    assert torch.equal(ours[1].offsets, ours[0].offsets)  # FBGEMM draws the sizes once for every batch


def test_vbe_command_line_mirrors_fbgemms():
    """FBGEMM's `vbe` command: the --bench-* and --emb-* options of FBGEMM's own loaders, same names and
    defaults (read from its click interfaces), its required lists, its 'None' alphas (uniform) and one
    alpha for every table, sigma 0 for every table when none is given; what it refuses, and what is
    not benchmarked here, refused with the reason."""
    import click
    from fbgemm_gpu.tbe.bench import EmbeddingOpsCommonConfigLoader, TBEBenchmarkingConfigLoader

    from torchrec_triton_tbe.bench.vbe_command import build_vbe_parser, refused, vbe_case

    @click.command()
    @TBEBenchmarkingConfigLoader.options
    @EmbeddingOpsCommonConfigLoader.options
    def loaders(**_):  # pragma: no cover - never invoked
        pass

    need = ["--batch-size-list", "4,7", "--embedding-dim-list", "8,12", "--bag-size-list", "2,6",
            "--num-embeddings-list", "30,60", "--num-tables", "2"]
    parser = build_vbe_parser()
    ours = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    args = parser.parse_args(need)
    for param in loaders.params:
        assert param.opts[0] in ours, param.opts[0]
        default = getattr(param.default, "value", param.default)  # SparseType.FP32 -> "fp32"
        assert getattr(args, param.name) == default, param.name
    assert refused(args) is None
    case = vbe_case(args)
    assert (case.command, case.batch_size_list, case.alpha_list, case.bag_size_sigma_list) == (
        "vbe", (4, 7), (0.0, 0.0), (0, 0))
    assert (case.bounds_check_mode, case.iters, case.optimizers) == (1, 100, ("exact_rowwise_adagrad",))
    assert vbe_case(parser.parse_args(need + ["--alpha-list", "1.15"])).alpha_list == (1.15, 1.15)
    assert vbe_case(parser.parse_args(need + ["--alpha-list", "1.0,1.2"])).alpha_list == (1.0, 1.2)
    with pytest.raises(SystemExit):
        parser.parse_args(need[2:])  # --batch-size-list is required, as in FBGEMM's
    with pytest.raises(ValueError, match="alpha_list has 3 entries for 2 tables"):
        vbe_case(parser.parse_args(need + ["--alpha-list", "1.0,1.2,1.3"]))
    for extra, why in ((["--ssd"], "SSD"), (["--merge-output"], "merged outputs"),
                       (["--bench-flush-gpu-cache-size", "1"], "refuses it too"),
                       (["--emb-uvm-host-mapped"], "refuses it too"), (["--bench-num-requests", "3"], "one batch"),
                       (["--bench-export-trace"], "trace"), (["--suite", "smoke"], "their own command")):
        assert why in refused(parser.parse_args(need + extra)), extra
        with pytest.raises(SystemExit):
            cli.main(["vbe", *need, *extra])


def test_vbe_takes_what_fbgemms_vbe_ignores_with_a_note():
    """FBGEMM's vbe command never reads --emb-location (its tables are in device memory) and reads
    --print-kernel-summary / --upload-perf-data only with a trace: accepted, each with a note."""
    from torchrec_triton_tbe.bench.vbe_command import build_vbe_parser, ignored, refused

    need = ["--batch-size-list", "4", "--embedding-dim-list", "8", "--bag-size-list", "2", "--num-embeddings-list",
            "30", "--num-tables", "1"]
    parser = build_vbe_parser()
    assert ignored(parser.parse_args(need)) == []
    args = parser.parse_args(need + ["--emb-location", "managed", "--print-kernel-summary", "--upload-perf-data"])
    assert refused(args) is None
    notes = ignored(args)
    assert [n.split(":")[1] for n in notes] == [" --emb-location managed", " --print-kernel-summary True",
                                                " --upload-perf-data True"]
    assert "device memory" in notes[0] and all("FBGEMM's vbe command" in n for n in notes)


def test_options_are_never_abbreviated(capsys):
    """FBGEMM's click takes no prefix of an option: neither does this CLI (argparse would read `--alpha`
    as vbe's `--alpha-list`, `--bench-iter` as `--bench-iterations`, `--batch` as `--batch-size`)."""
    need = ["--batch-size-list", "4", "--embedding-dim-list", "8", "--bag-size-list", "2", "--num-embeddings-list",
            "30", "--num-tables", "1"]
    for argv in (["vbe", *need, "--alpha", "1.15"], ["vbe", *need, "--bench-iter", "5"], ["--batch", "4"],
                 ["device-with-spec", "--embedding-dim-lis", "8"], ["--num-table", "2"]):
        with pytest.raises(SystemExit):
            cli.main(argv)
        assert "unrecognized arguments" in capsys.readouterr().err, argv
    assert explicit_options(build_parser(), ["--batch", "4"]) == {}


def test_bare_compare_is_fbgemms_flag_and_refused(capsys):
    """fbgemm-gpu >= 1.8's `--compare` is a flag (rerun on its CPU TBE); ours names contenders. A bare
    --compare is refused with both meanings spelled out, before anything runs."""
    need = ["--batch-size-list", "4", "--embedding-dim-list", "8", "--bag-size-list", "2", "--num-embeddings-list",
            "30", "--num-tables", "1"]
    for argv in (["--compare"], ["device", "--compare", "--check"], ["device-with-spec", "--compare"],
                 ["vbe", *need, "--compare"]):
        with pytest.raises(SystemExit):
            cli.main(argv)
        err = capsys.readouterr().err
        assert "FBGEMM's flag" in err and "--compare fbgemm" in err, argv
    assert build_parser().parse_args(["--compare", "fbgemm"]).compare == ("fbgemm",)
    assert explicit_options(build_parser(), ["--compare", "fbgemm,torchrec_triton"]) == {
        "compare": ("fbgemm", "torchrec_triton")}


def test_vbe_command_batches_are_fbgemms(capsys):
    """A vbe case's batches are FBGEMM's vbe command's: per table generate_requests(B_t, 1, L_t, E_t,
    alpha_t, sigma_L=sigma_t or 0, Zipf oversampled 5x for bags of at most 5 ids), end to end (with
    deterministic_output, as every workload here); its lines are FBGEMM's two, per kernel."""
    need = ["--batch-size-list", "6,3,9", "--embedding-dim-list", "8,12,4", "--bag-size-list", "3,7,1",
            "--num-embeddings-list", "300,2000,40", "--num-tables", "3", "--alpha-list", "1.0,1.15,1.2", "--bench-iterations",
            "2"]
    from torchrec_triton_tbe.bench.vbe_command import build_vbe_parser, vbe_case

    case = vbe_case(build_vbe_parser().parse_args(need))
    ours = make_workload(case, torch.device("cpu")).requests
    np.random.seed(42)
    torch.manual_seed(42)
    per_table = [generate_requests(2, B, 1, L, E, alpha=a, weighted=False, sigma_L=0,
                                   zipf_oversample_ratio=3 if L > 5 else 5, use_cpu=True, index_dtype=torch.long,
                                   offset_dtype=torch.long, deterministic_output=True)
                 for B, L, E, a in ((6, 3, 300, 1.0), (3, 7, 2000, 1.15), (9, 1, 40, 1.2))]
    for i, mine in enumerate(ours):
        offsets, shift = [per_table[0][i].offsets], int(per_table[0][i].offsets[-1])
        for r in per_table[1:]:
            offsets.append(r[i].offsets[1:] + shift)
            shift += int(r[i].offsets[-1])
        assert torch.equal(mine.indices, torch.cat([r[i].indices for r in per_table]))
        assert torch.equal(mine.offsets, torch.cat(offsets))
    assert cli.main(["vbe", *need, "--compare", "fbgemm", "--check", "--emb-bounds-check", "3"]) == 0
    out = capsys.readouterr().out
    assert "check exact_rowwise_adagrad: ok" in out, out
    head = "T: 3, Bs: [6, 3, 9], Ds: [8, 12, 4], Ls: [3, 7, 1], Es: [300, 2000, 40], alphas: [1.0, 1.15, 1.2]"
    for kernel in ("triton", "fbgemm"):
        assert f"{kernel} exact_rowwise_adagrad {head}\n" in out, out
        assert re.search(rf"^{kernel} exact_rowwise_adagrad fwd: \d+us, bwd: \d+us$", out, re.M), out


def test_mixed_dims_follow_fbgemm():
    """--mixed: FBGEMM's round_up(np.random.randint(0.5 D, 1.5 D), 4) right after np.random.seed(42)."""
    from fbgemm_gpu.tbe.utils import round_up

    np.random.seed(42)
    expected = [round_up(np.random.randint(low=64, high=192), 4) for _ in range(6)]
    np.random.seed(42)
    assert BenchCase(num_tables=6, embedding_dim=128, mixed=True).table_dims() == expected


# ------------------------------------------------------------------------------------------ byte model, log lines
def test_byte_model_matches_fbgemm_formula():
    # FBGEMM's default shape with fp16 weights, fp32 output:
    #   out   = 4 B/elem * 512 * (32 * 128)          =  8,388,608
    #   param = 2 B/elem * 512 * (32 * 128) * 20     = 83,886,080
    assert read_write_bytes(512, [128] * 32, 20, "fp16", "fp32") == 92_274_688
    # Mixed widths [12, 8], B=8, L=4, fp16 weights, fp32 output: 4*8*20 + 2*8*20*4 = 640 + 1280
    assert read_write_bytes(8, [12, 8], 4, "fp16", "fp32") == 1920
    # fp32/bf16: 2*3*(4+8) out + 4*3*12*5 params = 72 + 720; pooling none multiplies the output by L.
    assert read_write_bytes(3, [4, 8], 5, "fp32", "bf16") == 792
    assert read_write_bytes(2, [4], 3, "fp32", "fp32", pooled=False) == 4 * 2 * 4 * 3 + 4 * 2 * 4 * 3
    # Forward GB/s = bytes / t; backward GB/s = 2 * bytes / t (FBGEMM's convention).
    assert gbps(92_274_688, 0.141) == pytest.approx(654.4304, rel=1e-6)
    assert gbps(92_274_688, 0.746, backward=True) == pytest.approx(247.3852, rel=1e-6)


def test_log_lines_in_fbgemm_format():
    fwd = log_line("", False, 512, 100000, 32, 128, 20, False, 654.4304, 141.0)
    bwd = log_line("", True, 512, 100000, 32, 128, 20, False, 247.3852, 746.0)
    # Exactly FBGEMM's f-strings ({: .2f} leaves a sign space; the Backward line has no W:).
    assert fwd == "Forward, B: 512, E: 100000, T: 32, D: 128, L: 20, W: False, BW:  654.43 GB/s, T: 141us"
    assert bwd == "Backward, B: 512, E: 100000, T: 32, D: 128, L: 20, BW:  247.39 GB/s, T: 746us"
    # With the alpha, as FBGEMM's lines since 1.x.
    assert log_line("", False, 512, 100000, 32, 128, 20, False, 654.4304, 141.0, 1.0) == (
        "Forward, B: 512, E: 100000, T: 32, D: 128, L: 20, W: False, a: 1.0, BW:  654.43 GB/s, T: 141us")
    assert log_line("", True, 512, 100000, 32, 128, 20, False, 247.3852, 746.0, 1.15) == (
        "Backward, B: 512, E: 100000, T: 32, D: 128, L: 20, a: 1.15, BW:  247.39 GB/s, T: 746us")
    ours = parse_log_line(log_line("triton exact_sgd", True, 65536, 10**6, 24, 144.0, 20, True, 1234.5, 10850))
    assert ours == {"prefix": "triton exact_sgd", "pass": "Backward", "B": 65536, "E": 1000000, "T": 24,
                    "D": 144.0, "L": 20, "W": None, "alpha": None, "BW_GBps": 1234.5, "T_us": 10850}
    # FBGEMM's newer lines carry "a: {alpha}" and go through logging ("INFO:root:").
    newer = parse_log_line("INFO:root:Forward, B: 512, E: 100000, T: 32, D: 128, L: 20, W: True, a: 1.15, "
                           "BW:  88.50 GB/s, T: 42us")
    assert newer["alpha"] == 1.15 and newer["W"] is True and newer["T_us"] == 42 and newer["BW_GBps"] == 88.5
    assert parse_log_line("speedup fwd (fbgemm / triton median): 1.000x") is None
    # FBGEMM's device-with-spec lines print the per-table lists ("Ls: mu [...] sigma [...]" with sigmas).
    spec_fwd = spec_log_line("", False, 512, [100, 2000], [8, 16], [4, 20], None, False, 1.0, 1.2534, 34.2)
    assert spec_fwd == ("Forward, B: 512, Es: [100, 2000], T: 2, Ds: [8, 16], Ls: [4, 20], W: False, a: 1.0, "
                        "BW:  1.25 GB/s, T: 34us")
    spec_bwd = spec_log_line("triton exact_sgd", True, 512, [100, 2000], [8, 16], [4, 20], [1, 5], False, 1.15,
                             2.5, 68.0)
    assert spec_bwd == ("triton exact_sgd Backward, B: 512, Es: [100, 2000], T: 2, Ds: [8, 16], "
                        "Ls: mu [4, 20] sigma [1, 5], a: 1.15, BW:  2.50 GB/s, T: 68us")
    assert parse_log_line(spec_bwd) == {
        "prefix": "triton exact_sgd", "pass": "Backward", "B": 512, "Es": [100, 2000], "T": 2, "Ds": [8, 16],
        "Ls": "mu [4, 20] sigma [1, 5]", "W": None, "alpha": 1.15, "BW_GBps": 2.5, "T_us": 68}
    assert parse_log_line("INFO:root:" + spec_fwd)["W"] is False
    # fbgemm-gpu 1.6.0's device-with-spec lines have no "a:" (written as its benchmark writes them).
    v160 = ("INFO:root:Forward, B: 512, Es: [100, 2000], T: 2, Ds: [8, 16], Ls: mu [4, 20] sigma [1, 5], W: True, "
            "BW:  1.25 GB/s, T: 34us")
    assert parse_log_line(v160) == {
        "prefix": "INFO:root:", "pass": "Forward", "B": 512, "Es": [100, 2000], "T": 2, "Ds": [8, 16],
        "Ls": "mu [4, 20] sigma [1, 5]", "W": True, "alpha": None, "BW_GBps": 1.25, "T_us": 34}
    assert parse_log_line("Backward, B: 8, Es: [10], T: 1, Ds: [4], Ls: [2], BW:  0.50 GB/s, T: 7us")["T_us"] == 7


# ------------------------------------------------------------------------------------------ batches
def test_run_lengths_hand_built_batch():
    # B=2, T=2: table 0 bags [1, 1] and [1, 3, 3]; table 1 bags [1] and [1, 2].
    offsets = torch.tensor([0, 2, 5, 6, 8])
    indices = torch.tensor([1, 1, 1, 3, 3, 1, 1, 2])
    assert run_lengths(indices, offsets, [2, 2], [10, 10]).tolist() == [3, 2, 2, 1]


def test_generator_reports_zipf_fallback():
    """FBGEMM's generator silently falls back to uniform ids when a bag can't fill L distinct Zipf ids."""
    case = BenchCase(batch_size=64, num_tables=2, num_embeddings=1000, embedding_dim=8, bag_size=4, alpha=1.5,
                     iters=1)
    w = make_workload(case, torch.device("cpu"))
    assert w.stats["zipf_fallback_to_uniform"] is True
    assert w.stats["distribution"] == "uniform (Zipf fallback)"
    assert w.grad_output.shape == (64, 16) and len(w.requests) == 1
    r = w.requests[0]
    assert r.indices.dtype == torch.int64 and r.offsets.dtype == torch.int64 and r.offsets.numel() == 129


def test_workload_ids_are_the_same_in_every_process():
    """FBGEMM's Zipf ids are permuted by an unseeded NumPy generator unless deterministic_output is set:
    two processes built different batches from the same seeds (two cold first steps trained apart)."""
    import subprocess

    code = ("import hashlib, torch, torchrec_triton_tbe; from torchrec_triton_tbe.bench.batches import make_workload; "
            "from torchrec_triton_tbe.bench.case import BenchCase; "
            "w = make_workload(BenchCase(name='z', num_tables=2, batch_size=16, bag_size=4, num_embeddings=500, "
            "embedding_dim=8, alpha=1.15, iters=1), torch.device('cpu')); "
            "print(hashlib.md5(w.requests[0].indices.numpy().tobytes()).hexdigest())")
    digests = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()[-1]
               for _ in range(2)}
    assert len(digests) == 1, digests


def test_h200_hot_shape_is_hot_with_fbgemms_generator():
    """The suite's hot-row shape at full size through FBGEMM's generator (its NumPy Zipf path on CPU):
    no fallback, and most lookups sit in runs >= 256."""
    _, shapes = load_suite("h200", {})
    case = next(s.case for s in shapes if s.case.name == "hot_zipf15_l1")
    np.random.seed(42)
    torch.manual_seed(42)
    request = generate_requests(1, case.batch_size, case.num_tables, case.bag_size, case.num_embeddings,
                                alpha=case.alpha, use_cpu=True, index_dtype=torch.long, offset_dtype=torch.long)[0]
    stats = generator_stats(case, request, [])
    assert stats["lookups"] == case.lookups == 131072 * 32
    assert stats["lookups_in_runs_ge_256_frac"] > 0.8
    assert stats["max_run_length"] > 10_000


# ------------------------------------------------------------------------------------------ suites, timing
def test_suites_have_the_required_shapes():
    header, shapes = load_suite("h200", {})
    assert header["name"] == "h200"
    by_name = {s.case.name: s for s in shapes}
    got = {(c.batch_size, c.num_tables, c.num_embeddings, c.embedding_dim if c.embedding_dim_list is None else "mixed",
            c.bag_size, c.alpha, c.weighted, c.indices_dtype, c.weights_precision) for c in (s.case for s in shapes)}
    required = [
        (512, 32, 10**5, 128, 20, 1.0, False, 64, "fp16"),
        (65536, 32, 10**6, 128, 20, 1.0, False, 64, "fp16"),
        (65536, 32, 10**6, 128, 20, 1.15, False, 64, "fp16"),
        (131072, 16, 10**6, 128, 20, 1.0, False, 64, "fp16"),
        (65536, 32, 10**6, 32, 20, 1.0, False, 64, "fp16"),
        (65536, 32, 10**6, 64, 20, 1.15, False, 64, "fp16"),
        (65536, 24, 10**6, "mixed", 20, 1.15, False, 64, "fp16"),
        (131072, 8, 10**7, 128, 4, 1.0, False, 64, "fp16"),
        (65536, 32, 10**6, 128, 20, 1.15, True, 64, "fp16"),
        (65536, 32, 10**6, 128, 20, 1.15, False, 32, "fp16"),
        (65536, 16, 10**6, 128, 20, 1.15, False, 64, "fp32"),
    ]
    for shape in required:
        assert shape in got, shape
    assert sum(1 for s in shapes if s.baseline_ms) == len(required)
    for s in shapes:
        c = s.case
        assert (c.output_dtype, c.bounds_check_mode) == ("fp32", 3)
        assert c.optimizers == ("exact_sgd", "exact_rowwise_adagrad") and c.passes == ("fwd", "bwd")
    # Issue 11: a sequence shape and a variable-batch one; issue 14: production-shaped ones (many tables,
    # mixed dims with tiny and non-power-of-two widths, bag sizes from 1 to over 100, rows from a handful
    # to millions), a many-table small-batch one with 1-8 M lookups, a DLRM-style one.
    cases = [s.case for s in shapes]
    assert any(c.pooling == "none" for c in cases) and any(c.vbe for c in cases)
    prod = [c for c in cases if c.embedding_dim_list and c.bag_size_list and c.num_embeddings_list]
    assert {c.batch_size for c in prod} >= {16384, 65536, 2048}
    for c in prod:
        dims, Ls, Es = set(c.embedding_dim_list), c.bag_size_list, c.num_embeddings_list
        assert c.num_tables >= 24 and {4, 8} <= dims and any(d & (d - 1) for d in dims)
        assert min(Ls) == 1 and max(Ls) > 100 and min(Es) < 64 and max(Es) > 5_000_000
    assert any(1_000_000 <= c.lookups <= 8_000_000 and c.num_tables >= 50 for c in prod)
    # The small-table path's tables (the production write-up's: at most 64 rows, D 64-128, 64+ ids a bag).
    assert any(e <= 64 and 64 <= d <= 128 and L >= 64 for c in prod
               for e, d, L in zip(c.num_embeddings_list, c.embedding_dim_list, c.bag_size_list))
    # TorchRec's default fp32 tables on the production shapes (the same tables as their fp16 twins).
    for name in ("prod_t40_b16k", "prod_t100_b2k"):
        fp32, fp16 = by_name[name + "_fp32"].case, by_name[name].case
        assert (fp32.weights_precision, fp16.weights_precision) == ("fp32", "fp16")
        assert dataclasses.replace(fp32, name=fp16.name, weights_precision="fp16") == fp16
    dlrm = by_name["dlrm_t26_l1"].case
    assert dlrm.num_tables == 26 and dlrm.bag_size == 1
    for s in shapes:
        if s.baseline_ms:
            assert set(s.baseline_ms) == {"fwd", "bwd_exact_sgd", "bwd_exact_rowwise_adagrad"}
    mixed = by_name["mixed_d32_256_zipf115"].case
    assert min(mixed.embedding_dim_list) == 32 and max(mixed.embedding_dim_list) == 256
    assert by_name["hot_zipf15_l1"].case.alpha == 1.5
    # Command-line options override every entry.
    _, shortened = load_suite("h200", {"iters": 7})
    assert {s.case.iters for s in shortened} == {7}
    # The smoke suite stays within what the interpreter runs quickly.
    for s in load_suite("smoke", {})[1]:
        c = s.case
        assert c.batch_size <= 8 and c.num_tables <= 2 and c.num_embeddings <= 100 and c.bag_size <= 4
        assert max(c.table_dims()) <= 16 and c.iters <= 3


def test_unseen_suite_covers_what_the_tuned_suite_does_not():
    """configs/suites/unseen.yaml holds shapes configs/sm90.yaml was never tuned on: each trait it claims is
    absent from the h200 suite and present in it, and its shapes pass the case checks (load_suite)."""
    header, shapes = load_suite("unseen", {})
    assert header["name"] == "unseen" and len(shapes) >= 8
    traits = {
        "rows of 512+ elements": lambda c: max(c.table_dims()) >= 512,
        "only tiny rows": lambda c: max(c.table_dims()) <= 8,
        "MEAN pooling": lambda c: c.pooling == "mean",
        "bf16 weights": lambda c: c.weights_precision == "bf16",
        "a batch of at most 512 over 64+ tables": lambda c: c.batch_size <= 512 and c.num_tables >= 64,
        "bags of 200 ids": lambda c: c.bag_size >= 200,
        "one table of 20 M+ rows": lambda c: c.num_tables == 1 and c.num_embeddings >= 20_000_000,
        "narrow sequence lookups": lambda c: c.pooling == "none" and max(c.table_dims()) <= 32,
        "weighted int32 ids": lambda c: c.weighted and c.indices_dtype == 32,
    }
    tuned = [s.case for s in load_suite("h200", {})[1]]
    unseen = [s.case for s in shapes]
    for trait, has in traits.items():
        assert not any(has(c) for c in tuned), f"h200 already has {trait}"
        assert any(has(c) for c in unseen), f"unseen lacks {trait}"
    assert {c.name for c in unseen}.isdisjoint(c.name for c in tuned)


def test_time_steps_walks_batches_and_excludes_warmup():
    calls = []

    def step(i):
        calls.append(("setup", i))
        return lambda: calls.append(("timed", i))

    t = time_steps(step, iters=3, warmup=2, device=torch.device("cpu"))
    assert calls == [("setup", 0), ("timed", 0), ("setup", 1), ("timed", 1),
                     ("setup", 0), ("timed", 0), ("setup", 1), ("timed", 1), ("setup", 2), ("timed", 2)]
    assert (t.iters, t.warmup, t.meaningful) == (3, 2, False)
    assert t.p20_ms <= t.median_ms <= t.p80_ms


def test_time_steps_reports_host_issue_time():
    # The setup half (the backward's forward) stays out of the host time as it stays out of the timing.
    def step(i):
        time.sleep(0.02)
        return lambda: time.sleep(0.002)

    t = time_steps(step, iters=3, warmup=0, device=torch.device("cpu"))
    assert 2.0 <= t.host_median_ms < 20.0
    assert t.as_dict()["host_median_ms"] == t.host_median_ms


# ------------------------------------------------------------------------------------------ CLI end to end
def test_cli_smoke_suite_end_to_end(tmp_path, capsys):
    out_json, out_png = tmp_path / "smoke.json", tmp_path / "smoke.png"
    argv = ["--suite", "smoke", "--compare", "fbgemm", "--check", "--json", str(out_json)]
    try:
        import matplotlib  # noqa: F401

        argv += ["--plot", str(out_png)]
    except ImportError:
        out_png = None
    assert cli.main(argv) == 0
    stdout = capsys.readouterr().out
    record = json.loads(out_json.read_text())

    env = record["environment"]
    for key in ("date", "command_line", "gpu", "clocks_mhz_at_start", "clocks_mhz_at_end", "versions", "git_commit"):
        assert key in env
    assert set(env["versions"]) >= {"torch", "triton", "fbgemm_gpu", "torchrec_triton_tbe"}
    assert env["command_line"].startswith("torchrec-triton-tbe-bench --suite smoke")
    assert record["timing_meaningful"] is False and record["copy_bandwidth"] is None  # CPU
    # --compare fbgemm alone: the JSON as before the other contenders (no speedup_<kernel>, no peer keys).
    assert record["compare"] == "fbgemm" and "torchrec_triton" not in record
    assert not any(k.startswith("speedup_") and k != "speedup_vs_baseline"
                   for s in record["shapes"] for e in s["results"].values() for k in e)

    shapes = record["shapes"]
    assert [s["name"] for s in shapes] == ["uniform_fp16", "hot_zipf15_fp32_mean", "mixed_weighted_int32"]
    lines = [p for p in map(parse_log_line, stdout.splitlines()) if p]
    assert len(lines) == 3 * 8  # per shape: fwd and 3 x bwd, each for triton and fbgemm
    for shape in shapes:
        assert "error" not in shape, shape.get("error")
        opts = shape["options"]
        assert shape["read_write_bytes"] == read_write_bytes(
            opts["batch_size"], shape["Ds"], opts["bag_size"], opts["weights_precision"], opts["output_dtype"])
        assert set(shape["results"]) == {"fwd", "bwd_exact_sgd", "bwd_exact_rowwise_adagrad", "bwd_exact_adagrad"}
        for key, entry in shape["results"].items():
            for kernel in ("triton", "fbgemm"):
                t = entry[kernel]
                assert t["p20_ms"] <= t["median_ms"] <= t["p80_ms"] and t["meaningful"] is False
                assert t["gbps"] == pytest.approx(gbps(shape["read_write_bytes"], t["median_ms"], key != "fwd"))
                logged = [p for p in lines if p["prefix"].startswith(kernel) and p["B"] == opts["batch_size"]
                          and p["T_us"] == round(t["median_ms"] * 1e3)]
                assert logged, (shape["name"], key, kernel)
            assert entry["speedup"] == pytest.approx(entry["fbgemm"]["median_ms"] / entry["triton"]["median_ms"])
        assert all(c["ok"] for c in shape["check"].values())
        gen = shape["generator"]
        assert gen["lookups"] == opts["batch_size"] * opts["num_tables"] * opts["bag_size"]
        assert {"distribution", "zipf_fallback_to_uniform", "max_run_length", "unique_rows",
                "lookups_in_runs_ge_256_frac", "lookups_in_runs_lt_4_frac"} <= set(gen)
    assert shapes[1]["generator"]["distribution"] == "zipf(1.5)"  # L=1: no uniform fallback
    assert shapes[1]["options"]["pooling"] == "mean" and shapes[2]["options"]["indices_dtype"] == 32
    assert len(set(shapes[2]["Ds"])) > 1  # --mixed
    if out_png is not None:
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_single_case_forward_only(tmp_path):
    out = tmp_path / "one.json"
    argv = ["--batch-size", "4", "--num-tables", "1", "--num-embeddings", "20", "--embedding-dim", "8",
            "--bag-size", "2", "--iters", "2", "--passes", "fwd", "--optimizer", "exact_sgd", "--json", str(out)]
    assert cli.main(argv) == 0
    record = json.loads(out.read_text())
    (shape,) = record["shapes"]
    assert record["suite"] is None and shape["name"] == "cli" and list(shape["results"]) == ["fwd"]
    assert "fbgemm" not in shape["results"]["fwd"] and shape["check"] is None
    assert shape["options"]["num_requests"] == 2  # -1 -> iters
    # Merging runs (a suite split over several commands) keeps every shape once.
    merged = merge([record, {**record, "shapes": [{**shape, "name": "other"}]}])
    assert [s["name"] for s in merged["shapes"]] == ["cli", "other"]
    # A clash (single-case runs are all "cli"): the later run's shape, and a line saying so.
    notes = []
    merged = merge([record, {**record, "shapes": [{**shape, "lookups": -1}]}], note=notes.append)
    assert [s["lookups"] for s in merged["shapes"]] == [-1] and notes == ["shape 'cli' of input 2 replaces an "
                                                                          "earlier input's"]
    from torchrec_triton_tbe.bench import report

    (tmp_path / "other.json").write_text(json.dumps({"not": "a bench run"}))
    for bad in (tmp_path / "missing.json", tmp_path / "other.json"):
        with pytest.raises(SystemExit):
            report.main([str(out), str(bad), "--plot", str(tmp_path / "p.png")])


def test_merge_refuses_runs_of_another_environment_and_notes_the_rest(tmp_path, capsys):
    """The merged record carries the first run's header: a run timed on another GPU, in the interpreter or
    on other versions is refused; another commit or other compared kernels are noted (compare: the union)."""
    from torchrec_triton_tbe.bench import report

    env = {"device": "cuda:0", "gpu": {"name": "NVIDIA H200"}, "versions": {"torch": "2.11"}, "git_commit": "a"}
    base = {"timing_meaningful": True, "compare": "fbgemm", "environment": env,
            "shapes": [{"name": "x", "results": {}}]}
    # Another card of the same kind on the host is the same environment.
    merge([base, {**base, "environment": {**env, "device": "cuda:1"}, "shapes": [{"name": "y", "results": {}}]}])
    for change in ({"timing_meaningful": False}, {"environment": {**env, "gpu": {"name": "NVIDIA H100"}}},
                   {"environment": {**env, "versions": {"torch": "2.14"}}}):
        with pytest.raises(ValueError, match="input 2 was measured with another"):
            merge([base, {**base, **change, "shapes": [{"name": "y", "results": {}}]}])
    notes = []
    other = {**base, "compare": "fbgemm,torchrec_triton", "environment": {**env, "git_commit": "b"},
             "shapes": [{"name": "y", "results": {}}]}
    merged = merge([base, other], note=notes.append)
    assert merged["compare"] == "fbgemm,torchrec_triton" and [s["name"] for s in merged["shapes"]] == ["x", "y"]
    assert any("commit b" in n for n in notes) and any("union" in n for n in notes)
    # The command line: JSON alone is a merge; neither output, or a merge of other environments, an error.
    paths = []
    for i, rec in enumerate((base, other, {**base, "timing_meaningful": False})):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(rec))
    assert report.main([str(paths[0]), str(paths[1]), "--json", str(tmp_path / "m.json")]) == 0
    assert json.loads((tmp_path / "m.json").read_text())["compare"] == "fbgemm,torchrec_triton"
    for argv, why in (([str(paths[0])], "nothing to write"),
                      ([str(paths[0]), str(paths[2]), "--json", str(tmp_path / "n.json")], "measured with another"),
                      ([str(paths[0]), "--plot", str(tmp_path / "p.png")], "nothing to plot")):  # no results
        capsys.readouterr()
        with pytest.raises(SystemExit):
            report.main(argv)
        assert why in capsys.readouterr().err, argv


def test_only_builds_just_the_shapes_it_names(tmp_path):
    """An override that fits the picked shape but not another (--num-tables against its lists) is no error;
    --only without --suite is refused, not ignored."""
    suite = tmp_path / "tiny.yaml"
    suite.write_text(
        "shapes:\n"
        "  - {name: a, num_tables: 3, batch_size: 4, num_embeddings: 30, embedding_dim: 8, bag_size: 2}\n"
        "  - {name: c, num_tables: 2, batch_size: 4, num_embeddings: 30, embedding_dim_list: [8, 16], bag_size: 2}\n"
    )
    header, shapes = load_suite(str(suite), {"num_tables": 3}, ["a"])
    assert [s.case.name for s in shapes] == ["a"]
    with pytest.raises(ValueError, match="embedding_dim_list"):
        load_suite(str(suite), {"num_tables": 3})
    with pytest.raises(ValueError, match=r"--only: no shapes named \['b'\]"):
        load_suite(str(suite), {}, ["b"])
    with pytest.raises(SystemExit, match="give --suite too"):
        cli.main(["--only", "a", "--iters", "1"])


def test_a_check_of_a_batch_without_lookups_passes(tmp_path):
    """Bags of 0 ids, pooling none: 0 x D outputs on both sides (the check reshaped them with an ambiguous -1)."""
    out = tmp_path / "r.json"
    argv = ["--batch-size", "4", "--num-tables", "2", "--num-embeddings", "20", "--embedding-dim", "8",
            "--bag-size", "0", "--pooling", "none", "--iters", "1", "--optimizer", "exact_sgd", "--compare", "fbgemm",
            "--check", "--json", str(out)]
    assert cli.main(argv) == 0
    (shape,) = json.loads(out.read_text())["shapes"]
    check = shape["check"]["exact_sgd"]
    assert check["output"]["ok"] and check["output"]["numel"] == 0


@pytest.mark.parametrize("argv", [
    ["--pooling", "none", "--num-tables", "3", "--batch-size", "4", "--num-embeddings", "40", "--embedding-dim", "8",
     "--bag-size", "3"],
    ["--num-tables", "3", "--batch-size-list", "4,7,2", "--bag-size-list", "2,4,1", "--num-embeddings-list",
     "30,60,7", "--embedding-dim-list", "8,12,16", "--weighted"],  # SUM: FBGEMM's CPU weighted MEAN is off
    ["--num-tables", "2", "--batch-size", "6", "--num-embeddings-list", "20,300", "--alpha-list", "1.0,1.2",
     "--bag-size-list", "3,1", "--embedding-dim", "8"],
    ["device-with-spec", "--batch-size", "5", "--embedding-dim-list", "8,12,4", "--num-embeddings-list", "40,300,70",
     "--bag-size-list", "3,1,6", "--bag-size-sigma-list", "2,1,3", "--alpha", "1.15", "--pooling", "mean"],
], ids=["sequence", "vbe-per-table", "per-table-fixed-batch", "device-with-spec-sigma"])
def test_sequence_vbe_and_per_table_cases_check_against_fbgemm(tmp_path, argv):
    """--pooling none, --batch-size-list (VBE, FBGEMM's vbe command) and the per-table lists: batches per
    table, FBGEMM's byte model per table, and --check against FBGEMM's CPU TBE."""
    out_json = tmp_path / "r.json"
    assert cli.main(argv + ["--iters", "2", "--compare", "fbgemm", "--check", "--optimizer",
                            "exact_sgd,exact_rowwise_adagrad", "--json", str(out_json)]) == 0
    shape = json.loads(out_json.read_text())["shapes"][0]
    assert "error" not in shape, shape.get("error")
    assert all(c["ok"] for c in shape["check"].values())
    case = BenchCase(**{k: tuple(v) if isinstance(v, list) else v for k, v in shape["options"].items()
                        if k not in ("num_requests",)}, num_requests=2)
    assert shape["lookups"] == shape["generator"]["lookups"]
    if case.bag_size_sigma_list is None:
        assert shape["lookups"] == case.lookups == sum(case.batch_size_at(t) * case.bag_size_at(t)
                                                       for t in range(case.num_tables))
    else:  # bag sizes drawn per sample: the expected count is the mean's
        assert shape["lookups"] != case.lookups and shape["label"].endswith("_fp32_Lsigma_spec_mean")
    if case.vbe:
        assert shape["label"].startswith("Bvbe_")
    assert shape["read_write_bytes"] > 0


@pytest.mark.parametrize("argv,fbgemm_forward", [
    (["--weighted", "--pooling", "mean", "--optimizer", "exact_rowwise_adagrad"], True),
    (["--optimizer", "adam,lars_sgd"], True),
    (["--weights-precision", "bf16", "--pooling", "none", "--optimizer", "exact_sgd"], False),
    (["--weighted", "--pooling", "mean", "--output-dtype", "fp16", "--optimizer", "exact_sgd"], False),
    (["--batch-size-list", "3,2", "--optimizer", "exact_adagrad"], True),  # FBGEMM: no VBE with Adagrad
], ids=["weighted-mean", "optimizers-fbgemm-cpu-lacks", "bf16-sequence", "weighted-mean-fp16-out", "vbe-adagrad"])
def test_what_fbgemms_cpu_tbe_cannot_check_is_skipped_and_checked_against_the_reference(tmp_path, capsys, argv,
                                                                                       fbgemm_forward):
    """Off the GPU, --compare fbgemm --check on a case FBGEMM's CPU TBE cannot run (bf16, optimizers past
    its three) or computes unlike its CUDA TBE (weighted MEAN's backward, without the 1/L) records FBGEMM's
    pass as skipped with the reason, instead of failing the shape or reporting a mismatch, and checks ours
    against the pure-PyTorch reference there."""
    out_json = tmp_path / "r.json"
    assert cli.main(["--batch-size", "3", "--num-tables", "2", "--num-embeddings", "9", "--embedding-dim", "8",
                     "--bag-size", "3", "--iters", "1", "--warmup-runs", "0", "--compare", "fbgemm", "--check",
                     "--json", str(out_json), *argv]) == 0
    shape = json.loads(out_json.read_text())["shapes"][0]
    assert "error" not in shape, shape.get("error")
    log = capsys.readouterr().out
    for optimizer, check in shape["check"].items():
        assert check["ok"]
        ref = check["reference"]
        assert ref["ok"] and ref["weights_after_backward"]["numel"] == 2 * 9 * 8
        # [B, T * D] pooled; [T * B * L, D] sequence; VBE: 1-D, sum of B_t * D
        assert ref["output"]["numel"] == (5 * 8 if "--batch-size-list" in argv else 3 * 2 * 8 * (3 if "none" in argv else 1))
        bwd = shape["results"][f"bwd_{optimizer}"]
        assert "median_ms" in bwd["triton"] and "skipped" in bwd["fbgemm"] and "speedup" not in bwd
        assert f"fbgemm {optimizer} Backward: skipped ({bwd['fbgemm']['skipped']})" in log
        if fbgemm_forward:  # its forward still compared and timed
            assert check["output"]["ok"] and "skipped" in check["weights_after_backward"]
            assert "median_ms" in shape["results"]["fwd"]["fbgemm"]
        else:
            assert check["fbgemm"]["skipped"] and "skipped" in shape["results"]["fwd"]["fbgemm"]
    if "adam" in argv[-1]:
        assert "state_after_backward" in shape["check"]["adam"]["reference"]  # Adam's two states


# ------------------------------------------------------------------------------------------ other contenders
# A stand-in for TorchRec's Triton TBE checkout (CI has none): the three files, importing each other under
# their real names, the AMD-only ads_mkl module unguarded (as the real ones), and a FeatureGateName without
# DISABLE_OFFSETS_ADJUSTMENT (as fbgemm-gpu 1.6.0's). The class is a small SUM TBE in plain PyTorch with
# the real one's interface: exact SGD / row-wise Adagrad applied to a flat weight during backward.
_FAKE_UTILS = """
from fbgemm_gpu.split_embedding_configs import EmbOptimType as OptimType
OPTIM_TYPE_TO_INT = {OptimType.EXACT_SGD: 0, OptimType.EXACT_ROWWISE_ADAGRAD: 1}
from ads_mkl.ops.triton.amd.triton_table_batched_embeddings import _FIXED_GRID as _AMD_FIXED_GRID
"""
_FAKE_FUSED = """
from torchrec.distributed.triton_tbe.triton_tbe_backward_utils import OPTIM_TYPE_TO_INT
FUSED = "fused"
"""
_FAKE_MAIN = """
import enum
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType as OptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
from torchrec.distributed.triton_tbe.triton_tbe_backward_long_run_fused import FUSED
from torchrec.distributed.triton_tbe.triton_tbe_backward_utils import OPTIM_TYPE_TO_INT
from ads_mkl.ops.triton.amd.triton_table_batched_embeddings import (
    triton_tbe_forward_weighted_kernel as _amd_fwd_weighted_kernel,
)
VERSION = "{version}"


class FeatureGateName(enum.Enum):  # fbgemm-gpu 1.6.0's has no DISABLE_OFFSETS_ADJUSTMENT
    TBE_V2 = 1


class TritonTableBatchedEmbeddingBags(torch.nn.Module):
    def __init__(self, embedding_specs, feature_table_map=None, weights_precision=torch.float32,
                 output_dtype=torch.float32, stochastic_rounding=True, learning_rate=0.01, eps=0.1,
                 optimizer=OptimType.EXACT_SGD, device=None, hoist_transpose_to_forward=False,
                 bag_size_hints=None, fused_bounds_check=False):
        super().__init__()
        if VERSION == "boom-init":
            raise ValueError("peer refused its arguments")
        self.embedding_specs = embedding_specs
        self.lr, self.eps, self.optimizer, self.output_dtype = learning_rate, eps, optimizer, output_dtype
        self.sizes = [r * d for r, d in embedding_specs]
        self.weight = torch.empty(sum(self.sizes), dtype=weights_precision, device=device)
        rows = sum(r for r, _ in embedding_specs)
        self.momentum = torch.zeros(rows if optimizer == OptimType.EXACT_ROWWISE_ADAGRAD else 1, device=device)
        self.bounds_check_mode = BoundsCheckMode.V2_WARNING
        self._disable_offsets_adjustment = FeatureGateName.DISABLE_OFFSETS_ADJUSTMENT.is_enabled()
        OPTIM_TYPE_TO_INT[optimizer]  # as the real one's backward: a KeyError for other optimizers

    def split_embedding_weights(self):
        return [w.view(r, d) for w, (r, d) in zip(self.weight.detach().split(self.sizes), self.embedding_specs)]

    def split_optimizer_states(self):
        if self.optimizer == OptimType.EXACT_SGD:
            return [() for _ in self.embedding_specs]
        return [(m,) for m in self.momentum.split([r for r, _ in self.embedding_specs])]

    def record_forward_event(self):
        raise AssertionError("the bench replaces this on CPU")

    def forward(self, indices, offsets, per_sample_weights=None, batch_size_per_feature_per_rank=None):
        if VERSION == "boom-forward":
            raise RuntimeError("peer exploded in forward")
        self.record_forward_event()
        T = len(self.embedding_specs)
        B = (offsets.numel() - 1) // T
        tables = [w.clone().float().requires_grad_() for w in self.split_embedding_weights()]
        outs = []
        for t, w in enumerate(tables):
            lo, hi = int(offsets[t * B]), int(offsets[(t + 1) * B])
            psw = None if per_sample_weights is None else per_sample_weights[lo:hi]
            outs.append(torch.nn.functional.embedding_bag(indices[lo:hi].long(), w, offsets[t * B:(t + 1) * B] - lo,
                                                          mode="sum", per_sample_weights=psw))
            w.register_hook(lambda g, t=t: self._step(t, g))
        return torch.cat(outs, 1).to(self.output_dtype)

    def _step(self, t, g):
        w = self.split_embedding_weights()[t]
        if self.optimizer == OptimType.EXACT_SGD:
            w.sub_((self.lr * g).to(w.dtype))
        else:
            m = self.split_optimizer_states()[t][0]
            m.add_(g.pow(2).mean(1))
            w.sub_((self.lr / (m.sqrt() + self.eps))[:, None] * g)
"""


def _fake_checkout(root, version="1"):
    pkg = root / "torchrec" / "distributed" / "triton_tbe"
    pkg.mkdir(parents=True)
    (pkg / "triton_tbe_backward_utils.py").write_text(_FAKE_UTILS)
    (pkg / "triton_tbe_backward_long_run_fused.py").write_text(_FAKE_FUSED)
    (pkg / "triton_table_batched_embeddings.py").write_text(_FAKE_MAIN.replace("{version}", version))
    return root


@pytest.fixture
def bf16_probe(monkeypatch):
    """runner.fbgemm_cuda_bf16_failure with FBGEMM's module replaced by one whose construction raises
    ``probe.message``; its per-process cache cleared before and after (also when the test fails)."""
    import fbgemm_gpu.split_table_batched_embeddings_ops_training as fbgemm_training

    from torchrec_triton_tbe.bench import runner

    probe = type("Probe", (), {"message": ""})()

    class Refusing:
        def __init__(self, *args, **kwargs):
            raise RuntimeError(probe.message)

    monkeypatch.setattr(fbgemm_training, "SplitTableBatchedEmbeddingBagsCodegen", Refusing)
    runner.fbgemm_cuda_bf16_failure.cache_clear()
    yield probe
    runner.fbgemm_cuda_bf16_failure.cache_clear()


def test_fbgemm_cuda_without_bf16_weights_is_a_recorded_skip(bf16_probe):
    """FBGEMM 1.6.0's CUDA TBE raised "not implemented for emb_t 'BFloat16'" on a bf16 shape (H100,
    2026-12-06), which lost ours' numbers too. Its bf16 passes on CUDA are now skipped with the reason a
    one-table probe gives, where the probe names bf16; any other failure of the probe propagates, and
    other weights never probe."""
    from torchrec_triton_tbe.bench import runner

    cuda = torch.device("cuda", 0)
    def w(weights: str):
        return type("W", (), {"case": dataclasses.replace(BenchCase(), weights_precision=weights)})()
    bf16_probe.message = '"batched_embedding_forward_kernel_2" not implemented for emb_t \'BFloat16\''
    reason = runner.skip_reason("fbgemm", w("bf16"), None, cuda)
    assert reason.startswith("FBGEMM's CUDA TBE here runs no bf16 weights") and bf16_probe.message in reason
    bf16_probe.message = "not asked again"
    assert runner.skip_reason("fbgemm", w("bf16"), "exact_sgd", cuda) == reason  # once per process
    assert runner.skip_reason("fbgemm", w("fp16"), None, cuda) is None
    bf16_probe.message = "CUDA out of memory"
    runner.fbgemm_cuda_bf16_failure.cache_clear()
    with pytest.raises(RuntimeError, match="out of memory"):
        runner.skip_reason("fbgemm", w("bf16"), None, cuda)


def test_a_check_with_nothing_to_compare_is_unchecked_not_ok():
    """Where no kernel is compared with ours (FBGEMM skipped on the GPU, where the reference does not run,
    and no peer), --check's verdict is None ("unchecked"), not a pass; one that compared stays ok."""
    from torchrec_triton_tbe.bench import runner

    case = BenchCase(batch_size=4, num_tables=2, num_embeddings=20, embedding_dim=8, bag_size=3, iters=1)
    w = make_workload(case, torch.device("cpu"))
    alone = runner.build_modules(w, "exact_sgd", RunOptions(device=torch.device("cpu")))
    assert list(alone) == ["triton"]
    check = runner.check_first_batch(alone, w, "exact_sgd")
    assert check == {"ok": None}
    checked = runner.check_first_batch(runner.build_modules(w, "exact_sgd", RunOptions(device=torch.device("cpu"))),
                                       w, "exact_sgd", reference=True)
    assert checked["ok"] is True and checked["reference"]["ok"] is True


def test_compare_options():
    parser = build_parser()
    assert parser.parse_args(["--compare", "fbgemm"]).compare == ("fbgemm",)
    args = parser.parse_args(["--compare", "fbgemm,torchrec_triton", "--torchrec-checkout", "/x"])
    assert args.compare == ("fbgemm", "torchrec_triton") and args.torchrec_checkout == "/x"
    assert explicit_options(parser, ["--compare", "torchrec_triton"]) == {"compare": ("torchrec_triton",)}
    with pytest.raises(SystemExit):
        parser.parse_args(["--compare", "fbgemm,shampoo_tbe"])
    # RunOptions: the old boolean still means FBGEMM; ours first, then the others in a fixed order.
    cpu = torch.device("cpu")
    assert RunOptions(cpu, compare=True).kernels == ("triton", "fbgemm")
    assert RunOptions(cpu).kernels == ("triton",)
    assert RunOptions(cpu, compare=("torchrec_triton", "fbgemm"), torchrec_checkout="/x").kernels == (
        "triton", "fbgemm", "torchrec_triton")
    with pytest.raises(ValueError, match="checkout"):
        RunOptions(cpu, compare=("torchrec_triton",))


def test_compare_torchrec_triton_needs_a_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv(peers.CHECKOUT_ENV, raising=False)
    with pytest.raises(SystemExit):
        cli.main(["--compare", "torchrec_triton"])
    with pytest.raises(SystemExit):  # a directory without the files
        cli.main(["--compare", "torchrec_triton", "--torchrec-checkout", str(tmp_path)])
    with pytest.raises(FileNotFoundError, match="triton_table_batched_embeddings.py"):
        peers.load_torchrec_triton(tmp_path)
    monkeypatch.setenv(peers.CHECKOUT_ENV, "/from/env")
    assert peers.checkout_from(None) == "/from/env" and peers.checkout_from("/given") == "/given"


def test_loader_imports_a_checkout_under_torchrecs_names(tmp_path):
    import torchrec.distributed

    cls = peers.load_torchrec_triton(_fake_checkout(tmp_path / "a", "a"))
    try:
        mod = sys.modules[cls.__module__]
        assert cls.__module__ == "torchrec.distributed.triton_tbe.triton_table_batched_embeddings"
        assert mod.__file__ == str((tmp_path / "a/torchrec/distributed/triton_tbe/triton_table_batched_embeddings.py"
                                    ).resolve())
        assert torchrec.distributed.triton_tbe.__path__ == [str((tmp_path / "a/torchrec/distributed/triton_tbe").resolve())]
        assert mod.FUSED == "fused" and mod.VERSION == "a"
        # The ads_mkl stand-in existed only while the files imported; its names refuse to be used.
        assert not any(n == "ads_mkl" or n.startswith("ads_mkl.") for n in sys.modules)
        with pytest.raises(RuntimeError, match="stand-in"):
            mod._amd_fwd_weighted_kernel[(1,)]()
        # FeatureGateName without DISABLE_OFFSETS_ADJUSTMENT: the module sees it, off; the rest passes through.
        assert mod.FeatureGateName.DISABLE_OFFSETS_ADJUSTMENT.is_enabled() is False
        assert mod.FeatureGateName.TBE_V2.value == 1
        module = cls([(5, 4), (3, 8)])
        assert module._disable_offsets_adjustment is False and module.weight.numel() == 44
        assert peers.load_torchrec_triton(tmp_path / "a") is cls  # cached
        # Another checkout replaces the first.
        other = peers.load_torchrec_triton(_fake_checkout(tmp_path / "b", "b"))
        assert other is not cls and sys.modules[other.__module__].VERSION == "b"
        info = peers.describe_torchrec_triton(tmp_path / "b")
        assert set(info["sha256"]) == set(peers.TORCHREC_TRITON_FILES) and info["source"] is None
    finally:
        peers._purge(peers.TORCHREC_TRITON_PACKAGE)
        peers._loaded.clear()


def test_peer_skips_are_recorded_not_faked(tmp_path, capsys, monkeypatch):
    """What the peer lacks is {"skipped": why} in that pass's entry and its check, with one log line;
    what it has is timed (speedup_torchrec_triton = its median / ours) and checked against ours."""
    # The fake's backward runs on CPU (the real one's needs FBGEMM's CUDA transpose_embedding_input).
    monkeypatch.setattr(peers, "_has_kernel", lambda op, key: True)
    checkout = _fake_checkout(tmp_path / "tr")
    base = ["--batch-size", "4", "--num-tables", "2", "--num-embeddings", "20", "--embedding-dim", "8",
            "--bag-size", "3", "--iters", "1", "--compare", "fbgemm,torchrec_triton", "--torchrec-checkout",
            str(checkout), "--check", "--optimizer", "exact_rowwise_adagrad,exact_adagrad"]
    try:
        assert cli.main(base + ["--json", str(tmp_path / "sum.json")]) == 0
        out = capsys.readouterr().out
        record = json.loads((tmp_path / "sum.json").read_text())
        assert record["compare"] == "fbgemm,torchrec_triton"
        assert record["torchrec_triton"]["checkout"] == str(checkout.resolve())
        (shape,) = record["shapes"]
        res, check = shape["results"], shape["check"]
        for key in ("fwd", "bwd_exact_rowwise_adagrad"):
            e = res[key]
            assert e["speedup"] == pytest.approx(e["fbgemm"]["median_ms"] / e["triton"]["median_ms"])
            assert e["speedup_torchrec_triton"] == pytest.approx(e["torchrec_triton"]["median_ms"] / e["triton"]["median_ms"])
        lines = [p for p in map(parse_log_line, out.splitlines()) if p]
        assert {p["prefix"] for p in lines} == {"triton", "fbgemm", "torchrec_triton", "triton exact_rowwise_adagrad",
                                                "fbgemm exact_rowwise_adagrad", "torchrec_triton exact_rowwise_adagrad",
                                                "triton exact_adagrad", "fbgemm exact_adagrad"}
        assert "speedup_torchrec_triton fwd (torchrec_triton / triton median)" in out
        # exact_adagrad: not in the peer; its forward was still timed (built with exact_sgd).
        assert res["bwd_exact_adagrad"]["torchrec_triton"] == {"skipped": "optimizer exact_adagrad: TorchRec's Triton "
                                                               "TBE implements exact_sgd, exact_rowwise_adagrad only"}
        assert "speedup_torchrec_triton" not in res["bwd_exact_adagrad"] and "speedup" in res["bwd_exact_adagrad"]
        assert out.count("torchrec_triton exact_adagrad Backward: skipped (optimizer exact_adagrad") == 1
        rwa = check["exact_rowwise_adagrad"]["torchrec_triton"]
        assert rwa["ok"] and rwa["output"]["mismatched"] == 0 and rwa["weights_after_backward"]["numel"] == 20 * 8 * 2
        assert rwa["state_after_backward"]["ok"]
        ada = check["exact_adagrad"]["torchrec_triton"]
        assert ada["output"]["ok"] and "skipped" in ada["weights_after_backward"]
        assert check["exact_adagrad"]["output"]["ok"] and check["exact_adagrad"]["weights_after_backward"]["ok"]

        # MEAN pooling: nothing of the peer runs; every pass and the check say so.
        assert cli.main(base + ["--pooling", "mean", "--json", str(tmp_path / "mean.json")]) == 0
        out = capsys.readouterr().out
        shape = json.loads((tmp_path / "mean.json").read_text())["shapes"][0]
        why = {"skipped": "pooling mean: TorchRec's Triton TBE implements SUM only"}
        assert all(e["torchrec_triton"] == why and "speedup_torchrec_triton" not in e for e in shape["results"].values())
        assert all(c["torchrec_triton"] == why and c["ok"] for c in shape["check"].values())
        assert out.count("skipped (pooling mean") == 3  # fwd and two backwards
        assert not [p for p in map(parse_log_line, out.splitlines()) if p and p["prefix"].startswith("torchrec")]
    finally:
        peers._purge(peers.TORCHREC_TRITON_PACKAGE)
        peers._loaded.clear()


@pytest.mark.skipif(not os.environ.get(peers.CHECKOUT_ENV), reason=f"${peers.CHECKOUT_ENV} (a TorchRec checkout) unset")
@pytest.mark.parametrize("argv", [
    ["--weights-precision", "fp16", "--indices-dtype", "32"],
    ["--num-tables", "3", "--batch-size-list", "4,7,2", "--bag-size-list", "2,4,1", "--num-embeddings-list",
     "30,60,7", "--embedding-dim-list", "8,12,16", "--weighted"],
], ids=["fp16-int32", "vbe-weighted"])
def test_real_torchrec_triton_forward_matches_ours(tmp_path, argv):
    """TorchRec's real Triton TBE (from $TORCHREC_CHECKOUT) under Triton's interpreter: its forward
    against ours. On CPU its backward is skipped (FBGEMM's transpose_embedding_input is CUDA-only)."""
    out_json = tmp_path / "r.json"
    argv = ["--batch-size", "4", "--num-tables", "2", "--num-embeddings", "30", "--embedding-dim", "8",
            "--bag-size", "3", *argv, "--iters", "1", "--compare", "torchrec_triton", "--check",
            "--optimizer", "exact_rowwise_adagrad", "--json", str(out_json)]
    try:
        assert cli.main(argv) == 0
        shape = json.loads(out_json.read_text())["shapes"][0]
        assert "error" not in shape, shape.get("error")
        check = shape["check"]["exact_rowwise_adagrad"]["torchrec_triton"]
        assert check["ok"] and check["output"]["mismatched"] == 0 and check["output"]["numel"] > 0
        assert "median_ms" in shape["results"]["fwd"]["torchrec_triton"]
        if not torch.cuda.is_available():
            assert "transpose_embedding_input" in shape["results"]["bwd_exact_rowwise_adagrad"]["torchrec_triton"]["skipped"]
    finally:
        peers._purge(peers.TORCHREC_TRITON_PACKAGE)
        peers._loaded.clear()


@pytest.mark.parametrize("version,why", [("boom-init", "ValueError: peer refused its arguments"),
                                         ("boom-forward", "RuntimeError: peer exploded in forward")])
def test_a_failing_peer_is_recorded_and_the_shape_kept(tmp_path, capsys, monkeypatch, version, why):
    """A peer that raises (building, in its check, or while timed) gets {"error": why} in every entry
    and in the check, with a log line; ours and FBGEMM's numbers for the shape are kept."""
    monkeypatch.setattr(peers, "_has_kernel", lambda op, key: True)
    checkout = _fake_checkout(tmp_path / "tr", version)
    argv = ["--batch-size", "4", "--num-tables", "2", "--num-embeddings", "20", "--embedding-dim", "8",
            "--bag-size", "3", "--iters", "1", "--compare", "fbgemm,torchrec_triton", "--torchrec-checkout",
            str(checkout), "--check", "--optimizer", "exact_rowwise_adagrad", "--json", str(tmp_path / "r.json")]
    try:
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        shape = json.loads((tmp_path / "r.json").read_text())["shapes"][0]
        assert "error" not in shape
        for entry in shape["results"].values():
            assert entry["torchrec_triton"] == {"error": why}, entry
            assert "median_ms" in entry["triton"] and "median_ms" in entry["fbgemm"] and "speedup" in entry
            assert "speedup_torchrec_triton" not in entry
        check = shape["check"]["exact_rowwise_adagrad"]
        assert check["torchrec_triton"] == {"error": why} and check["ok"], check
        assert f"torchrec_triton error: {why}" in out and out.count(f"error ({why})") == 2
    finally:
        peers._purge(peers.TORCHREC_TRITON_PACKAGE)
        peers._loaded.clear()


def test_a_failed_shape_is_released_before_the_next(tmp_path, monkeypatch):
    """A shape that raises is recorded with its error, and the cache is emptied only once the error's
    traceback (which holds the shape's modules and batches through its frames) is gone: emptied inside
    the except block, a failed shape's memory stayed cached and the next shape ran out of memory."""
    import gc
    import weakref

    class Held:  # stands for the failed shape's modules
        pass

    refs, alive_at_release = [], []

    def failing_run_case(workload, opts, emit, baseline_ms):
        held = Held()
        refs.append(weakref.ref(held))
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(cli, "run_case", failing_run_case)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: alive_at_release.append(refs[-1]() is not None))
    argv = ["--batch-size", "4", "--num-tables", "2", "--num-embeddings", "20", "--embedding-dim", "8",
            "--bag-size", "3", "--iters", "1", "--json", str(tmp_path / "r.json")]
    assert cli.main(argv) == 1
    (shape,) = json.loads((tmp_path / "r.json").read_text())["shapes"]
    assert "OutOfMemoryError: CUDA out of memory (simulated)" in shape["error"]
    gc.collect()
    assert alive_at_release == [False] and refs[0]() is None
