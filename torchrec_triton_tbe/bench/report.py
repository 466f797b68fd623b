"""FBGEMM's byte model and log lines, the environment record, JSON and the plot.

Byte model (FBGEMM's ``device`` command, pooled output):

    read_write_bytes = out_bytes * B * sum(Ds)  +  param_bytes * B * sum(Ds) * L
                       (write the pooled output)   (read one weight row per lookup)

Index/offset reads, optimizer state and grad_output are not counted. Forward GB/s is
``read_write_bytes / t``; backward GB/s is ``2 * read_write_bytes / t`` (FBGEMM's convention).

Re-plot or merge earlier results (e.g. a suite run in several parts):

    python -m torchrec_triton_tbe.bench.report [--plot all.png] [--json all.json] part1.json part2.json
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

BYTES_PER_ELEMENT = {"fp32": 4, "fp16": 2, "bf16": 2}  # SparseType.bit_rate() / 8 for TritonTBE's types


def read_write_bytes(B: int, Ds: Sequence[int], L: float, weights_precision: str, output_dtype: str,
                     pooled: bool = True) -> float:
    """FBGEMM's ``read_write_bytes`` (``split_table_batched_embeddings_benchmark.py device``)."""
    param, out = BYTES_PER_ELEMENT[weights_precision], BYTES_PER_ELEMENT[output_dtype]
    out_rows = 1 if pooled else L  # pooling none writes one row per lookup
    return out * B * sum(Ds) * out_rows + param * B * sum(Ds) * L


def case_bytes(case, Ds: Sequence[int]) -> float:
    """read_write_bytes of a case, table by table where it has per-table batch or bag sizes (FBGEMM's
    formula summed over tables: out * B_t * D_t * rows + param * B_t * D_t * L_t, rows = L_t for NONE)."""
    if not case.per_table:
        return read_write_bytes(case.batch_size, Ds, case.bag_size, case.weights_precision, case.output_dtype,
                                pooled=case.pooling != "none")
    return sum(read_write_bytes(case.batch_size_at(t), [d], case.bag_size_at(t), case.weights_precision,
                                case.output_dtype, pooled=case.pooling != "none") for t, d in enumerate(Ds))


def gbps(nbytes: float, ms: float, backward: bool = False) -> float:
    return (2 if backward else 1) * nbytes / (ms * 1e-3) / 1e9


def log_line(prefix: str, backward: bool, B: int, E: int, T: int, D, L: int, weighted: bool, bw_gbps: float,
             us: float, alpha: Optional[float] = None) -> str:
    """FBGEMM's line, e.g. ``Forward, B: 512, E: 100000, T: 32, D: 128, L: 20, W: False, a: 1.0, BW:  654.43
    GB/s, T: 141us`` (FBGEMM's ``{: .2f}`` leaves a sign space after ``BW:``; its Backward line has no
    ``W:``; ``a:``, the Zipf alpha, is in FBGEMM's lines since 1.x and left out when ``alpha`` is None),
    after a ``prefix`` naming kernel and optimizer, as FBGEMM's own ``{weights_precision} Forward``."""
    pass_ = "Backward" if backward else "Forward"
    weighted_part = "" if backward else f"W: {weighted}, "
    alpha_part = "" if alpha is None else f"a: {alpha}, "
    line = (f"{pass_}, B: {B}, E: {E}, T: {T}, D: {D}, L: {L}, {weighted_part}{alpha_part}"
            f"BW: {bw_gbps: .2f} GB/s, T: {us:.0f}us")
    return f"{prefix} {line}" if prefix else line


def spec_log_line(prefix: str, backward: bool, B: int, Es: Sequence[int], Ds: Sequence[int], Ls: Sequence[int],
                  sigmas: Optional[Sequence[int]], weighted: bool, alpha, bw_gbps: float, us: float) -> str:
    """FBGEMM's ``device-with-spec`` line, e.g. ``Forward, B: 512, Es: [100, 2000], T: 2, Ds: [8, 16], Ls: [4,
    20], W: False, a: 1.0, BW:  1.25 GB/s, T: 34us`` (``Ls: mu [...] sigma [...]`` with bag-size sigmas; the
    Backward line has no ``W:``); ``alpha`` is FBGEMM's one alpha, or our per-table list."""
    pass_ = "Backward" if backward else "Forward"
    Ls_str = f"{list(Ls)}" if sigmas is None else f"mu {list(Ls)} sigma {list(sigmas)}"
    weighted_part = "" if backward else f"W: {weighted}, "
    line = (f"{pass_}, B: {B}, Es: {list(Es)}, T: {len(Ds)}, Ds: {list(Ds)}, Ls: {Ls_str}, {weighted_part}"
            f"a: {alpha}, BW: {bw_gbps: .2f} GB/s, T: {us:.0f}us")
    return f"{prefix} {line}" if prefix else line


_LINE = re.compile(
    r"^(?P<prefix>.*?)\s*(?P<pass_>Forward|Backward), B: (?P<B>\d+), E: (?P<E>\d+), T: (?P<T>\d+), "
    r"D: (?P<D>[\d.]+), L: (?P<L>\d+), (?:W: (?P<W>True|False), )?(?:a: (?P<a>[\d.]+), )?"
    r"BW:\s*(?P<BW>[\d.]+)\s*GB/s, T: (?P<us>\d+)us$"
)


_SPEC_LINE = re.compile(
    r"^(?P<prefix>.*?)\s*(?P<pass_>Forward|Backward), B: (?P<B>\d+), Es: \[(?P<Es>[\d, ]*)\], T: (?P<T>\d+), "
    r"Ds: \[(?P<Ds>[\d, ]*)\], Ls: (?P<Ls>.*?), (?:W: (?P<W>True|False), )?(?:a: (?P<a>[^B]*?), )?"
    r"BW:\s*(?P<BW>[\d.]+)\s*GB/s, T: (?P<us>\d+)us$"
)


def _alpha(text: Optional[str]) -> Any:
    """A spec line's ``a:``: None where absent (fbgemm-gpu 1.6.0 prints none), a float, or a list as printed."""
    if text is None:
        return None
    return float(text) if re.fullmatch(r"[\d.]+", text) else text


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_log_line(line: str) -> Optional[dict[str, Any]]:
    """Parse a Forward/Backward line (ours or FBGEMM's, with or without the ``a:`` field that fbgemm-gpu
    1.6.0 does not print; the ``device-with-spec`` lines give ``Es``, ``Ds`` lists and ``Ls`` as printed,
    in place of E, D, L)."""
    spec = _SPEC_LINE.match(line.strip())
    if spec:
        d = spec.groupdict()
        return {
            "prefix": d["prefix"], "pass": d["pass_"], "B": int(d["B"]), "Es": _ints(d["Es"]), "T": int(d["T"]),
            "Ds": _ints(d["Ds"]), "Ls": d["Ls"], "W": None if d["W"] is None else d["W"] == "True",
            "alpha": _alpha(d["a"]), "BW_GBps": float(d["BW"]), "T_us": int(d["us"]),
        }
    m = _LINE.match(line.strip())
    if not m:
        return None
    d = m.groupdict()
    return {
        "prefix": d["prefix"],
        "pass": d["pass_"],
        "B": int(d["B"]), "E": int(d["E"]), "T": int(d["T"]), "D": float(d["D"]), "L": int(d["L"]),
        "W": None if d["W"] is None else d["W"] == "True",
        "alpha": None if d["a"] is None else float(d["a"]),
        "BW_GBps": float(d["BW"]),
        "T_us": int(d["us"]),
    }


# ---------------------------------------------------------------------------------------------- environment
def _run(cmd: list[str], cwd: Optional[Path] = None) -> Optional[str]:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def nvidia_smi_clocks(device: torch.device) -> Optional[dict[str, Any]]:
    """Current and max clocks (MHz) of this GPU as nvidia-smi reports them at the moment of the call."""
    if device.type != "cuda" or shutil.which("nvidia-smi") is None:
        return None
    fields = ["clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem"]
    select = []
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if uuid is not None:  # CUDA_VISIBLE_DEVICES may renumber GPUs; the UUID does not change
        select = ["-i", f"GPU-{uuid}"]
    out = _run(["nvidia-smi", *select, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"])
    if not out and select:
        out = _run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"])
    if not out:
        return None
    values = [v.strip() for v in out.splitlines()[0].split(",")]
    return {f: (int(v) if v.isdigit() else v) for f, v in zip(fields, values)}


def source_digest(repo: Path) -> str:
    """sha256 over the package's Python files and the YAML configs (paths and contents)."""
    h = hashlib.sha256()
    files = sorted([*(repo / "torchrec_triton_tbe").rglob("*.py"), *(repo / "configs").rglob("*.yaml")])
    for f in files:
        h.update(str(f.relative_to(repo)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def environment(device: torch.device, argv: Sequence[str]) -> dict[str, Any]:
    import triton

    import torchrec_triton_tbe

    try:
        import fbgemm_gpu

        fbgemm = {"version": getattr(fbgemm_gpu, "__version__", None),
                  "variant": getattr(fbgemm_gpu, "__variant__", None)}
    except ImportError:
        fbgemm = None
    repo = Path(torchrec_triton_tbe.__file__).resolve().parent.parent
    # An explicit commit wins: a copy of the tree on a GPU machine may carry no .git, or a stale one.
    commit = os.environ.get("TORCHREC_TRITON_TBE_GIT_COMMIT")
    status = None
    if not commit:
        commit = _run(["git", "rev-parse", "HEAD"], cwd=repo)
        status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo) if commit else None
    gpu = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = {
            "name": props.name,
            "sm_count": props.multi_processor_count,
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "l2_cache_mib": getattr(props, "L2_cache_size", 0) / 2**20 or None,
        }
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command_line": shlex.join(["torchrec-triton-tbe-bench", *argv]),
        "device": str(device),
        "gpu": gpu,
        "clocks_mhz_at_start": nvidia_smi_clocks(device),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "triton": triton.__version__,
            "fbgemm_gpu": fbgemm,
            "torchrec_triton_tbe": torchrec_triton_tbe.__version__,
        },
        "git_commit": commit,
        # Tuning happens on uncommitted trees: say so, or the commit alone misleads.
        "git_dirty": None if status is None else bool(status),
        # Identifies the code that ran even without git (or with uncommitted edits).
        "source_sha256": source_digest(repo),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "kernel_config_env": os.environ.get("TORCHREC_TRITON_TBE_CONFIG"),
    }


def write_json(path: str, record: dict[str, Any]) -> None:
    tmp = Path(path).with_suffix(".json.tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(json.dumps(record, indent=2, default=str) + "\n")
    tmp.replace(path)  # a crash mid-suite leaves the previous complete file, never half a file


# ---------------------------------------------------------------------------------------------- plot
def _pass_keys(shapes: list[dict]) -> list[str]:
    keys: list[str] = []
    for shape in shapes:
        for k in shape.get("results", {}):
            if k not in keys:
                keys.append(k)
    return keys


def write_plot(path: str, record: dict[str, Any]) -> None:
    """One row per pass: GB/s per shape for each kernel (left) and FBGEMM time / ours (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = [s for s in record["shapes"] if s.get("results")]
    passes = _pass_keys(shapes)
    if not passes:
        raise ValueError("nothing to plot: no shape has results")
    names = [s["name"] for s in shapes]
    x = list(range(len(names)))
    width = 0.4
    fig, axes = plt.subplots(len(passes), 2, figsize=(max(8.0, 0.9 * len(names) + 4), 3.2 * len(passes)),
                             squeeze=False, gridspec_kw={"width_ratios": [2, 1]})
    copy_bw = (record.get("copy_bandwidth") or {}).get("gbps")
    meaningful = record.get("timing_meaningful", True)
    for row, key in enumerate(passes):
        ax_bw, ax_sp = axes[row]
        for k, (kernel, color) in enumerate((("triton", "tab:blue"), ("fbgemm", "tab:orange"))):
            vals = [((s["results"].get(key) or {}).get(kernel) or {}).get("gbps") for s in shapes]
            if any(v is not None for v in vals):
                ax_bw.bar([i + (k - 0.5) * width for i in x], [v or 0 for v in vals], width, label=kernel, color=color)
        if copy_bw:
            ax_bw.axhline(copy_bw, color="gray", linestyle="--", linewidth=1, label=f"D2D copy {copy_bw:.0f} GB/s")
        ax_bw.set_ylabel("GB/s (FBGEMM byte model)")
        ax_bw.set_title(key)
        ax_bw.legend(fontsize=7)
        speedups = [(s["results"].get(key) or {}).get("speedup") for s in shapes]
        colors = ["tab:green" if (v or 0) >= 1 else "tab:red" for v in speedups]
        bars = ax_sp.bar(x, [v or 0 for v in speedups], color=colors)
        ax_sp.bar_label(bars, labels=["" if v is None else f"{v:.2f}" for v in speedups], fontsize=6)
        ax_sp.axhline(1.0, color="black", linewidth=0.8)
        ax_sp.set_ylabel("FBGEMM ms / ours")
        ax_sp.set_title("speed-up (> 1: ours faster)")
        for ax in (ax_bw, ax_sp):
            ax.set_xticks(x)
            ax.set_xticklabels(names, rotation=45, ha="right", fontsize=7)
    env = record.get("environment", {})
    gpu = (env.get("gpu") or {}).get("name", env.get("device", "?"))
    if env.get("git_commit"):
        commit = "commit " + env["git_commit"][:10] + ("+dirty" if env.get("git_dirty") else "")
    else:
        commit = "source sha256 " + str(env.get("source_sha256"))[:10]
    title = f"TritonTBE vs FBGEMM TBE on {gpu}  ({env.get('date', '')}, {commit})"
    if not meaningful:
        title += "\nCPU / Triton interpreter: times are NOT kernel times"
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# What every merged run must share: the merged record keeps the first run's header, so a run timed
# elsewhere (another GPU, the interpreter, other versions) would be labelled with the wrong environment.
_SAME_ENVIRONMENT: tuple[tuple[str, Callable[[dict], Any]], ...] = (
    ("timing (kernel times or the interpreter's)", lambda r: r.get("timing_meaningful", True)),
    ("device type", lambda r: str(r.get("environment", {}).get("device") or "").split(":")[0]),  # cuda:0 = cuda:1
    ("GPU", lambda r: (r.get("environment", {}).get("gpu") or {}).get("name")),
    ("versions", lambda r: r.get("environment", {}).get("versions")),
)


def merge(records: Sequence[dict[str, Any]], note: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Shapes of several runs in one record (the first run's header; later shapes win on name clashes, a
    re-run replacing its shape: ``note`` gets a line for each, as single-case runs are all named "cli").
    Runs of another environment are refused (``ValueError``); other commits, and kernels compared in some
    runs only, are noted (``compare`` becomes the union)."""
    first = records[0]
    for i, rec in enumerate(records[1:], start=2):
        for what, get in _SAME_ENVIRONMENT:
            if get(rec) != get(first):
                raise ValueError(f"input {i} was measured with another {what} than input 1 ({get(rec)!r} vs "
                                 f"{get(first)!r}): its shapes would carry input 1's environment")
        commit, first_commit = (r.get("environment", {}).get("git_commit") for r in (rec, first))
        if commit != first_commit:
            note(f"input {i} is at commit {commit}, input 1 at {first_commit}; the merged header names input 1's")
    merged = dict(first)
    kernels = [k for r in records for k in (r.get("compare") or "").split(",") if k]
    if any((r.get("compare") or None) != (first.get("compare") or None) for r in records[1:]):
        note("the inputs compared different kernels: compare is their union; a shape has the results its run made")
        merged["compare"] = ",".join(dict.fromkeys(kernels)) or None
    by_name: dict[str, dict] = {}
    for i, rec in enumerate(records):
        for shape in rec["shapes"]:
            if shape["name"] in by_name:
                note(f"shape {shape['name']!r} of input {i + 1} replaces an earlier input's")
            by_name[shape["name"]] = shape
    merged["shapes"] = list(by_name.values())
    merged["merged_from"] = [r.get("environment", {}).get("command_line") for r in records]
    return merged


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Merge benchmark JSON files and plot them")
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--plot", default=None, help="write the plot (at least one of --plot and --json)")
    ap.add_argument("--json", default=None, help="write the merged record")
    args = ap.parse_args(argv)
    records = []
    for p in args.inputs:
        try:
            record = json.loads(Path(p).read_text())
        except (OSError, ValueError) as e:
            ap.error(f"{p}: {e}")
        if not isinstance(record, dict) or not isinstance(record.get("shapes"), list):
            ap.error(f"{p}: not a benchmark JSON (torchrec-triton-tbe-bench --json): it has no shapes")
        records.append(record)
    if not (args.plot or args.json):
        ap.error("nothing to write: give --plot, --json or both")
    try:
        record = merge(records, note=print)
    except ValueError as e:
        ap.error(str(e))
    if args.json:
        write_json(args.json, record)
        print(f"wrote {args.json}")
    if args.plot:
        try:
            write_plot(args.plot, record)
        except ValueError as e:  # no shape with results
            ap.error(f"--plot: {e}")
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
