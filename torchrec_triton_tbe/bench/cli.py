"""``torchrec-triton-tbe-bench``: TritonTBE vs FBGEMM's TBE, in FBGEMM's benchmark format.

    # FBGEMM's default shape, ours only (options and defaults as FBGEMM's `device` command)
    torchrec-triton-tbe-bench --weights-precision fp16
    # the H200 suite, A/B against FBGEMM in the same process, checked, with JSON and plot
    torchrec-triton-tbe-bench --suite h200 --compare fbgemm --check --json h200.json --plot h200.png
    # a third contender: TorchRec's Triton TBE, from a checkout (tools/stage_torchrec_triton.sh)
    torchrec-triton-tbe-bench --suite h200 --compare fbgemm,torchrec_triton --torchrec-checkout .stage/torchrec
    # FBGEMM's device-with-spec and vbe command lines, as written for FBGEMM's benchmark
    torchrec-triton-tbe-bench device-with-spec --embedding-dim-list 8,64 --num-embeddings-list 50,100000 \
        --bag-size-list 1,40 --bag-size-sigma-list 0,20 --compare fbgemm
    torchrec-triton-tbe-bench vbe --batch-size-list 4096,512 --embedding-dim-list 64,16 --bag-size-list 20,1 \
        --num-embeddings-list 100000,50 --num-tables 2 --compare fbgemm

The JSON records the GPU, clocks, versions, git commit (TORCHREC_TRITON_TBE_GIT_COMMIT if set — on a
copy of the tree without .git, or with a stale one — else ``git rev-parse HEAD``) and a sha256 of the package sources. A suite too long for one
command can run in parts (``--only a,b``) and be merged: ``python -m torchrec_triton_tbe.bench.report``.

Per case it prints FBGEMM's lines (``Forward, B: ..., BW: X GB/s, T: Yus``; ``Backward, ...``), one per
kernel, prefixed by the kernel (and optimizer), then the speed-up (FBGEMM median / ours; a peer's as
``speedup_<kernel>``, its median / ours, or one ``<kernel> ...: skipped (why)`` line for a pass it cannot
run). Exit status 1 when a case failed or ``--check`` found a mismatch.
"""

from __future__ import annotations

import gc
import logging
import sys
import traceback
from typing import Any, Optional, Sequence

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from torchrec_triton_tbe import _env
from torchrec_triton_tbe.bench import peers
from torchrec_triton_tbe.bench.batches import make_workload
from torchrec_triton_tbe.bench.case import (
    CASE_FIELDS,
    FBGEMM_COMMANDS,
    FBGEMM_CPU_COMPARE,
    check_fbgemm_only_options,
    device_with_spec_options,
    SuiteShape,
    UnknownShapes,
    build_parser,
    case_from_mapping,
    explicit_options,
    load_suite,
    resolve_optimizers,
)
from torchrec_triton_tbe.bench.report import environment, nvidia_smi_clocks, write_json, write_plot
from torchrec_triton_tbe.bench.runner import RunOptions, run_case
from torchrec_triton_tbe.bench.timing import TIMED_BY_EVENTS, TIMED_BY_WALL_CLOCK, measure_copy_bandwidth
from torchrec_triton_tbe.bench.vbe_command import build_vbe_parser, vbe_case
from torchrec_triton_tbe.bench.vbe_command import ignored as vbe_ignored
from torchrec_triton_tbe.bench.vbe_command import refused as vbe_refused


def _device() -> torch.device:
    if torch.cuda.is_available() and not _env.interpreting():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _shapes(args, given: dict[str, Any]) -> tuple[Optional[dict], list[SuiteShape]]:
    optimizers = resolve_optimizers(args, given)
    overrides = {k: v for k, v in given.items() if k in CASE_FIELDS}
    if optimizers is not None:
        overrides["optimizers"] = optimizers
    if args.suite:
        try:
            return load_suite(args.suite, overrides, args.only or None)
        except UnknownShapes as e:
            raise SystemExit(str(e)) from None
    if args.only:
        raise SystemExit("--only picks shapes of a suite: give --suite too")
    values = {k: getattr(args, k) for k in CASE_FIELDS}
    values.update(overrides)
    return None, [SuiteShape(case_from_mapping(values, "cli"), None)]


def _ms(timing: dict[str, Any]) -> str:
    """A compared kernel's cell of the summary: its median, ``skipped`` or blank (not run, or failed)."""
    if "skipped" in timing:
        return "skipped"
    return "" if timing.get("median_ms") is None else f"{timing['median_ms']:.3f}"


def _summary(record: dict[str, Any]) -> list[str]:
    peer_names = [k for k in (record.get("compare") or "").split(",") if k and k != "fbgemm"]
    head = f"{'shape':<28} {'pass':<28} {'triton ms':>10} {'fbgemm ms':>10} {'speed-up':>9} {'baseline':>9}"
    lines = [head + "".join(f" {p + ' ms':>20} {'speed-up':>9}" for p in peer_names)]
    for shape in record["shapes"]:
        if "error" in shape:
            lines.append(f"{shape['name']:<28} ERROR {shape['error'].splitlines()[-1][:80]}")
            continue
        for key, entry in shape["results"].items():
            sp = entry.get("speedup")
            base = entry.get("baseline_ms")
            line = (
                f"{shape['name']:<28} {key:<28} {entry['triton']['median_ms']:>10.3f} "
                f"{_ms(entry.get('fbgemm', {})):>10} {'' if sp is None else f'{sp:.3f}x':>9} "
                f"{'' if base is None else f'{base:.3f}':>9}"
            )
            for p in peer_names:
                psp = entry.get(f"speedup_{p}")
                line += f" {_ms(entry.get(p, {})):>20} {'' if psp is None else f'{psp:.3f}x':>9}"
            lines.append(line)
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = None
    if argv[:1] and argv[0] in FBGEMM_COMMANDS:
        command, argv = argv[0], argv[1:]  # FBGEMM's command line names its command first
    if command == "vbe":  # FBGEMM's vbe command: its own option names (bench/vbe_command.py)
        parser = build_vbe_parser()
        args = parser.parse_args(argv)
        given = None
        refused = vbe_refused(args)
        for note in vbe_ignored(args):
            print(note)
    else:
        parser = build_parser()
        args = parser.parse_args(argv)
        given = explicit_options(parser, argv)
        refused = check_fbgemm_only_options(args)
    if refused:
        parser.error(refused)
    if command == "device-with-spec":
        try:
            given = device_with_spec_options(args, given)
        except ValueError as exc:
            parser.error(str(exc))
    if args.compare == FBGEMM_CPU_COMPARE:
        parser.error("--compare without a value is FBGEMM's flag (fbgemm-gpu >= 1.8: rerun on FBGEMM's CPU TBE and "
                     "compare), not run here; this CLI's --compare names the kernels to time against ours: "
                     "--compare fbgemm (and/or torchrec_triton)")
    if args.check and not args.compare:
        parser.error("--check compares against another kernel: add --compare fbgemm (and/or torchrec_triton)")
    compare = tuple(dict.fromkeys(args.compare or ()))  # as given, once each
    checkout = peers.checkout_from(args.torchrec_checkout)
    if "torchrec_triton" in compare:
        if not checkout:
            parser.error(f"--compare torchrec_triton needs --torchrec-checkout PATH (or ${peers.CHECKOUT_ENV})")
        try:
            peers.load_torchrec_triton(checkout)  # fail here, not in every shape
        except (FileNotFoundError, ImportError) as exc:
            parser.error(f"--torchrec-checkout: {exc}")
    if not args.verbose:
        # fbgemm_gpu's request module calls logging.basicConfig(DEBUG) on import, and its TBE logs its
        # configuration at INFO; keep warnings (the generator's uniform fallback is one).
        logging.getLogger().setLevel(logging.WARNING)
    try:
        header, shapes = (None, [SuiteShape(vbe_case(args), None)]) if command == "vbe" else _shapes(args, given)
    except (ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))

    device = _device()
    opts = RunOptions(
        device=device,
        compare=compare,
        check=args.check,
        kernel_config=args.kernel_config,
        fused_bounds_check=args.fused_bounds_check,
        hoist_transpose=args.hoist_transpose,
        torchrec_checkout=checkout if "torchrec_triton" in compare else None,
    )
    cuda = device.type == "cuda"
    record: dict[str, Any] = {
        "environment": environment(device, argv if command is None else [command, *argv]),  # as typed
        "suite": header,
        "compare": ",".join(compare) if compare else None,  # "fbgemm" as it always was
        "timing_method": TIMED_BY_EVENTS if cuda else TIMED_BY_WALL_CLOCK,
        "timing_meaningful": cuda,
        "byte_model": "FBGEMM's read_write_bytes: out_bytes*B*sum(Ds) + param_bytes*B*sum(Ds)*L (device); with "
                      "per-table lists sum over t of out_bytes*B_t*D_t + param_bytes*B_t*D_t*L_t (device-with-spec's "
                      "sum_DLs); pooling none writes L_t rows per bag; backward GB/s uses 2x",
        "speedup_definition": "fbgemm median ms / triton median ms (> 1: TritonTBE faster)",
        **({"peer_speedup_definition": "speedup_<kernel>: <kernel> median ms / triton median ms; a pass the "
            "kernel cannot run has {\"skipped\": reason} in place of its times"}
           if any(k != "fbgemm" for k in compare) else {}),
        **({"torchrec_triton": peers.describe_torchrec_triton(checkout)} if "torchrec_triton" in compare else {}),
        "copy_bandwidth": measure_copy_bandwidth(device=device) if cuda else None,
        "shapes": [],
    }
    if not cuda:
        print("NOTE: no CUDA device; kernels run under Triton's interpreter and times measure the interpreter.")
    if record["copy_bandwidth"]:
        print(f"Device-to-device copy: {record['copy_bandwidth']['gbps']:.0f} GB/s (read + write)")
    # On a terminal, lines go through tqdm.write so the bar stays at the bottom. Into a file or pipe,
    # they are plain prints: tqdm.write would redraw the bar (a line of output) after every line.
    emit = tqdm.write if sys.stderr.isatty() else (lambda line: print(line, flush=True))
    failed = False
    with logging_redirect_tqdm():
        # No bar into a file or pipe either: with stderr and stdout merged (2>&1 | tee) its redraws glued
        # each shape's first line onto it.
        bar = tqdm(shapes, desc="shapes", unit="shape", disable=header is None or not sys.stderr.isatty(),
                   file=sys.stderr)
        for shape in bar:
            bar.set_postfix_str(shape.case.name, refresh=False)
            workload = None
            try:
                workload = make_workload(shape.case, device)
                result = run_case(workload, opts, emit, shape.baseline_ms)
                if shape.note:
                    result["note"] = shape.note
                workload = None  # free the batches before the next shape's
                checks = result["check"] or {}
                failed |= any(c["ok"] is False for c in checks.values())  # None: nothing to compare with
            except Exception:  # one broken shape must not lose a long suite's other results
                failed = True
                tb = traceback.format_exc()
                emit(f"[{shape.case.name}] FAILED:\n{tb}")
                result = {"name": shape.case.name, "options": shape.case.options(), "error": tb,
                          "generator": None if workload is None else workload.stats}
                workload = None
            if "error" in result:
                # Only after the except block: until it ends, the error's traceback holds the failed shape's
                # frames and with them its modules and batches (an out-of-memory error in its third module
                # keeps the first two), and the cache cannot give their memory back. Left cached, it is not
                # the next shape's everywhere: a CUDA-graph capture takes none of it (session 50's H200 run:
                # prod_t40_b16k_sigma's capture failed with 122 GiB cached after prod_t100_b2k_fp32's
                # check had run out of memory).
                gc.collect()
                torch.cuda.empty_cache()  # a no-op where CUDA was never initialised
            record["shapes"].append(result)
            if args.json:
                write_json(args.json, record)
    record["environment"]["clocks_mhz_at_end"] = nvidia_smi_clocks(device)
    if not record.get("timing_meaningful", True):
        print("NOTE: times and speed-ups below are Triton's interpreter on the CPU, not kernel times")
    for line in _summary(record):
        print(line)
    if args.json:
        write_json(args.json, record)
        print(f"wrote {args.json}")
    if args.plot:
        if not any(s.get("results") for s in record["shapes"]):
            print("no results to plot")
        else:
            try:
                write_plot(args.plot, record)
                print(f"wrote {args.plot}")
            except ImportError:
                print("matplotlib is not installed: no plot (the JSON has everything; re-plot later with "
                      "python -m torchrec_triton_tbe.bench.report --plot PNG JSON...)")
                failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
