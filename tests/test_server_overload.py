"""Back-pressure (EngineConfig.max_waiting_requests) in the LLM API and over HTTP, and --chat-template.

One server for the module: 2 requests run at once, 2 may wait, the tokenizer has no chat template
of its own and gets one from --chat-template FILE.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import socket
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from engine import LLM, ConfigError, EngineConfig, InvalidRequestError, SamplingParams
from engine.core.llm import QueueFullError
from engine.entrypoints.cli import main as cli_main
from engine.entrypoints.server import load_chat_template
from engine.entrypoints.server.app import build_app
from engine.entrypoints.server.engine_loop import ACCEPTED, EngineLoop
from bench.soak import parse_metrics
from tests.test_server import MESSAGES, NAME, _flags, _metrics, start_server, stop_server
from tests.tiny_tokenizer import save_tiny_llama_with_tokenizer

ENGINE = dict(max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64, block_size=4, num_gpu_blocks=300,
              max_waiting_requests=2)
LONG = ENGINE["max_model_len"] - 3  # a 3-token prompt's most tokens
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny model with a tokenizer that has no chat template (a base model's)."""
    path = save_tiny_llama_with_tokenizer(tmp_path_factory.mktemp("tiny-no-template"))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overload")
    (tmp / "template.jinja").write_text(TEMPLATE)
    proc, url = start_server(model_dir, tmp / "stderr.txt", "--device", "cpu", "--chat-template",
                             str(tmp / "template.jinja"), *_flags(ENGINE))
    yield proc, url, tmp / "stderr.txt"
    stop_server(proc)


def _metric(url: str, name: str) -> float:
    return _metrics(url)[name]


# -- the LLM API --------------------------------------------------------------------------------------

def test_add_request_raises_queue_full_past_max_waiting_requests_and_generate_is_not_bounded(model_dir):
    llm = LLM(str(model_dir), device="cpu", max_model_len=64, max_num_seqs=1, block_size=4, num_gpu_blocks=64,
              max_waiting_requests=2)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    llm.add_request([2, 40, 41], params, "a")
    llm.add_request([2, 40, 42], params, "b")
    with pytest.raises(QueueFullError) as info:
        llm.add_request([2, 40, 43], params, "c")
    assert "'c'" in str(info.value) and "max_waiting_requests=2" in str(info.value)
    with pytest.raises(InvalidRequestError):  # a bad request is refused as bad, however full the queue
        llm.add_request([], params, "bad")
    llm.add_request([2, 40, 44], params, "d", bounded=False)  # part of work already let in
    llm.step()  # one slot (max_num_seqs=1): "a" runs, "b" and "d" still wait
    with pytest.raises(QueueFullError):
        llm.add_request([2, 40, 45], params, "e")
    finished = set()
    for _ in range(100):
        finished |= {out.request_id for out in llm.step() if out.finished}
        if not llm.has_unfinished_requests():
            break
    assert finished == {"a", "b", "d"}
    llm.add_request([2, 40, 46], params, "f")  # room again
    outs = llm.generate([[2, 50 + i] for i in range(5)], params)  # its own prompts wait for it: unbounded
    assert [len(o.token_ids) for o in outs] == [3] * 5
    llm.close()


@pytest.mark.parametrize("value", [0, -1, True, 2.5, "3"])
def test_max_waiting_requests_must_be_none_or_a_positive_int(value):
    with pytest.raises(ConfigError, match="max_waiting_requests"):
        EngineConfig(max_waiting_requests=value)


# -- over HTTP ----------------------------------------------------------------------------------------

def test_a_full_queue_gets_503_with_retry_after_at_once_while_admitted_requests_complete(server):
    url = server[1]
    body = {"model": NAME, "prompt": [2, 40, 41], "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}

    async def stream(client, started: asyncio.Event, max_tokens: int) -> tuple[int, str | None, bool]:
        tokens, reason, done = 0, None, False
        async with client.stream("POST", f"{url}/v1/completions", json={**body, "max_tokens": max_tokens}) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    choice = json.loads(line[6:])["choices"][0]
                    tokens += len(choice.get("token_ids") or [])
                    reason = choice["finish_reason"] or reason
                    started.set()
        return tokens, reason, done

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            running = [asyncio.Event(), asyncio.Event()]
            # the running two long enough (the most max_model_len allows) that the two after them must
            # wait: short ones could end before those arrive, and then nothing would ever wait
            tasks = [asyncio.create_task(stream(client, e, LONG)) for e in running]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in running)), 30)  # both slots taken
            tasks += [asyncio.create_task(stream(client, asyncio.Event(), 60)) for _ in range(2)]
            deadline = time.monotonic() + 30
            while _metric(url, "infer_graphs_requests_waiting") < 2:  # the queue is full
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            refused = []
            for route, extra in (("completions", {"prompt": "hi"}), ("chat/completions", {"messages": MESSAGES})):
                start = time.perf_counter()
                resp = await client.post(f"{url}/v1/{route}", json={"model": NAME, "max_tokens": 2, **extra})
                refused.append((resp, time.perf_counter() - start))
            start = time.perf_counter()
            health = await client.get(f"{url}/health")
            health_s = time.perf_counter() - start
            results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            return refused, (health, health_s), results

    refused, (health, health_s), results = asyncio.run(run())
    for resp, seconds in refused:
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1", resp.text
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["code"], error["type"]) == ("server_overloaded", "server_error") and "waiting" in error["message"]
        assert seconds < 1.0, seconds  # refused before tokenizing, not after the engine's next step
    assert health.status_code == 200 and health_s < 1.0
    assert results == [(LONG, "length", True)] * 2 + [(60, "length", True)] * 2  # everything let in ran to its end
    assert _metric(url, "infer_graphs_requests_rejected_total{reason=queue_full}") == 2
    assert _metric(url, "infer_graphs_requests_waiting_limit") == 2
    assert _metric(url, "infer_graphs_requests_waiting") == 0 and _metric(url, "infer_graphs_kv_blocks_used") == 0
    assert _metric(url, "process_resident_memory_bytes") > 0
    ok = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200  # room again


@contextlib.contextmanager
def _serve_in_thread(llm: LLM) -> Iterator[str]:
    """serve_llm's parts (engine loop, app, uvicorn) in this process, without its signal handling;
    the base URL of a server on 127.0.0.1 and a free port."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    engine = EngineLoop(llm)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    server = uvicorn.Server(uvicorn.Config(build_app(engine, NAME, pool), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    engine.start()
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        engine.stop()
        pool.shutdown(wait=False, cancel_futures=True)
        sock.close()


def test_a_whole_response_wakes_the_event_loop_for_its_first_token_and_its_end_only(model_dir):
    # A streamed request gets an output per step; a response sent whole only its first output with a
    # token (TTFT, choices 1..n-1 go out) and its final one, which holds everything the steps between said.
    llm = LLM(str(model_dir), device="cpu", max_model_len=64, max_num_seqs=2, block_size=4, num_gpu_blocks=64)
    engine = EngineLoop(llm)
    engine.start()
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)

    async def read(every_step: bool) -> list:
        queue: asyncio.Queue = asyncio.Queue()
        engine.submit([1, 5, 9], params, f"r-{every_step}", queue, every_step=every_step)
        items = []
        while not items or items[-1] is ACCEPTED or not items[-1].finished:
            _, item = await asyncio.wait_for(queue.get(), 30)
            assert not isinstance(item, Exception), item
            items.append(item)
        return items

    async def both() -> list:
        return await asyncio.gather(read(True), read(False))

    try:
        every, whole = asyncio.run(both())
    finally:
        engine.stop()
        llm.close()
    assert every[0] is ACCEPTED and whole[0] is ACCEPTED
    assert [len(o.new_token_ids) for o in every[1:]] == [1] * 6
    assert len(whole) == 3 and not whole[1].finished and whole[1].token_ids == every[1].token_ids
    final, reference = whole[2], every[-1]
    assert final.finished and (final.token_ids, final.text, final.finish_reason) == \
        (reference.token_ids, reference.text, reference.finish_reason)
    assert final.inter_token_latencies_s and len(final.inter_token_latencies_s) == 5


def test_health_and_metrics_answer_within_100_ms_while_a_step_is_in_progress(model_dir):
    llm = LLM(str(model_dir), device="cpu", max_model_len=64, max_num_seqs=2, block_size=4, num_gpu_blocks=64,
              max_waiting_requests=2)
    runner = llm.runtime.runner
    execute, slow, in_step, release = runner.execute, threading.Event(), threading.Event(), threading.Event()

    def slow_execute(*args, **kwargs):
        if slow.is_set():  # the step is scheduled and its forward not yet run: the middle of a step
            in_step.set()
            release.wait(5)
        return execute(*args, **kwargs)

    runner.execute = slow_execute
    body = {"model": NAME, "prompt": [2, 40, 41], "max_tokens": 2, "ignore_eos": True}
    with _serve_in_thread(llm) as url, httpx.Client(timeout=10) as client, \
            concurrent.futures.ThreadPoolExecutor(1) as background:
        assert client.get(f"{url}/metrics").status_code == 200  # the first scrape's imports are not timed
        slow.set()
        answer = background.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=30)
        assert in_step.wait(10), "the request's step did not start"
        latencies_s: dict[str, list[float]] = {"/health": [], "/metrics": []}
        for _ in range(5):
            for path, seen in latencies_s.items():
                start = time.perf_counter()
                resp = client.get(f"{url}{path}")
                seen.append(time.perf_counter() - start)
                assert resp.status_code == 200, (path, resp.text)
        metrics = parse_metrics(resp.text)
        still_in_step = not answer.done()
        release.set()
        slow.clear()
        assert answer.result(30).status_code == 200
    llm.close()
    assert still_in_step  # every answer above came while the step waited
    assert max(max(s) for s in latencies_s.values()) < 0.1, latencies_s
    for name in ("requests_waiting", "requests_admitting", "requests_running", "kv_blocks_used",
                 "requests_rejected_total{reason=queue_full}", "requests_waiting_limit"):
        assert f"infer_graphs_{name}" in metrics


# -- --chat-template ----------------------------------------------------------------------------------

def test_chat_template_from_a_file_serves_chat_for_a_tokenizer_without_one(server, model_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert not tok.chat_template
    text = tok.apply_chat_template(MESSAGES, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert text.startswith("[user] ")
    resp = httpx.post(f"{server[1]}/v1/chat/completions", timeout=30,
                      json={"model": NAME, "messages": MESSAGES, "max_tokens": 3, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    assert usage["prompt_tokens"] == len(tok(text, add_special_tokens=False)["input_ids"])
    assert usage["completion_tokens"] == 3


def test_chat_template_is_a_file_or_an_inline_jinja_string(tmp_path):
    assert load_chat_template(TEMPLATE) == TEMPLATE
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(tmp_path / "t.jinja")) == "{{ messages[0]['content'] }}"


@pytest.mark.parametrize("argv,message", [
    (["--chat-template", "no/such/template.jinja"], "neither a file nor a Jinja template"),
    (["--chat-template", "{% for m in messages %}"], "does not parse as Jinja"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout=-1.0 is invalid"),
], ids=["missing-file", "bad-jinja", "negative-timeout"])
def test_a_bad_serve_option_is_one_error_line_before_the_engine_starts(argv, message, model_dir, capsys):
    start = time.perf_counter()
    status = cli_main(["serve", "--model", str(model_dir), "--device", "cpu", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and err[-1].startswith("error: ") and message in err[-1], err
    assert time.perf_counter() - start < 5  # refused before loading the model
