"""bench.summary: each issue's goals read from the suites' JSON; met, missed, and "not run" when absent."""
from __future__ import annotations

from bench.measure import Report
from bench.summary import goal_rows, main

E2E_COLUMNS = ["batch", "prompt_len", "itl_ms", "graph_replay_ms", "floor_ms", "itl_x_floor", "replay_x_floor",
               "itl_x_replay"]


def _e2e_row(report: Report, batch: int, itl_ms: float, replay_ms: float, floor_ms: float) -> None:
    report.add(batch=batch, prompt_len=512, itl_ms=itl_ms, graph_replay_ms=replay_ms, floor_ms=floor_ms,
               itl_x_floor=itl_ms / floor_ms, replay_x_floor=replay_ms / floor_ms, itl_x_replay=itl_ms / replay_ms)


def _by_goal(rows):
    return {goal: (target, measured, status) for goal, target, measured, status in rows}


def test_issue11_goals_from_the_e2e_reports(tmp_path):
    llama = Report("e2e", "llama-3.2-3b", "dev", E2E_COLUMNS)
    _e2e_row(llama, 1, itl_ms=2.48, replay_ms=2.45, floor_ms=2.0)  # replay 1.225x floor: missed; ITL 1.24x: met
    _e2e_row(llama, 64, itl_ms=4.2, replay_ms=4.0, floor_ms=3.5)   # ITL 1.2x floor: met; 1.05x replay: missed
    llama.write(str(tmp_path))
    rows = _by_goal(goal_rows(str(tmp_path))[11])
    assert rows["graph replay, batch 1, llama-3.2-3b"] == ("<= 1.2x floor", "2.450 ms vs floor 2.000 ms = 1.23x",
                                                           "**missed**")
    assert rows["ITL through LLM.generate, batch 1, llama-3.2-3b"][2] == "met"
    assert rows["ITL through LLM.generate, batch 64, 512-token prompts, llama-3.2-3b"][2] == "met"
    assert rows["host overlap, llama-3.2-3b"][2] == "**missed** (batch 64)"
    for absent in ("graph replay, batch 1, qwen3-4b", "ITL through LLM.generate, batch 1, gemma-3-1b",
                   "host overlap, gemma-3-1b", "piecewise prefill"):
        assert rows[absent][1:] == ("not run", "n/a"), absent


def test_issue38_goals_read_the_tokenizer_and_stop_rows_and_issue11_the_plain_ones(tmp_path):
    gemma = Report("e2e", "gemma-3-1b", "dev", ["tokenizer", "stop_strings", *E2E_COLUMNS])
    for b, replay, plain, users in ((1, 1.20, 1.21, 1.22), (16, 1.50, 1.515, 1.508), (64, 1.81, 1.852, 2.385)):
        for tok, stops, itl in (("off", 0, plain), ("on", 0, users + 0.3), ("on", 2, users)):
            gemma.add(tokenizer=tok, stop_strings=stops, batch=b, prompt_len=512, itl_ms=itl, graph_replay_ms=replay,
                      floor_ms=1.0, itl_x_floor=itl, replay_x_floor=replay, itl_x_replay=itl / replay)
    gemma.write(str(tmp_path))
    host = Report("host", "gemma-3-1b", "dev", ["batch", "tokenizer", "stop_strings", "ms_per_step", "us_per_request"])
    host.add(batch=64, tokenizer="off", stop_strings=0, ms_per_step=0.9, us_per_request=14.1)
    host.add(batch=64, tokenizer="on", stop_strings=2, ms_per_step=1.8, us_per_request=28.1)
    host.write(str(tmp_path))
    rows = goal_rows(str(tmp_path))
    r38 = _by_goal(rows[38])
    users = r38["ITL through LLM.generate with the tokenizer + 2 stop strings, gemma-3-1b"]
    assert users[1].startswith("batch 1: 1.220 vs 1.200 ms = 1.017x (no tokenizer 1.210 ms), batch 16: ")
    assert users[1].endswith("batch 64: 2.385 vs 1.810 ms = 1.318x (no tokenizer 1.852 ms)")
    assert users[2] == "**missed** (batch 64)"  # 1.22 / 1.20 = 1.017 and 1.508 / 1.5 met at 1 and 16
    assert r38["ITL through LLM.generate with the tokenizer + 2 stop strings, llama-3.2-3b"][1:] == ("not run", "n/a")
    host_row = r38["host time per step, null forward, batch 64, gemma-3-1b"]
    assert host_row[1] == "no tokenizer: 0.900 ms (14.1 us a request), tokenizer + stops: 1.800 ms (28.1 us a request)"
    r11 = _by_goal(rows[11])  # issue 11's goals were set without a tokenizer: they read the plain rows only
    assert r11["host overlap, gemma-3-1b"][1].count("batch 64") == 1
    assert r11["ITL through LLM.generate, batch 1, gemma-3-1b"][1].startswith("1.210 ms")


def test_issue12_goals_from_the_capture_report_with_its_largest_startup_phases(tmp_path):
    report = Report("capture", "llama-3.2-3b", "dev", ["cache", "kind", "size", "capture_s", "graph_mib", "note"])
    for cache, phases, ready_s in (("warm", {"setup": 4.0, "compile": 5.0, "decode capture": 0.5, "kv pool": 0.1}, 11.0),
                                   ("cold", {"setup": 4.0, "compile": 25.0, "decode capture": 2.0}, 31.0)):
        for name, seconds in phases.items():
            report.add(cache=cache, kind=f"startup: {name}", size="-", capture_s=seconds, graph_mib=None)
        report.add(cache=cache, kind="decode total", size=10, capture_s=phases["decode capture"], graph_mib=30.0)
        report.add(cache=cache, kind="ready", size="-", capture_s=ready_s, graph_mib=1000.0)
    report.write(str(tmp_path))
    rows = _by_goal(goal_rows(str(tmp_path))[12])
    target, measured, status = rows["ready, llama-3.2-3b, warm compile cache"]
    assert (target, status) == ("<= 12 s", "met")
    assert measured == "11.0 s; largest phases: compile 5.0 s, setup 4.0 s, decode capture 0.5 s; 4 phases sum to 9.6 of 11.0 s"
    assert rows["ready, llama-3.2-3b, cold compile cache"][2] == "**missed**"
    assert rows["ready, gemma-3-1b, warm compile cache"][1:] == ("not run", "n/a")
    assert rows["decode graph capture, llama-3.2-3b, warm compile cache"][1:] == (
        "10 graphs in 0.50 s = 0.050 s per graph", "met")
    assert rows["decode graph capture, llama-3.2-3b, cold compile cache"][2] == "**missed**"


def test_issue13_goals_from_the_serving_report(tmp_path):
    report = Report("serving", "llama-3.2-3b", "dev", ["config", "workload", "sent", "completed", "ttft_p50_ms",
                                                       "ttft_p99_ms", "itl_p50_ms"])
    report.add(config="decode + prefill graphs", workload="baseline", sent=6, completed=6, ttft_p50_ms=11.0,
               ttft_p99_ms=13.0, itl_p50_ms=3.3)
    report.add(config="decode + prefill graphs", workload="continuous_batching", sent=48, completed=47,
               ttft_p50_ms=20.0, ttft_p99_ms=80.0, itl_p50_ms=3.7)
    report.add(config="decode + prefill graphs (in-process LLM)", workload="baseline", sent=6, completed=6,
               ttft_p50_ms=8.0, ttft_p99_ms=9.0, itl_p50_ms=3.0)
    report.write(str(tmp_path))
    rows = _by_goal(goal_rows(str(tmp_path))[13])
    assert rows["HTTP overhead on ITL, baseline, decode + prefill graphs, llama-3.2-3b"][1:] == (
        "3.300 ms over HTTP vs 3.000 ms in-process = 1.100x", "**missed**")
    assert rows["TTFT P50, baseline (512-token prompt), decode + prefill graphs, llama-3.2-3b"][2] == "met"
    _, measured, status = rows["no request lost or hung, llama-3.2-3b"]
    assert "lost: decode + prefill graphs / continuous_batching: 47 of 48" in measured
    assert "not run: graphs off: all; decode graphs: all; decode + prefill graphs: chunked_prefill, prefix_caching" in measured
    assert status == "**missed** (2 of 12 config x workload runs measured)"


def test_issue10_goals_from_the_tp_report_and_its_per_rank_engine_stats(tmp_path):
    columns = ["tp", "workload", "median_ms", "floor_ms", "vs_tp1", "collectives", "collective_us"]
    report = Report("tp", "qwen3-4b", "dev", columns)
    report.add(tp=1, workload="decode bs1 ctx512", median_ms=3.2, floor_ms=1.9, vs_tp1=None, collectives=0)
    report.add(tp=2, workload="decode bs1 ctx512", median_ms=2.4, floor_ms=1.7, vs_tp1=0.75, collectives=73,
               collective_us=730.0)
    ranks = [dict(device=f"cuda:{i}", fallbacks=0, decode_graph_replays=108) for i in range(2)]
    report.meta["engine_stats_tp2"] = dict(fallbacks=0, ranks=ranks)
    report.write(str(tmp_path))
    rows = _by_goal(goal_rows(str(tmp_path))[10])
    assert rows["decode batch 1, N = 2 vs N = 1, qwen3-4b"][1:] == (
        "2.400 ms vs 3.200 ms = 0.750x (floor 1.700 ms, 73 collectives at 10.0 us)", "**missed**")
    assert rows["graphs with the all-reduce inside, qwen3-4b"][2] == "met"
    ranks[1]["fallbacks"] = 3
    report.write(str(tmp_path))
    assert _by_goal(goal_rows(str(tmp_path))[10])["graphs with the all-reduce inside, qwen3-4b"][2] == "**missed**"


def test_summary_of_an_empty_directory_lists_every_issue_goal_as_not_run(tmp_path):
    main([str(tmp_path)])
    text = (tmp_path / "SUMMARY.md").read_text()
    assert text.startswith("# Benchmark summary: goals of issues 6, 10, 11, 12, 13, 38 vs measured")
    for issue in (6, 10, 11, 12, 13, 38):
        assert f"\n## Issue {issue}: " in text
    table_rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| goal ")]
    assert len(table_rows) >= 15 and all(line.endswith("| not run | n/a |") for line in table_rows)


def test_a_serving_report_from_before_the_http_suite_is_not_read_as_complete(tmp_path):
    """Issue 6's serving rows (in-process, `requests` counted, no baseline): every issue-13 goal is n/a."""
    report = Report("serving", "llama-3.2-3b", "dev", ["config", "requests", "ttft_p50_ms", "itl_p50_ms"])
    report.add(config="decode + prefill graphs", requests=64, ttft_p50_ms=10.7, itl_p50_ms=5.4)
    report.write(str(tmp_path))
    assert [(measured, status) for _, _, measured, status in goal_rows(str(tmp_path))[13]] == [
        ("no baseline rows", "n/a"), ("no baseline row", "n/a"), ("no sent / completed columns", "n/a")]


def test_issue11_shows_where_the_batch1_step_goes_from_the_knockout_report(tmp_path):
    from bench.knockout import VARIANTS
    from bench.summary import knockout_lines
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
