"""SIGTERM / SIGINT on a real `python -m engine serve`: the drain lets streams in flight finish, a drain past
--shutdown-timeout aborts them with an error event, a second signal stops at once; with the engine in its
own process (--engine-process) too, and that process dying ends the streams and the server. One server per
test (each ends it), on 127.0.0.1 and a free port.
"""
from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.test_server import NAME, _flags, start_server, stop_server
from tests.tiny_tokenizer import save_tiny_llama_with_tokenizer

ENGINE = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_gpu_blocks=800)
LONG = 480  # tokens: seconds of decoding on the CPU, longer than any drain timeout below


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_llama_with_tokenizer(tmp_path_factory.mktemp("tiny-shutdown"))


MODES = ["engine_thread", "engine_process"]


def _mode_flags(mode: str) -> list[str]:
    return ["--engine-process"] if mode == "engine_process" else ["--no-engine-process"]


def _start(model_dir: Path, tmp_path: Path, *extra: str):
    log = tmp_path / "stderr.txt"
    proc, url = start_server(model_dir, log, "--device", "cpu", *_flags(ENGINE), *extra)
    return proc, url, log


def _wait_for_line(log: Path, text: str, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        assert time.monotonic() < deadline, f"no {text!r} in the log:\n{log.read_text()[-2000:]}"
        time.sleep(0.05)


async def _stream(client: httpx.AsyncClient, url: str, body: dict, started: asyncio.Event) -> list:
    """Every event of one stream ([DONE] as the string), in order."""
    events = []
    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                started.set()
    return events


def _tokens_and_reasons(events: list) -> tuple[dict[int, int], dict[int, str]]:
    tokens, reasons = {}, {}
    for event in events[:-1]:
        for choice in event["choices"]:
            tokens[choice["index"]] = tokens.get(choice["index"], 0) + len(choice.get("token_ids") or [])
            if choice["finish_reason"]:
                reasons[choice["index"]] = choice["finish_reason"]
    return tokens, reasons


def _body(max_tokens: int, **extra) -> dict:
    return {"model": NAME, "prompt": [2, 40, 41, 42], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_refuses_new_requests_lets_those_in_flight_finish_and_exits_0(model_dir, tmp_path, sig, mode):
    proc, url, log = _start(model_dir, tmp_path, *_mode_flags(mode))
    try:
        async def run():
            async with httpx.AsyncClient(timeout=60) as client:
                started = [asyncio.Event() for _ in range(3)]
                streams = [asyncio.create_task(_stream(client, url, body, s)) for body, s in
                           zip([_body(60), _body(40, n=2, seed=1, temperature=0.8), _body(50)], started)]
                plain = asyncio.create_task(client.post(f"{url}/v1/completions", json=_body(40)))
                await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 30)
                proc.send_signal(sig)
                await asyncio.to_thread(_wait_for_line, log, "draining")
                health = await client.get(f"{url}/health")
                new = await client.post(f"{url}/v1/completions", json=_body(2))
                return health, new, await asyncio.wait_for(asyncio.gather(*streams), 60), await plain

        health, new, streams, plain = asyncio.run(run())
        assert health.status_code == 503 and health.json()["error"]["code"] == "server_shutting_down"
        assert new.status_code == 503 and new.json()["error"]["code"] == "server_shutting_down"
        for events, (max_tokens, n) in zip(streams, [(60, 1), (40, 2), (50, 1)]):
            assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
            assert _tokens_and_reasons(events) == ({i: max_tokens for i in range(n)}, {i: "length" for i in range(n)})
        assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 40
        assert proc.wait(30) == 0
        text = log.read_text()
        assert f"{sig.name}: draining" in text and "drained in" in text and "server stopped" in text
        assert "Traceback" not in text
    finally:
        stop_server(proc)


@pytest.mark.parametrize("mode", MODES)
def test_a_drain_past_the_timeout_aborts_with_an_error_event_and_exits_0(model_dir, tmp_path, mode):
    proc, url, log = _start(model_dir, tmp_path, "--shutdown-timeout", "0.5", *_mode_flags(mode))
    try:
        async def run():
            async with httpx.AsyncClient(timeout=60) as client:
                started = asyncio.Event()
                stream = asyncio.create_task(_stream(client, url, _body(LONG), started))
                plain = asyncio.create_task(client.post(f"{url}/v1/completions", json=_body(LONG)))
                await asyncio.wait_for(started.wait(), 30)
                proc.send_signal(signal.SIGTERM)
                return await asyncio.wait_for(stream, 60), await asyncio.wait_for(plain, 60)

        events, plain = asyncio.run(run())
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["type"] == "server_error" and "shutting down" in events[-2]["error"]["message"]
        tokens, reasons = _tokens_and_reasons(events[:-1])
        assert 0 < tokens[0] < LONG and reasons == {}
        assert plain.status_code == 503 and "shutting down" in plain.json()["error"]["message"]
        assert proc.wait(30) == 0
        text = log.read_text()
        assert "drain timed out after 0.5 s: aborting the 2 requests" in text and "server stopped" in text
    finally:
        stop_server(proc)


@pytest.mark.parametrize("mode", MODES)
def test_a_second_signal_stops_at_once_aborting_what_runs(model_dir, tmp_path, mode):
    proc, url, log = _start(model_dir, tmp_path, "--shutdown-timeout", "60", *_mode_flags(mode))
    try:
        async def run():
            async with httpx.AsyncClient(timeout=60) as client:
                started = asyncio.Event()
                stream = asyncio.create_task(_stream(client, url, _body(LONG), started))
                await asyncio.wait_for(started.wait(), 30)
                proc.send_signal(signal.SIGTERM)
                await asyncio.to_thread(_wait_for_line, log, "draining")
                proc.send_signal(signal.SIGINT)
                start = time.monotonic()
                status = await asyncio.to_thread(proc.wait, 30)
                return await asyncio.wait_for(stream, 30), status, time.monotonic() - start

        events, status, seconds = asyncio.run(run())
        assert status == 1 and seconds < 10, (status, seconds)  # not the 60 s drain
        assert events[-1] == "[DONE]" and "shutting down" in events[-2]["error"]["message"]
        text = log.read_text()
        assert "second signal" in text and "server stopped" in text and "Traceback" not in text
    finally:
        stop_server(proc)


def _kill_mid_stream(proc, url: str, pick) -> tuple[list, int | None, int]:
    """Two long streams run; then the spawned process `pick(spawned, server_pid)` chooses is killed.
    (each stream's events, /health's status or None if the server is already gone, the exit status)"""
    import psutil

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            started = [asyncio.Event(), asyncio.Event()]
            streams = [asyncio.create_task(_stream(client, url, _body(LONG), s)) for s in started]
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 30)
            spawned = [c for c in psutil.Process(proc.pid).children(recursive=True)
                       if "spawn_main" in " ".join(c.cmdline())]
            pick(spawned, proc.pid).kill()
            events = await asyncio.wait_for(asyncio.gather(*streams), 30)
            try:
                health = (await client.get(f"{url}/health")).status_code
            except httpx.TransportError:  # already gone: what a load balancer sees as down too
                health = None
            return events, health, await asyncio.to_thread(proc.wait, 30)
    return asyncio.run(run())


def _only(processes: list):
    [process] = processes
    return process


@pytest.mark.parametrize("mode", MODES)
def test_a_killed_tensor_parallel_rank_ends_the_streams_with_an_error_and_the_server_exits_1(model_dir, tmp_path, mode):
    proc, url, log = _start(model_dir, tmp_path, "--tensor-parallel-size", "2", *_mode_flags(mode))
    try:
        # rank 0 is the server (engine thread) or the engine process, whose child rank 1 is
        streams, health, status = _kill_mid_stream(proc, url, lambda spawned, server: _only(
            [c for c in spawned if c.ppid() != server] if mode == "engine_process" else spawned))
        for events in streams:
            assert events[-1] == "[DONE]" and "failed a step" in events[-2]["error"]["message"]
        assert health in (503, None) and status == 1
        text = log.read_text()
        # the failure is seen as a dead rank or as the collective that its death broke, whichever comes first
        assert "stopping: the engine cannot serve any more: tensor-parallel worker failed" in text
        assert "server stopped" in text
    finally:
        stop_server(proc)


def test_an_engine_process_that_dies_ends_the_streams_with_an_error_and_the_server_exits_1(model_dir, tmp_path):
    proc, url, log = _start(model_dir, tmp_path, "--engine-process")
    try:
        streams, health, status = _kill_mid_stream(
            proc, url, lambda spawned, server: _only([c for c in spawned if c.ppid() == server]))
        for events in streams:
            assert events[-1] == "[DONE]" and "engine process exited unexpectedly" in events[-2]["error"]["message"]
        assert health in (503, None) and status == 1
        text = log.read_text()
        assert "stopping: the engine cannot serve any more: the engine process exited unexpectedly" in text
        assert "server stopped" in text
    finally:
        stop_server(proc)
