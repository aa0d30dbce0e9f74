"""`python -m bench soak` on the CPU: a short soak of a server it starts itself (the tiny model) loses
nothing, meets back-pressure under overload, ends idle with no KV block in use, and the server drains
and exits 0 on its SIGTERM. Bounded: 15 s of traffic, a few seconds of start-up and idle.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from bench.soak_requests import Target, make_request
from tests.tiny_tokenizer import save_tiny_llama_with_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SERVER_ARGS = ("--device cpu --max-model-len 128 --block-size 4 --num-gpu-blocks 600 --max-num-seqs 4 "
               "--max-num-batched-tokens 64")


def test_the_soak_mix_draws_every_kind_of_request_in_its_shares():
    t = Target("http://x", "m", 128, text=True, chat=True)
    rng = random.Random(0)
    draws = [make_request(rng, t) for _ in range(4000)]
    valid = [(route, body, leave) for route, body, leave, invalid in draws if not invalid]
    assert sum(invalid for *_, invalid in draws) / len(draws) == pytest.approx(0.05, abs=0.015)
    assert sum(leave is not None for *_, leave in valid) / len(valid) == pytest.approx(0.20, abs=0.03)
    kinds = Counter((route, body["stream"]) for route, body, _ in valid)
    assert len(kinds) == 4 and min(kinds.values()) > 0.2 * len(valid)
    lengths = [len(body["prompt"]) for _, body, _ in valid if "prompt" in body]
    assert min(lengths) == 1 and 100 <= max(lengths) <= 127  # up to max_model_len - 1
    assert {body["n"] for _, body, _ in valid} == {1, 2, 3, 4}
    assert any("stop" in body for _, body, _ in valid) and any("top_logprobs" in body for _, body, _ in valid)
    assert any("logprobs" in body and "messages" not in body for _, body, _ in valid)


@pytest.mark.parametrize("front", ["", " --frontend-process", " --engine-process"],
                         ids=["inline", "frontend-process", "engine-process"])
def test_a_short_soak_loses_nothing_and_ends_idle_with_no_blocks_in_use(tmp_path, front):
    """Also with the text in the front end's process: disconnects, n > 1, stop strings, overload and
    the SIGTERM drain meet a front end whose stop matches arrive a step late; and with the engine in a
    process of its own, whose memory the RSS goal counts too."""
    model_dir = save_tiny_llama_with_tokenizer(tmp_path / "tiny")
    out = tmp_path / "soak.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    env.pop("INFER_GRAPHS_API_KEY", None)
    run = subprocess.run([sys.executable, "-m", "bench", "soak", "--model", str(model_dir),
                          f"--server-args={SERVER_ARGS}{front}", "--duration", "15", "--clients", "6", "--seed", "3",
                          "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ok"] and result["problems"] == [], result["problems"]
    steady, overload = result["phases"]["steady"], result["phases"]["overload"]
    assert result["target"]["chat"] and result["target"]["text"]  # the mix ran its chat and stop-string parts
    for phase in (steady, overload):
        assert phase["failed"] == 0 and phase["health_not_200"] == 0 and phase["sent"] > 0, phase
        # the probe process polled throughout the phase (every 100 ms; at least once a second even on a
        # loaded 2-core box): a dead probe would report nothing wrong
        assert phase["health_probes"] >= phase["seconds"] and phase["health_p99_ms"] is not None, phase
        assert phase["server_loop_lag_p99_ms"] is not None, phase  # the server's own event-loop lag histogram
    assert steady["completed"] > 0 and steady["aborted_by_client"] > 0 and steady["ttft_p99_ms"] is not None
    assert overload["rejected_503"] > 0  # 3x the sustained rate meets --max-waiting-requests
    assert len(overload["ttft_p99_ms_by_half"]) == 2
    end = result["end"]
    assert (end["kv_blocks_used"], end["requests_running"], end["requests_waiting"]) == (0, 0, 0)
    assert end["rss_bytes"]["after_warmup"] > 0 and end["prefix_cache"]["query_tokens"] > 0
    assert end["server_rejected_503"] >= overload["rejected_503"]
    assert result["server"]["exit_status"] == 0 and result["server"]["stopped_line"]
    goals = result["goals"]
    assert goals["no_problems"] and goals["health_p99_ms_max"] is not None
    assert goals["rss_within_2pct"] is not None and goals["cuda_allocated_within_2pct"] is None  # no CUDA here
    assert [row[0] for row in result["memory_mib"]][0] == 0.0 and len(result["memory_mib"]) >= 2


def test_a_closed_loop_is_waited_for_until_its_phase_ends_and_a_hung_one_fails(monkeypatch):
    """The first H100 soak waited for its closed loops a request's timeout from the phase's start,
    and counted every client of a 400 s phase as a failure at 130 s."""
    from bench import soak
    monkeypatch.setattr(soak, "REQUEST_TIMEOUT_S", 0.05)
    monkeypatch.setattr(soak, "FINISH_SLACK_S", 0.05)

    async def run(until_from_now, hang_s):
        outcomes = []
        tasks = [asyncio.create_task(asyncio.sleep(0.4)), asyncio.create_task(asyncio.sleep(hang_s))]
        until = None if until_from_now is None else time.perf_counter() + until_from_now
        await soak._finish(tasks, outcomes, until)
        return [o.error for o in outcomes]
    assert asyncio.run(run(0.5, 0.45)) == []  # both end within their phase: nothing failed
    assert asyncio.run(run(None, 0.45)) == ["the request did not finish"] * 2  # cut 0.1 s after the start
    assert asyncio.run(run(0.5, 30)) == ["the request did not finish"]  # hung past phase + timeout


def test_goals_name_each_target_with_its_figure():
    from bench.soak import goals
    phase = {"failed": 0, "health_not_200": 0, "health_p99_ms": 12.0}
    result = {"phases": {"steady": dict(phase), "overload": {**phase, "ttft_p99_ms_by_half": [100.0, 110.0]}},
              "end": {"kv_blocks_used": 0, "requests_running": 0, "requests_waiting": 0,
                      "rss_bytes": {"within_2pct": True}, "cuda_allocated_bytes": {"within_2pct": True}}}
    assert goals(result)["met"] and goals(result)["health_p99_ms_max"] == 12.0
    result["phases"]["overload"]["health_p99_ms"] = 323.5
    assert goals(result)["health_p99_under_100ms"] is False and not goals(result)["met"]
    result["phases"]["overload"].update(health_p99_ms=50.0, ttft_p99_ms_by_half=[100.0, 130.0])
    assert goals(result)["overload_ttft_p99_bounded"] is False and not goals(result)["met"]
    result["phases"]["overload"]["ttft_p99_ms_by_half"] = [100.0, 120.0]
    result["end"]["rss_bytes"]["within_2pct"] = False
    assert goals(result)["rss_within_2pct"] is False and not goals(result)["met"]


def test_a_histograms_p99_between_two_scrapes_is_its_bucket_bound():
    from bench.soak import _histogram_p99_ms
    name = "infer_graphs_event_loop_lag_seconds"
    scrape = lambda counts: {f"{name}_bucket{{le={le}}}": c for le, c in counts}  # noqa: E731
    before = scrape([("0.005", 10), ("0.1", 10), ("+Inf", 10)])
    after = scrape([("0.005", 10 + 98), ("0.1", 10 + 100), ("+Inf", 10 + 100)])
    assert _histogram_p99_ms(before, after, name) == 100.0  # 98 of 100 new ones were under 5 ms: p99 in (5, 100]
    after[f"{name}_bucket{{le=0.005}}"] = 10 + 99
    assert _histogram_p99_ms(before, after, name) == 5.0
    assert _histogram_p99_ms(before, before, name) is None and _histogram_p99_ms({}, {}, name) is None
