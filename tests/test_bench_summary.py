"""bench.summary: goals read from the results directory's goals.json, checked against the suites' JSON;
met, missed, "not run" when a suite is absent; no goal lives in the code."""
from __future__ import annotations

import json

import pytest

from bench.measure import Report
from bench.summary import Goal, GoalError, goal_rows, knockout_lines, load_goals, main

E2E_COLUMNS = ["batch", "tokenizer", "itl_ms", "graph_replay_ms", "floor_ms", "itl_x_floor", "itl_x_replay"]


def _e2e(tmp_path, model: str = "llama-3.2-3b") -> Report:
    report = Report("e2e", model, "dev", E2E_COLUMNS)
    for batch, itl, replay, tok in ((1, 2.48, 2.45, "off"), (64, 4.2, 4.0, "off"), (64, 4.6, 4.0, "on")):
        report.add(batch=batch, tokenizer=tok, itl_ms=itl, graph_replay_ms=replay, floor_ms=2.0,
                   itl_x_floor=itl / 2.0, itl_x_replay=itl / replay)
    report.write(str(tmp_path))
    return report


def _goals(tmp_path, *entries) -> list[Goal]:
    (tmp_path / "goals.json").write_text(json.dumps(list(entries)))
    return load_goals(str(tmp_path / "goals.json"))


def test_a_goal_reads_the_rows_it_names_and_is_met_only_when_every_one_is_within(tmp_path):
    _e2e(tmp_path)
    goals = _goals(tmp_path,
                   {"goal": "ITL at batch 1", "suite": "e2e", "where": {"batch": 1}, "metric": "itl_x_floor",
                    "at_most": 1.25, "show": ["itl_ms"]},
                   {"goal": "host overlap", "suite": "e2e", "where": {"tokenizer": "off"}, "metric": "itl_x_replay",
                    "at_most": 1.03, "per": "batch"})
    (one, overlap) = goal_rows(str(tmp_path), goals)
    assert one == ("ITL at batch 1", "llama-3.2-3b", "itl_x_floor <= 1.25", "itl_x_floor 1.240, itl_ms 2.480", "met")
    assert overlap[3] == "batch 1: itl_x_replay 1.012, batch 64: itl_x_replay 1.050"
    assert overlap[4] == "**missed** (batch 64)"  # the tokenizer row (1.15x) is not read: where says "off"


def test_at_least_and_a_model_without_a_report_or_without_rows(tmp_path):
    _e2e(tmp_path)
    goals = _goals(tmp_path, {"goal": "floor ratio", "suite": "e2e", "models": ["llama-3.2-3b", "qwen3-4b"],
                              "where": {"batch": 128}, "metric": "itl_x_floor", "at_least": 1.0},
                   {"goal": "prefill", "suite": "prefill", "metric": "x_floor", "at_most": 1.5})
    rows = goal_rows(str(tmp_path), goals)
    assert [(r[1], r[3], r[4]) for r in rows] == [("llama-3.2-3b", "no rows", "n/a"), ("qwen3-4b", "not run", "n/a"),
                                                  ("-", "not run", "n/a")]
    rows = goal_rows(str(tmp_path), [Goal("batch 64", "e2e", "itl_x_floor", at_least=2.2, where={"batch": 64})])
    assert rows[0][4] == "**missed** (row 0)" and rows[0][2] == "itl_x_floor >= 2.2"  # 2.1x; row 1 is 2.3x


@pytest.mark.parametrize("entry,message", [
    ({"suite": "e2e", "metric": "m", "at_most": 1}, "field 'goal' must be a non-empty string"),
    ({"goal": "g", "suite": "e2e", "metric": "m"}, "exactly one of 'at_most' / 'at_least'"),
    ({"goal": "g", "suite": "e2e", "metric": "m", "at_most": 1, "at_least": 0}, "exactly one of"),
    ({"goal": "g", "suite": "e2e", "metric": "m", "at_most": 1, "target": 3}, "unknown field(s) ['target']"),
])
def test_a_malformed_goal_is_refused_naming_it_and_the_field(tmp_path, entry, message):
    with pytest.raises(GoalError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        _goals(tmp_path, entry)


def test_summary_groups_goals_by_section_and_says_when_there_are_none(tmp_path):
    _e2e(tmp_path)
    main([str(tmp_path)])
    text = (tmp_path / "SUMMARY.md").read_text()
    assert text.startswith("# Benchmark summary\n") and "| e2e | llama-3.2-3b | 3 |" in text
    assert "No goals: " in text and "## Goals" not in text
    _goals(tmp_path, {"section": "decode", "goal": "ITL at batch 1", "suite": "e2e", "where": {"batch": 1},
                      "metric": "itl_x_floor", "at_most": 1.2})
    main([str(tmp_path)])
    text = (tmp_path / "SUMMARY.md").read_text()
    assert "## Goals: decode\n" in text and "| ITL at batch 1 | llama-3.2-3b | itl_x_floor <= 1.2 | " in text
    assert text.count("**missed**") == 1 and "No goals" not in text


def test_summary_shows_where_the_batch1_step_goes_from_the_knockout_report(tmp_path):
    from bench.knockout import VARIANTS
    assert knockout_lines(str(tmp_path)) == []  # no knockout JSON: no table
    report = Report("knockout", "gemma-3-1b", "dev", ["variant", "replay_ms", "saved_ms", "saved_us_per_layer",
                                                      "floor_ms"])
    report.meta["layers"] = 26
    # the suite's own variant names (the GEMV row is its last): the table reads what the suite writes
    for variant, ms in (("none", 1.232), ("norm", 1.167), ("rope", 1.188), ("attention", 1.003), (VARIANTS[-1], 0.305)):
        report.add(variant=variant, replay_ms=ms, saved_ms=1.232 - ms, saved_us_per_layer=(1.232 - ms) * 1e3 / 26,
                   floor_ms=0.667)
    report.write(str(tmp_path))
    table = knockout_lines(str(tmp_path))
    assert table[-2] == ("| gemma-3-1b | 1.232 ms | 0.667 ms | 229 us (8.8 us x 26 layers) | 65 us (2.5 us x 26 "
                         "layers) | 44 us (1.7 us x 26 layers) | 0.305 ms |")
    main([str(tmp_path)])
    assert "| gemma-3-1b | 1.232 ms |" in (tmp_path / "SUMMARY.md").read_text()

