"""Markdown summary of a benchmark JSON (bench.cli --json): the summary line, per-shape times and
ratios, and each backward's achieved traffic against a floor.

    python tools/perf_table.py docs/results/h200-<date>.json

A backward-only JSON (--passes bwd, several --optimizer) gets the per-optimizer table instead.
A JSON with another contender (--compare fbgemm,torchrec_triton) gets its columns too: its ms and
speedup_<kernel> (its median / ours), "skipped" where it could not run the pass.

Backward floor (row-wise Adagrad): every lookup's gradient row read once (D * 4 B, fp32 output
gradients), every unique row read and written once (2 * D * weight bytes) plus 8 B of state, at the
measured device-to-device copy bandwidth. It ignores the sort, so it is a lower bound.
"""

import json
import math
import sys

WBYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
PEER_LABEL = {"torchrec_triton": "TorchRec-Triton"}


def peers(d: dict) -> list:
    """Contenders besides ours and FBGEMM's that the JSON has entries for (--compare ...,torchrec_triton)."""
    found = {k for s in d["shapes"] for e in s.get("results", {}).values() for k, v in e.items()
             if isinstance(v, dict) and k not in ("triton", "fbgemm")}
    return sorted(found)


def peer_cells(x: dict, peer: str) -> list:
    """[ms, ratio] of one contender in one pass entry: "skipped" / "—" where it has none."""
    t = x.get(peer)
    if t is None:
        return ["—", "—"]
    if "skipped" in t:
        return ["skipped", "—"]
    return [f"{t['median_ms']:.3f}", f"{x[f'speedup_{peer}']:.2f}×"]


def card(env: dict) -> str:
    """The GPU the JSON was measured on, as the tables' first words ("H200", "H100"; else its full name):
    the device tool lends either, and their numbers do not compare."""
    name = (env.get("gpu") or {}).get("name") or "GPU"
    return next((c for c in ("H200", "H100", "B200", "A100") if c in name), name)


def geo(v: list) -> str:
    return f"{math.exp(sum(map(math.log, v)) / len(v)):.2f}×" if v else "—"


def optimizer_table(d: dict) -> None:
    """Backward of every optimizer in the JSON (a run with --passes bwd and several --optimizer): per shape
    ours / FBGEMM ms and the ratio, then each optimizer's geo-mean and worst shape."""
    keys = sorted({k for s in d["shapes"] for k in s["results"] if k.startswith("bwd_")})
    names = [k[len("bwd_"):] for k in keys]
    g = lambda v: math.exp(sum(map(math.log, v)) / len(v))  # noqa: E731
    env = d["environment"]
    others = peers(d)
    print(f"{card(env)} vs FBGEMM {env['versions']['fbgemm_gpu']['version']}, backward per optimizer "
          f"({env['date'][:10]}, {env['git_commit']}); cells: ours ms / FBGEMM ms = FBGEMM / ours"
          + "".join(f"; {PEER_LABEL.get(p, p)} ms = it / ours" for p in others))
    print()
    print("| shape | " + " | ".join(names) + " |")
    print("|" + "---|" * (len(names) + 1))
    ratios = {k: [] for k in keys}
    for s in d["shapes"]:
        cells = [s["name"]]
        for k in keys:
            x = s["results"].get(k)
            if x is None:
                cells.append("—")
                continue
            if "speedup" not in x:  # FBGEMM could not run this pass (bench/runner.py skip_reason)
                cells.append(f"{x['triton']['median_ms']:.3f} / {fbgemm_cell(x)}")
                continue
            t, f, sp = x["triton"]["median_ms"], x["fbgemm"]["median_ms"], x["speedup"]
            ratios[k].append((sp, s["name"]))
            cell = f"{t:.3f} / {f:.3f} = {sp:.2f}×"
            for p in others:
                ms, r = peer_cells(x, p)
                cell += f"; {PEER_LABEL.get(p, p)} {ms}" + ("" if r == "—" else f" = {r}")
            cells.append(cell)
        print("| " + " | ".join(cells) + " |")
    print("| geo-mean (worst) | " + " | ".join(
        f"{g([r for r, _ in ratios[k]]):.2f}× ({min(ratios[k])[0]:.2f}× {min(ratios[k])[1]})" if ratios[k] else "—"
        for k in keys) + " |")


def fbgemm_cell(x: dict) -> str:
    """FBGEMM's cell of a pass it has no time for: "skipped" (it cannot run it) or "—"."""
    return "skipped" if "skipped" in x.get("fbgemm", {}) else "—"


def host_table(d: dict, passes: tuple) -> None:
    """Host issue time per call (bench/timing.py host_median_ms) beside the event time, ours and FBGEMM's:
    where the two come close the pass is host-bound. Absent from JSONs written before the field."""
    if not any("host_median_ms" in x.get("triton", {}) for s in d["shapes"] for x in s["results"].values()):
        return
    names = {"fwd": "fwd", "bwd_exact_sgd": "bwd SGD", "bwd_exact_rowwise_adagrad": "bwd RWA"}
    print()
    print("Host issue time / event time per call, ms (ours; FBGEMM):")
    print()
    print("| shape | " + " | ".join(names[p] for p in passes) + " |")
    print("|" + "---|" * (1 + len(passes)))
    for s in d["shapes"]:
        cells = [s["name"]]
        for p in passes:
            x = s["results"].get(p)
            if x is None or "host_median_ms" not in x.get("triton", {}):
                cells.append("—")
                continue
            cell = "; ".join(f"{x[k]['host_median_ms']:.3f} / {x[k]['median_ms']:.3f}" for k in ("triton", "fbgemm")
                             if "host_median_ms" in x.get(k, {}))
            cells.append(cell)
        print("| " + " | ".join(cells) + " |")


def main(path: str) -> None:
    d = json.load(open(path))
    # Its ratios and the floor are GPU kernel times against FBGEMM's (the bench's JSON says which it holds).
    if not d.get("timing_meaningful", True) or d.get("copy_bandwidth") is None:
        sys.exit(f"{path}: not a GPU run (its times measure Triton's interpreter); perf_table summarises GPU runs")
    if not any("fbgemm" in e for s in d["shapes"] for e in s.get("results", {}).values()):
        sys.exit(f"{path}: FBGEMM was not compared (--compare fbgemm); perf_table's ratios are FBGEMM / ours")
    failed = [s for s in d["shapes"] if "results" not in s]
    for s in failed:  # a shape that raised (e.g. out of memory) has its error instead of results
        print(f"{s['name']}: no results ({str(s.get('error', '?')).strip().splitlines()[-1][:160]})")
    d = dict(d, shapes=[s for s in d["shapes"] if "results" in s])
    if not any("fwd" in s["results"] for s in d["shapes"]):
        optimizer_table(d)
        return
    env = d["environment"]
    copy_gbps = d["copy_bandwidth"]["gbps"]
    fwd, bwd, worst = [], [], (math.inf, "")
    others = peers(d)
    PASSES = ("fwd", "bwd_exact_sgd", "bwd_exact_rowwise_adagrad")
    peer_ratios = {(p, k): [] for p in others for k in PASSES}
    rows, peer_rows = [], []
    for s in d["shapes"]:
        r = s["results"]
        o = s["options"]
        gen = s["generator"]
        D_mean = sum(s["Ds"]) / len(s["Ds"])
        wb = WBYTES[o["weights_precision"]]
        floor_bytes = s["lookups"] * D_mean * 4 + gen["unique_rows"] * (2 * D_mean * wb + 8)
        floor_ms = floor_bytes / copy_gbps / 1e6
        cells = [s["name"], f"{s['lookups'] / 1e6:.2f}M"]
        pcells = [s["name"]]
        for p in PASSES:
            x = r.get(p)
            if x is None:  # a run of fewer passes (--passes fwd): dashes, and no ratio for the geo-means
                cells += ["—"] * (3 + (p == "fwd") + 2 * (p == "bwd_exact_rowwise_adagrad"))
                pcells += ["—", "—"] * len(others)
                continue
            for peer in others:
                pcells += peer_cells(x, peer)
                if f"speedup_{peer}" in x:
                    peer_ratios[(peer, p)].append(x[f"speedup_{peer}"])
            if "speedup" not in x:  # FBGEMM could not run this pass: no ratio for the geo-means
                cells += [f"{x['triton']['median_ms']:.3f}", fbgemm_cell(x), "—"]
                cells += [f"{x['triton']['gbps']:.0f}"] if p == "fwd" else []
                cells += ["—", "—"] if p == "bwd_exact_rowwise_adagrad" else []
                continue
            t, f, sp = x["triton"]["median_ms"], x["fbgemm"]["median_ms"], x["speedup"]
            cells += [f"{t:.3f}", f"{f:.3f}", f"{sp:.2f}×"]
            if p == "fwd":
                fwd.append(sp)
                cells.append(f"{x['triton']['gbps']:.0f}")
            if p == "bwd_exact_rowwise_adagrad":
                bwd.append(sp)
                cells += [f"{floor_ms:.2f}", f"{floor_bytes / t / 1e6:.0f}"]
            if p != "bwd_exact_sgd" and sp < worst[0]:
                worst = (sp, f"{s['name']} {p}")
        rows.append(cells)
        peer_rows.append(pcells)
    fb = env["versions"]["fbgemm_gpu"]["version"]
    date = env["date"][:10]
    print(f"{card(env)} vs FBGEMM {fb}: forward geo-mean {geo(fwd)}, backward (row-wise Adagrad) geo-mean "
          f"{geo(bwd)}, worst shape {worst[0]:.2f}× ({date}, {env['git_commit']})")
    print()
    print(f"worst: {worst[1]}; copy bandwidth {copy_gbps:.0f} GB/s (read + write)")
    print()
    print("| shape | lookups | fwd ours ms | fwd FBGEMM ms | fwd × | fwd GB/s | bwd SGD ours | bwd SGD FBGEMM | SGD × "
          "| bwd RWA ours | bwd RWA FBGEMM | RWA × | RWA floor ms | RWA achieved GB/s |")
    print("|" + "---|" * 14)
    for c in rows:
        print("| " + " | ".join(c[:6] + c[6:9] + c[9:]) + " |")
    host_table(d, PASSES)
    if not others:
        return
    # Each other contender: its ms and its median / ours per pass (> 1: ours faster), geo-mean over the
    # shapes it ran.
    names = {"fwd": "fwd", "bwd_exact_sgd": "bwd SGD", "bwd_exact_rowwise_adagrad": "bwd RWA"}
    print()
    print("; ".join(f"{PEER_LABEL.get(p, p)} / ours geo-mean: " + ", ".join(
        f"{names[k]} {geo(peer_ratios[(p, k)])} ({len(peer_ratios[(p, k)])} shapes)" for k in PASSES)
        for p in others))
    print()
    print("| shape | " + " | ".join(f"{names[k]} {PEER_LABEL.get(p, p)} ms | {names[k]} {PEER_LABEL.get(p, p)} / ours"
                                  for k in PASSES for p in others) + " |")
    print("|" + "---|" * (1 + 2 * len(PASSES) * len(others)))
    for c in peer_rows:
        print("| " + " | ".join(c) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
