"""`python -m bench.summary RESULTS_DIR [--goals FILE] [--analysis FILE]`: SUMMARY.md of the suites'
results in RESULTS_DIR, and of the goals they were measured against.

Goals are data that travel with the results, not code: `RESULTS_DIR/goals.json` (or `--goals FILE`)
is a list of goals, each a bound on one column of one suite's rows:

    {"section": "decode at the memory floor",        # optional: a heading that groups goals
     "goal": "ITL through LLM.generate, batch 1",
     "suite": "e2e",                                  # reads RESULTS_DIR/e2e-<model>.json
     "models": ["llama-3.2-3b", "qwen3-4b"],          # optional: default, every model the suite measured
     "where": {"batch": 1, "tokenizer": "off"},       # optional: the rows it reads (column == value)
     "metric": "itl_x_floor", "at_most": 1.25,        # or "at_least"
     "per": "batch",                                  # optional: the column that labels each row read
     "show": ["itl_ms", "floor_ms"]}                  # optional: columns printed beside the metric

A goal is met when every row it reads is within its bound, "not run" when the directory has no
report of its suite for that model, and "no rows" when the report has no row it reads. Nothing here
is a number of its own: every figure in SUMMARY.md is read from the suites' JSON or from goals.json.
Without goals.json the summary lists what was measured (suites, models, devices) and the knockout
table.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any

from bench.knockout import GEMV_VARIANT
from bench.measure import Report

GOALS_FILE = "goals.json"
Row = tuple[str, str, str, str, str]  # goal, model, target, measured, status


class GoalError(ValueError):
    """A goals.json entry that cannot be read; the message names the entry and the field."""


@dataclass(frozen=True)
class Goal:
    goal: str
    suite: str
    metric: str
    at_most: float | None = None
    at_least: float | None = None
    section: str = ""
    models: tuple[str, ...] = ()
    where: dict[str, Any] = field(default_factory=dict)
    per: str | None = None
    show: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, entry: dict[str, Any], index: int) -> Goal:
        known = set(cls.__dataclass_fields__)
        if not isinstance(entry, dict):
            raise GoalError(f"goal #{index} is {type(entry).__name__}, expected an object")
        name = entry.get("goal", f"#{index}")
        unknown = sorted(set(entry) - known)
        if unknown:
            raise GoalError(f"goal {name!r}: unknown field(s) {unknown}; known: {sorted(known)}")
        for required in ("goal", "suite", "metric"):
            if not isinstance(entry.get(required), str) or not entry[required]:
                raise GoalError(f"goal {name!r}: field {required!r} must be a non-empty string")
        bounds = [b for b in ("at_most", "at_least") if entry.get(b) is not None]
        if len(bounds) != 1 or not isinstance(entry[bounds[0]], (int, float)) or isinstance(entry[bounds[0]], bool):
            raise GoalError(f"goal {name!r}: exactly one of 'at_most' / 'at_least' must be a number")
        return cls(**{**entry, "models": tuple(entry.get("models", ())), "show": tuple(entry.get("show", ()))})

    @property
    def target(self) -> str:
        return f"{self.metric} <= {self.at_most:g}" if self.at_most is not None else f"{self.metric} >= {self.at_least:g}"

    def within(self, value: float) -> bool:
        return value <= self.at_most if self.at_most is not None else value >= self.at_least


def load_goals(path: str) -> list[Goal]:
    """The goals of a goals.json file; [] when there is none."""
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        try:
            entries = json.load(f)
        except json.JSONDecodeError as exc:
            raise GoalError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(entries, list):
        raise GoalError(f"{path}: expected a list of goals, got {type(entries).__name__}")
    return [Goal.from_dict(entry, i) for i, entry in enumerate(entries)]


def _load(results: str, suite: str) -> dict[str, Report]:
    out = {}
    for path in sorted(glob.glob(os.path.join(results, f"{suite}-*.json"))):
        report = Report.load(path)
        if report.suite == suite:  # "decode-gemv-*.json" is not the decode suite
            out[report.model] = report
    return out


def _find(report: Report, **match) -> dict | None:
    for row in report.rows:
        if all(row.get(k) == v for k, v in match.items()):
            return row
    return None


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def goal_rows(results: str, goals: list[Goal]) -> list[Row]:
    """One row per goal and model: what was measured against the goal's bound."""
    rows = []
    reports: dict[str, dict[str, Report]] = {}
    for goal in goals:
        by_model = reports.setdefault(goal.suite, _load(results, goal.suite))
        for model in goal.models or tuple(by_model) or ("-",):
            report = by_model.get(model)
            if report is None:
                rows.append((goal.goal, model, goal.target, "not run", "n/a"))
                continue
            read = [r for r in report.rows if all(r.get(k) == v for k, v in goal.where.items())
                    and isinstance(r.get(goal.metric), (int, float))]
            if not read:
                rows.append((goal.goal, model, goal.target, "no rows", "n/a"))
                continue
            labels = [f"{goal.per} {r.get(goal.per)}: " if goal.per else ("" if len(read) == 1 else f"row {i}: ")
                      for i, r in enumerate(read)]
            measured = ", ".join(
                label + f"{goal.metric} {_fmt(r[goal.metric])}"
                + "".join(f", {col} {_fmt(r[col])}" for col in goal.show if r.get(col) is not None)
                for label, r in zip(labels, read))
            missed = [label.rstrip(": ") or goal.metric for label, r in zip(labels, read) if not goal.within(r[goal.metric])]
            status = "met" if not missed else "**missed**" + (f" ({', '.join(missed)})" if len(read) > 1 else "")
            rows.append((goal.goal, model, goal.target, measured, status))
    return rows


KNOCKOUT_KINDS = ("attention", "norm", "rope")  # the knockout suite's single-kind rows, in this order


def knockout_lines(results: str) -> list[str]:
    """Where a batch-1 decode step's time goes, from the knockout suite: per model, the replay, its floor,
    what each kernel kind costs the step and what is left without the GEMVs (empty without its JSON)."""
    reports = _load(results, "knockout")
    if not reports:
        return []
    lines = ["## Where the batch-1 decode step goes (knockout suite: the replay with one kernel kind left out)", "",
             "| model | replay | floor | " + " | ".join(f"{k} costs" for k in KNOCKOUT_KINDS)
             + " | all but the GEMVs |", "|---|---|---|" + "---|" * len(KNOCKOUT_KINDS) + "---|"]
    for model, report in reports.items():
        base = _find(report, variant="none")
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


def summary_lines(results: str, goals: list[Goal], goals_path: str) -> list[str]:
    reports = [Report.load(p) for p in sorted(glob.glob(os.path.join(results, "*.json")))
               if os.path.basename(p) != GOALS_FILE and not os.path.basename(p).startswith("attention")]
    devices = sorted({r.device for r in reports})
    lines = ["# Benchmark summary", "",
             f"Device: {', '.join(devices) or 'none'}. Results directory: `{results}` (suite JSON + Markdown + PNG "
             "beside this file). Every number below is read from those JSON files"
             + (f" and the goals from `{goals_path}`" if goals else "") + " by `python -m bench.summary`.", "",
             "| suite | model | rows |", "|---|---|---|"]
    lines += [f"| {r.suite} | {r.model} | {len(r.rows)} |" for r in reports] + [""]
    if not goals:
        lines += [f"No goals: `{goals_path}` does not exist (see `python -m bench.summary --help`).", ""]
    sections: dict[str, list[Goal]] = {}
    for goal in goals:
        sections.setdefault(goal.section, []).append(goal)
    for section, members in sections.items():
        lines += [f"## Goals{': ' + section if section else ''}", "",
                  "| goal | model | target | measured | status |", "|---|---|---|---|---|"]
        lines += [f"| {' | '.join(row)} |" for row in goal_rows(results, members)] + [""]
    return lines + knockout_lines(results)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.summary", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("results")
    parser.add_argument("--goals", help=f"a goals file (default: RESULTS/{GOALS_FILE})")
    parser.add_argument("--analysis", help="a Markdown file appended after the tables")
    args = parser.parse_args(argv)
    goals_path = args.goals or os.path.join(args.results, GOALS_FILE)
    lines = summary_lines(args.results, load_goals(goals_path), goals_path)
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
