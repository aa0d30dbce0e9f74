"""`python -m bench.summary RESULTS_DIR [--analysis FILE]`: SUMMARY.md of the open and recent issues'
goals vs the measured results in RESULTS_DIR, a table per issue (read from the suites' JSON; nothing
here is a number of its own). A goal whose suite did not run in RESULTS_DIR is listed as "not run"."""
from __future__ import annotations

import argparse
import glob
import os

from bench.knockout import GEMV_VARIANT
from bench.measure import Report
from bench.serving import CONFIGS as SERVING_CONFIGS, WORKLOADS as SERVING_WORKLOADS

Row = tuple[str, str, str, str]  # goal, target, measured, status

ISSUES = {6: "benchmarks against the peers and the physical floor",
          10: "tensor parallelism (tp suite: 1 and 2 GPUs, graphs on)",
          11: "decode at the memory floor (e2e suite: what `LLM.generate` users see)",
          12: "engines that start in seconds (capture suite: start-up in a fresh process)",
          13: "the OpenAI-compatible server (serving suite: workloads over HTTP)",
          38: "benchmarks that run what users run (a real tokenizer and stop strings; host time per step)"}
BENCH_MODELS = ("llama-3.2-3b", "qwen3-4b", "gemma-3-1b")

# issue 6
DECODE_BS1_GOAL = {"llama-3.2-3b": 1.15, "qwen3-4b": 1.15, "gemma-3-1b": 1.5}
DECODE_BS64_GOAL = 1.3
PREFILL_FLOOR_GOAL, PREFILL_HF_SPEEDUP_GOAL, PREFILL_FULL_GOAL = 1.5, 5.0, 1.2
CAPTURE_SECONDS_GOAL, CAPTURE_GIB_GOAL = 20.0, 1.0
# issue 10: the N = 2 decode time over the N = 1 time, same machine
TP_DECODE_BS1_GOAL, TP_GOAL_MODEL = 0.7, "qwen3-4b"
# issue 11 (ratios to the floor, except gemma's ITL in ms)
E2E_BS1_RATIO_MODELS, E2E_BS1_REPLAY_GOAL, E2E_BS1_ITL_GOAL = ("llama-3.2-3b", "qwen3-4b"), 1.2, 1.25
E2E_GEMMA_ITL_MS_GOAL = 1.2
E2E_BS64_ITL_GOAL = 1.3
HOST_OVERLAP_GOAL = 1.03  # ITL / graph replay, at every batch
PREFILL_GOAL_TOKENS = (64, 128, 256, 512)
# issue 12 (seconds from LLM(...) to ready, by model and compile-cache state)
READY_SECONDS_GOAL = {("llama-3.2-3b", "warm"): 12.0, ("llama-3.2-3b", "cold"): 30.0, ("gemma-3-1b", "warm"): 10.0}
DECODE_CAPTURE_SECONDS_PER_GRAPH_GOAL = 0.1
STARTUP_PHASES_SHOWN = 3
# issue 13
SERVING_ITL_OVERHEAD_GOAL = 1.05  # HTTP baseline ITL P50 / in-process baseline ITL P50
SERVING_TTFT_MS_GOAL, SERVING_TTFT_CONFIG = 12.0, "decode + prefill graphs"
# issue 38: ITL with the tokenizer and 2 stop strings / the decode graph's replay, at each batch
USERS_ITL_GOAL, USERS_ITL_MODELS, USERS_ITL_BATCHES = 1.03, ("gemma-3-1b", "llama-3.2-3b"), (1, 16, 64)
HOST_BATCH = 64


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


def _missed(names: list[str]) -> str:
    return "met" if not names else "**missed** (" + ", ".join(names) + ")"


def _models(reports: dict[str, Report], wanted: tuple[str, ...] = BENCH_MODELS) -> list[str]:
    """The models a goal is stated for, then any other the directory measured."""
    return list(dict.fromkeys([*wanted, *reports]))


def issue6_rows(results: str) -> list[Row]:
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
    prefill_target = (f"<= {PREFILL_FLOOR_GOAL}x floor, >= {PREFILL_HF_SPEEDUP_GOAL:g}x transformers eager, "
                      f"<= {PREFILL_FULL_GOAL}x full graph")
    if not any(m in prefill for m in ("llama-3.2-3b", "qwen3-4b")):
        rows.append(("prefill 64-512 tokens piecewise, llama-3.2-3b / qwen3-4b", prefill_target, "not run", "n/a"))
    for model, report in prefill.items():
        if model not in ("llama-3.2-3b", "qwen3-4b"):  # the issue's prefill goals name the 3-4B models
            continue
        for t in PREFILL_GOAL_TOKENS:
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
            rows.append((f"prefill {t} tokens piecewise, {model}", prefill_target, ", ".join(parts), _missed(missed)))
    capture_target = f"< {CAPTURE_SECONDS_GOAL:g} s warm, < {CAPTURE_GIB_GOAL:g} GiB"
    if "llama-3.2-3b" not in capture:
        rows.append(("capture all default sizes, llama-3.2-3b", capture_target, "not run", "n/a"))
    for model, report in capture.items():
        r = _find(report, cache="warm", kind="all graphs")
        # "compile (first forward)": reports from before the suite read the engine's own stats
        c = _find(report, cache="warm", kind="compile") or _find(report, cache="warm", kind="compile (first forward)")
        cold = _find(report, cache="cold", kind="all graphs")
        ready = _find(report, cache="warm", kind="ready")
        if r is None or c is None:
            rows.append((f"capture all default sizes, {model}", capture_target, "no warm capture or compile row", "n/a"))
            continue
        gib = r["graph_mib"] / 1024
        cold_txt = f"cold: graphs {cold['capture_s']:.1f} s" if cold else "no cold run"
        if ready is not None:
            cold_txt = f"engine ready in {ready['capture_s']:.1f} s; " + cold_txt
        rows.append((f"capture all default sizes, {model}", capture_target,
                     f"warm: {r['size']} graphs captured in {r['capture_s']:.1f} s (+ compile {c['capture_s']:.1f} s "
                     f"= {r['capture_s'] + c['capture_s']:.1f} s); {cold_txt}; graph pool {gib:.2f} GiB",
                     _status(r["capture_s"] < CAPTURE_SECONDS_GOAL and gib < CAPTURE_GIB_GOAL)
                     + ("" if r["capture_s"] + c["capture_s"] < CAPTURE_SECONDS_GOAL else
                        f" (capture; with the warm compile the start-up is over {CAPTURE_SECONDS_GOAL:g} s)")))
    return rows


def issue10_rows(results: str) -> list[Row]:
    tp = _load(results, "tp")
    goal = f"decode batch 1, N = 2 vs N = 1, {TP_GOAL_MODEL}"
    target = f"<= {TP_DECODE_BS1_GOAL}x the N = 1 time"
    report = tp.get(TP_GOAL_MODEL)
    row = next((r for r in report.rows if r.get("tp") == 2 and str(r.get("workload", "")).startswith("decode bs1 ")),
               None) if report else None
    if row is None or not row.get("vs_tp1"):
        rows = [(goal, target, "not run" if report is None else "no tp 2 decode bs1 row", "n/a")]
    else:
        one = _find(report, tp=1, workload=row["workload"])
        rows = [(goal, target, f"{row['median_ms']:.3f} ms vs {one['median_ms']:.3f} ms = {row['vs_tp1']:.3f}x "
                 f"(floor {row['floor_ms']:.3f} ms, {row['collectives']} collectives at "
                 f"{row['collective_us'] / row['collectives']:.1f} us)", _status(row["vs_tp1"] <= TP_DECODE_BS1_GOAL))]
    target = "no fallback on any rank; every rank replays its decode graphs"
    for model in _models(tp, (TP_GOAL_MODEL,)):
        stats = tp[model].meta.get("engine_stats_tp2") if model in tp else None
        ranks = stats.get("ranks") if stats else None
        if not isinstance(ranks, list) or not ranks:
            rows.append((f"graphs with the all-reduce inside, {model}", target,
                         "not run" if model not in tp else "no per-rank stats", "n/a"))
            continue
        fallbacks = [r.get("fallbacks") for r in ranks]
        replays = [r.get("decode_graph_replays") for r in ranks]
        ok = all(f == 0 for f in fallbacks) and len(set(replays)) == 1 and replays[0] > 0
        rows.append((f"graphs with the all-reduce inside, {model}", target,
                     f"{len(ranks)} ranks: fallbacks {fallbacks}, decode graph replays {replays}", _status(ok)))
    return rows


def _front_end(row: dict, tokenizer: str, stop_strings: int) -> bool:
    """Whether an e2e / host row is that front-end variant (rows from before issue 38 had no tokenizer)."""
    return row.get("tokenizer", "off") == tokenizer and row.get("stop_strings", 0) == stop_strings


def _plain_rows(report: Report) -> list[dict]:
    """The e2e rows without a tokenizer: what issue 11's goals were set on."""
    return [r for r in report.rows if _front_end(r, "off", 0)]


def _find_plain(report: Report, **match) -> dict | None:
    return next((r for r in _plain_rows(report) if all(r.get(k) == v for k, v in match.items())), None)


def _x_floor_row(goal: str, e2e: dict[str, Report], model: str, batch: int, key: str, limit: float) -> Row:
    """A goal on one e2e row's ratio to the floor; key "itl" (through LLM.generate) or "replay" (graph alone)."""
    target = f"<= {limit}x floor"
    r = _find_plain(e2e[model], batch=batch) if model in e2e else None
    if r is None or r.get(f"{key}_x_floor") is None:
        return goal, target, "not run" if model not in e2e else f"no batch {batch} {key} ratio", "n/a"
    ms, ratio = r["itl_ms" if key == "itl" else "graph_replay_ms"], r[f"{key}_x_floor"]
    return goal, target, f"{ms:.3f} ms vs floor {r['floor_ms']:.3f} ms = {ratio:.2f}x", _status(ratio <= limit)


def issue11_rows(results: str) -> list[Row]:
    e2e, prefill = _load(results, "e2e"), _load(results, "prefill")
    rows = []
    for model in E2E_BS1_RATIO_MODELS:
        rows.append(_x_floor_row(f"graph replay, batch 1, {model}", e2e, model, 1, "replay", E2E_BS1_REPLAY_GOAL))
        rows.append(_x_floor_row(f"ITL through LLM.generate, batch 1, {model}", e2e, model, 1, "itl", E2E_BS1_ITL_GOAL))
    gemma = _find_plain(e2e["gemma-3-1b"], batch=1) if "gemma-3-1b" in e2e else None
    goal, target = "ITL through LLM.generate, batch 1, gemma-3-1b", f"<= {E2E_GEMMA_ITL_MS_GOAL} ms"
    if gemma is None or gemma.get("itl_ms") is None:
        rows.append((goal, target, "not run" if gemma is None else "no ITL", "n/a"))
    else:
        floor_txt = f" (floor {gemma['floor_ms']:.3f} ms, {gemma['itl_x_floor']:.2f}x)" if gemma.get("itl_x_floor") else ""
        rows.append((goal, target, f"{gemma['itl_ms']:.3f} ms{floor_txt}", _status(gemma["itl_ms"] <= E2E_GEMMA_ITL_MS_GOAL)))
    prompt = (_find_plain(e2e["llama-3.2-3b"], batch=64) or {}).get("prompt_len") if "llama-3.2-3b" in e2e else None
    rows.append(_x_floor_row(f"ITL through LLM.generate, batch 64, {prompt or 512}-token prompts, llama-3.2-3b",
                             e2e, "llama-3.2-3b", 64, "itl", E2E_BS64_ITL_GOAL))
    for model in _models(e2e):
        goal, target = f"host overlap, {model}", f"ITL <= {HOST_OVERLAP_GOAL}x graph replay at every batch"
        measured = [r for r in _plain_rows(e2e[model]) if r.get("itl_x_replay") is not None] if model in e2e else []
        if not measured:
            rows.append((goal, target, "not run" if model not in e2e else "no ITL / replay pair", "n/a"))
            continue
        rows.append((goal, target, ", ".join(f"batch {r['batch']}: {r['itl_ms']:.3f} vs {r['graph_replay_ms']:.3f} ms "
                                             f"= {r['itl_x_replay']:.3f}x" for r in measured),
                     _missed([f"batch {r['batch']}" for r in measured if r["itl_x_replay"] > HOST_OVERLAP_GOAL])))
    target = f"<= {PREFILL_FLOOR_GOAL}x floor at {PREFILL_GOAL_TOKENS[0]}-{PREFILL_GOAL_TOKENS[-1]} tokens"
    if not prefill:
        rows.append(("piecewise prefill", target, "not run", "n/a"))
    for model, report in prefill.items():
        measured = [r for t in PREFILL_GOAL_TOKENS
                    if (r := _find(report, variant="piecewise", tokens=t)) is not None and r.get("x_floor") is not None]
        rows.append((f"piecewise prefill, {model}", target,
                     ", ".join(f"{r['tokens']}: {r['x_floor']:.2f}x" for r in measured) or "no piecewise rows",
                     _missed([f"{r['tokens']} tokens" for r in measured if r["x_floor"] > PREFILL_FLOOR_GOAL])
                     if measured else "n/a"))
    return rows


def _startup_text(report: Report, cache: str, ready_s: float) -> str:
    """Where start-up went: its largest phases, and how much of the total the phases account for."""
    phases = [r for r in report.rows if r.get("cache") == cache and str(r.get("kind")).startswith("startup: ")]
    if not phases:
        return "no start-up timeline"
    phases.sort(key=lambda r: -r["capture_s"])
    top = ", ".join(f"{r['kind'].removeprefix('startup: ')} {r['capture_s']:.1f} s" for r in phases[:STARTUP_PHASES_SHOWN])
    total = sum(r["capture_s"] for r in phases)
    return f"largest phases: {top}; {len(phases)} phases sum to {total:.1f} of {ready_s:.1f} s"


def issue12_rows(results: str) -> list[Row]:
    capture = _load(results, "capture")
    rows = []
    for model in _models(capture, tuple(m for m, _ in READY_SECONDS_GOAL)):
        for cache in ("warm", "cold"):
            limit = READY_SECONDS_GOAL.get((model, cache))
            goal, target = f"ready, {model}, {cache} compile cache", f"<= {limit:g} s" if limit else "(no goal)"
            r = _find(capture[model], cache=cache, kind="ready") if model in capture else None
            if r is None:
                if limit is not None:
                    rows.append((goal, target, "not run" if model not in capture else f"no {cache} 'ready' row", "n/a"))
                continue
            measured = f"{r['capture_s']:.1f} s; {_startup_text(capture[model], cache, r['capture_s'])}"
            rows.append((goal, target, measured, _status(r["capture_s"] <= limit) if limit else "-"))
    target = f"<= {DECODE_CAPTURE_SECONDS_PER_GRAPH_GOAL} s per graph"
    if not capture:
        rows.append(("decode graph capture", target, "not run", "n/a"))
    for model, report in capture.items():
        for cache in ("warm", "cold"):
            r = _find(report, cache=cache, kind="decode total")
            if r is not None and r.get("size"):
                per_graph = r["capture_s"] / r["size"]
                rows.append((f"decode graph capture, {model}, {cache} compile cache", target,
                             f"{r['size']} graphs in {r['capture_s']:.2f} s = {per_graph:.3f} s per graph",
                             _status(per_graph <= DECODE_CAPTURE_SECONDS_PER_GRAPH_GOAL)))
    return rows


def _serving_itl_rows(report: Report | None, model: str) -> list[Row]:
    """What HTTP adds: each configuration's HTTP baseline row against its in-process LLM row."""
    target = f"HTTP ITL P50 <= {SERVING_ITL_OVERHEAD_GOAL}x the in-process LLM's"
    pairs = [(c, _find(report, config=c, workload="baseline"), _find(report, config=f"{c} (in-process LLM)",
                                                                     workload="baseline"))
             for c in SERVING_CONFIGS] if report else []
    pairs = [p for p in pairs if p[1] or p[2]]
    if not pairs:
        why = "not run" if report is None else "no baseline rows"
        return [(f"HTTP overhead on ITL, baseline, {model}", target, why, "n/a")]
    rows = []
    for config, http, local in pairs:
        goal = f"HTTP overhead on ITL, baseline, {config}, {model}"
        if http is None or local is None:
            rows.append((goal, target, f"no {'HTTP' if http is None else 'in-process'} baseline row", "n/a"))
            continue
        overhead = http["itl_p50_ms"] / local["itl_p50_ms"]
        rows.append((goal, target, f"{http['itl_p50_ms']:.3f} ms over HTTP vs {local['itl_p50_ms']:.3f} ms in-process "
                     f"= {overhead:.3f}x", _status(overhead <= SERVING_ITL_OVERHEAD_GOAL)))
    return rows


def _serving_ttft_row(report: Report | None, model: str) -> Row:
    goal = f"TTFT P50, baseline (512-token prompt), {SERVING_TTFT_CONFIG}, {model}"
    target = f"<= {SERVING_TTFT_MS_GOAL:g} ms"
    http = _find(report, config=SERVING_TTFT_CONFIG, workload="baseline") if report else None
    if http is None:
        return goal, target, "not run" if report is None else "no baseline row", "n/a"
    local = _find(report, config=f"{SERVING_TTFT_CONFIG} (in-process LLM)", workload="baseline")
    local_txt = f"; in-process {local['ttft_p50_ms']:.1f} ms" if local else ""
    return (goal, target, f"{http['ttft_p50_ms']:.1f} ms over HTTP (P99 {http['ttft_p99_ms']:.1f} ms){local_txt}",
            _status(http["ttft_p50_ms"] <= SERVING_TTFT_MS_GOAL))


def _serving_completion_row(report: Report | None, model: str) -> Row:
    """Requests sent vs completed in every row; which configuration x workload runs are absent."""
    goal, target = f"no request lost or hung, {model}", "completed == sent in every workload"
    counted = [r for r in report.rows if r.get("sent") is not None and r.get("completed") is not None] if report else []
    if not counted:  # reports from before issue 13 count requests, not sent / completed
        return goal, target, "not run" if report is None else "no sent / completed columns", "n/a"
    lost = [f"{r['config']} / {r['workload']}: {r['completed']} of {r['sent']}" for r in counted
            if r["completed"] != r["sent"]]
    absent = {c: [w for w in SERVING_WORKLOADS if _find(report, config=c, workload=w) is None] for c in SERVING_CONFIGS}
    absent_txt = "; ".join(f"{c}: {'all' if len(ws) == len(SERVING_WORKLOADS) else ', '.join(ws)}"
                           for c, ws in absent.items() if ws)
    runs = len(SERVING_CONFIGS) * len(SERVING_WORKLOADS)
    measured = (f"{sum(r['completed'] for r in counted)} of {sum(r['sent'] for r in counted)} requests completed in "
                f"{len(counted)} rows (HTTP and in-process)" + (f"; lost: {', '.join(lost)}" if lost else "")
                + (f"; not run: {absent_txt}" if absent_txt else ""))
    runs_txt = f" ({runs - sum(map(len, absent.values()))} of {runs} config x workload runs measured)" if absent_txt else ""
    return goal, target, measured, _status(not lost) + runs_txt


def issue13_rows(results: str) -> list[Row]:
    serving = _load(results, "serving")
    rows = []
    for model in _models(serving, ("llama-3.2-3b",)):  # the issue's goals name llama-3.2-3b
        report = serving.get(model)
        rows += [*_serving_itl_rows(report, model), _serving_ttft_row(report, model),
                 _serving_completion_row(report, model)]
    return rows


def issue38_rows(results: str) -> list[Row]:
    e2e, host = _load(results, "e2e"), _load(results, "host")
    rows = []
    target = f"ITL <= {USERS_ITL_GOAL}x graph replay at batches {', '.join(map(str, USERS_ITL_BATCHES))}"
    for model in USERS_ITL_MODELS:
        goal = f"ITL through LLM.generate with the tokenizer + 2 stop strings, {model}"
        report = e2e.get(model)
        users = {r["batch"]: r for r in report.rows if _front_end(r, "on", 2)} if report else {}
        measured = [users[b] for b in USERS_ITL_BATCHES if users.get(b, {}).get("itl_x_replay") is not None]
        if not measured:
            why = "not run" if report is None else "no tokenizer + stop rows with a graph replay"
            rows.append((goal, target, why, "n/a"))
            continue
        plain = {r["batch"]: r for r in _plain_rows(report)}
        rows.append((goal, target, ", ".join(
            f"batch {r['batch']}: {r['itl_ms']:.3f} vs {r['graph_replay_ms']:.3f} ms = {r['itl_x_replay']:.3f}x"
            + (f" (no tokenizer {plain[r['batch']]['itl_ms']:.3f} ms)" if plain.get(r["batch"], {}).get("itl_ms") else "")
            for r in measured),
            _missed([f"batch {r['batch']}" for r in measured if r["itl_x_replay"] > USERS_ITL_GOAL]
                    + [f"batch {b} not run" for b in USERS_ITL_BATCHES if b not in {r['batch'] for r in measured}])))
    for model in _models(host, ("gemma-3-1b",)):
        goal = f"host time per step, null forward, batch {HOST_BATCH}, {model}"
        target = "<= 1/2 of the first measurement (issue 38)"
        report = host.get(model)
        measured = [r for r in report.rows if r["batch"] == HOST_BATCH] if report else []
        if not measured:
            rows.append((goal, target, "not run" if report is None else f"no batch {HOST_BATCH} rows", "n/a"))
            continue
        rows.append((goal, target, ", ".join(
            f"{'no tokenizer' if r['tokenizer'] == 'off' else 'tokenizer'}{' + stops' if r['stop_strings'] else ''}: "
            f"{r['ms_per_step']:.3f} ms ({r['us_per_request']:.1f} us a request)" for r in measured), "n/a"))
    return rows


KNOCKOUT_KINDS = ("attention", "norm", "rope")  # the knockout suite's single-kind rows, in this order


def knockout_lines(results: str) -> list[str]:
    """Where a batch-1 decode step's time goes, from the knockout suite: per model, the replay, its floor,
    what each kernel kind costs the step and what is left without the GEMVs (empty without its JSON)."""
    reports = _load(results, "knockout")
    if not reports:
        return []
    lines = ["### Where the batch-1 decode step goes (knockout suite: the replay with one kernel kind left out)", "",
             "| model | replay | floor | " + " | ".join(f"{k} costs" for k in KNOCKOUT_KINDS)
             + " | all but the GEMVs |", "|---|---|---|" + "---|" * len(KNOCKOUT_KINDS) + "---|"]
    for model in _models(reports):
        report = reports.get(model)
        base = _find(report, variant="none") if report else None
        if base is None:
            continue
        layers = report.meta.get("layers")
        cells = []
        for kind in KNOCKOUT_KINDS:
            row = _find(report, variant=kind)
            cells.append("-" if row is None else f"{row['saved_ms'] * 1e3:.0f} us ({row['saved_us_per_layer']:.1f} "
                                                 f"us x {layers} layers)")
        rest = _find(report, variant=GEMV_VARIANT)
        lines.append(f"| {model} | {base['replay_ms']:.3f} ms | {base['floor_ms']:.3f} ms | " + " | ".join(cells)
                     + f" | {'-' if rest is None else format(rest['replay_ms'], '.3f') + ' ms'} |")
    return lines + [""]


def goal_rows(results: str) -> dict[int, list[Row]]:
    """The goal rows of each issue, by issue number."""
    return {6: issue6_rows(results), 10: issue10_rows(results), 11: issue11_rows(results), 12: issue12_rows(results),
            13: issue13_rows(results), 38: issue38_rows(results)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("results")
    parser.add_argument("--analysis", help="a Markdown file appended after the goals tables")
    args = parser.parse_args(argv)
    reports = [Report.load(p) for p in sorted(glob.glob(os.path.join(args.results, "*.json")))
               if not os.path.basename(p).startswith("attention")]
    devices = sorted({r.device for r in reports})
    lines = [f"# Benchmark summary: goals of issues {', '.join(map(str, ISSUES))} vs measured", "",
             f"Device: {', '.join(devices)}. Results directory: `{args.results}` (suite JSON + Markdown + PNG beside this file).",
             "Every number below is read from those JSON files by `python -m bench.summary`; "
             "a goal whose suite has no result here is \"not run\".", ""]
    for issue, rows in goal_rows(args.results).items():
        lines += [f"## Issue {issue}: {ISSUES[issue]}", "", "| goal | target | measured | status |", "|---|---|---|---|"]
        lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
        lines.append("")
        if issue == 11:
            lines += knockout_lines(args.results)
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
