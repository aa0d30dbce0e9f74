"""`python -m bench.summary RESULTS_DIR [--analysis FILE]`: SUMMARY.md of the issue's goals vs the
measured results in RESULTS_DIR (read from the suites' JSON; nothing here is a number of its own)."""
from __future__ import annotations

import argparse
import glob
import os

from bench.measure import Report

DECODE_BS1_GOAL = {"llama-3.2-3b": 1.15, "qwen3-4b": 1.15, "gemma-3-1b": 1.5}
DECODE_BS64_GOAL = 1.3
PREFILL_FLOOR_GOAL, PREFILL_HF_SPEEDUP_GOAL, PREFILL_FULL_GOAL = 1.5, 5.0, 1.2
CAPTURE_SECONDS_GOAL, CAPTURE_GIB_GOAL = 20.0, 1.0


def _load(results: str, suite: str) -> dict[str, Report]:
    out = {}
    for path in sorted(glob.glob(os.path.join(results, f"{suite}-*.json"))):
        report = Report.load(path)
        out[report.model] = report
    return out


def _find(report: Report, **match) -> dict | None:
    for row in report.rows:
        if all(row.get(k) == v for k, v in match.items()):
            return row
    return None


def _status(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "**missed**")


def goal_rows(results: str) -> list[tuple[str, str, str, str]]:
    rows = []
    decode, prefill, capture = _load(results, "decode"), _load(results, "prefill"), _load(results, "capture")
    for model, goal in DECODE_BS1_GOAL.items():
        if model not in decode:
            rows.append((f"decode bs1 ctx512 full graph, {model}", f"<= {goal}x floor", "not run", "n/a"))
            continue
        r = _find(decode[model], variant="full_graph", batch=1, context=512)
        peer = _find(decode[model], variant="hf_static_compiled", batch=1, context=512)
        peer_txt = f"; transformers static+compile {peer['median_ms']:.2f} ms" if peer else ""
        if r is None or r.get("x_floor") is None:
            rows.append((f"decode bs1 ctx512 full graph, {model}", f"<= {goal}x floor", "no row", "n/a"))
            continue
        rows.append((f"decode bs1 ctx512 full graph, {model}", f"<= {goal}x floor",
                     f"{r['median_ms']:.3f} ms vs floor {r['floor_ms']:.3f} ms = {r['x_floor']:.2f}x{peer_txt}",
                     _status(r["x_floor"] <= goal)))
    for model, report in decode.items():
        r = _find(report, variant="full_graph", batch=64, context=512)
        if r is not None and r.get("x_floor") is not None:
            rows.append((f"decode bs64 ctx512 full graph, {model}", f"<= {DECODE_BS64_GOAL}x floor",
                         f"{r['median_ms']:.3f} ms vs floor {r['floor_ms']:.3f} ms = {r['x_floor']:.2f}x",
                         _status(r["x_floor"] <= DECODE_BS64_GOAL)))
    for model, report in prefill.items():
        if model not in ("llama-3.2-3b", "qwen3-4b"):  # the prefill goals name the 3-4B models
            continue
        for t in (64, 128, 256, 512):
            r = _find(report, variant="piecewise", tokens=t)
            if r is None or r.get("x_floor") is None:
                continue
            hf = r.get("speedup_vs_hf_eager")
            checks = [r["x_floor"] <= PREFILL_FLOOR_GOAL,
                      hf is not None and hf >= PREFILL_HF_SPEEDUP_GOAL,
                      r.get("x_full_graph") is not None and r["x_full_graph"] <= PREFILL_FULL_GOAL]
            missed = [name for ok, name in zip(checks, ("floor", "vs transformers", "vs full graph")) if not ok]
            parts = [f"{r['median_ms']:.3f} ms: {r['x_floor']:.2f}x floor"]
            parts.append(f"{hf:.1f}x faster than transformers eager" if hf else "no transformers row")
            parts.append(f"{r['x_full_graph']:.2f}x full graph" if r.get("x_full_graph") else "no full graph")
            rows.append((f"prefill {t} tokens piecewise, {model}",
                         f"<= {PREFILL_FLOOR_GOAL}x floor, >= {PREFILL_HF_SPEEDUP_GOAL:g}x transformers eager, "
                         f"<= {PREFILL_FULL_GOAL}x full graph", ", ".join(parts),
                         "met" if not missed else "**missed** (" + ", ".join(missed) + ")"))
    for model, report in capture.items():
        r = _find(report, cache="warm", kind="all graphs")
        # "compile (first forward)": reports from before the suite read the engine's own stats
        c = _find(report, cache="warm", kind="compile") or _find(report, cache="warm", kind="compile (first forward)")
        cold = _find(report, cache="cold", kind="all graphs")
        ready = _find(report, cache="warm", kind="ready")
        if r is None or c is None:
            continue
        gib = r["graph_mib"] / 1024
        cold_txt = f"cold: graphs {cold['capture_s']:.1f} s" if cold else "no cold run"
        if ready is not None:
            cold_txt = f"engine ready in {ready['capture_s']:.1f} s; " + cold_txt
        rows.append((f"capture all default sizes, {model}", f"< {CAPTURE_SECONDS_GOAL:g} s warm, < {CAPTURE_GIB_GOAL:g} GiB",
                     f"warm: {r['size']} graphs captured in {r['capture_s']:.1f} s (+ compile {c['capture_s']:.1f} s "
                     f"= {r['capture_s'] + c['capture_s']:.1f} s); {cold_txt}; graph pool {gib:.2f} GiB",
                     _status(r["capture_s"] < CAPTURE_SECONDS_GOAL and gib < CAPTURE_GIB_GOAL)
                     + ("" if r["capture_s"] + c["capture_s"] < CAPTURE_SECONDS_GOAL else
                        f" (capture; with the warm compile the start-up is over {CAPTURE_SECONDS_GOAL:g} s)")))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("results")
    parser.add_argument("--analysis", help="a Markdown file appended after the goals table")
    args = parser.parse_args(argv)
    reports = [Report.load(p) for p in sorted(glob.glob(os.path.join(args.results, "*.json")))
               if not os.path.basename(p).startswith("attention")]
    devices = sorted({r.device for r in reports})
    lines = ["# Benchmark summary: goals of issue 6 vs measured", "",
             f"Device: {', '.join(devices)}. Results directory: `{args.results}` (suite JSON + Markdown + PNG beside this file).",
             "Every number below is read from those JSON files by `python -m bench.summary`.", "",
             "| goal | target | measured | status |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in goal_rows(args.results)]
    lines.append("")
    if args.analysis:
        with open(args.analysis) as f:
            lines.append(f.read())
    path = os.path.join(args.results, "SUMMARY.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
