"""`python -m engine serve` end to end: one server subprocess per module, on 127.0.0.1 and a free port,
driven by the official `openai` client and by raw HTTP (httpx) where the client hides something.

The model is a tiny random-weight Llama with a real byte-level BPE tokenizer (tests/tiny_tokenizer.py);
the reference for every greedy output is `LLM.generate` on the same model directory in this process.
The server requires an API key, so every /v1 call here also checks that the key is accepted.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from bench.soak import parse_metrics
from engine import LLM, SamplingParams, TokenLogprobs
from engine.config import EngineConfig
from engine.entrypoints.cli import main as cli_main
from engine.entrypoints.cli_args import ENGINE_OPTIONS
from engine.entrypoints.server.logprobs import LogprobsFormatter, TokenText
from tests.tiny_tokenizer import save_tiny_llama_with_tokenizer

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key-123"
NAME = "tiny"
ENGINE = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_gpu_blocks=1025)
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Hello world! How are you today?"}]
STARTUP_TIMEOUT_S = 120


def _flags(engine: dict) -> list[str]:
    return [a for k, v in engine.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def start_server(model_dir: Path, log: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """Start the server, wait for its ready line; (process, base URL)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    env.pop("INFER_GRAPHS_API_KEY", None)
    with open(log, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--model", str(model_dir), "--port", "0",
                                 "--served-model-name", NAME, *extra], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=stderr)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        match = re.search(r"ready: .* at (http://127\.0\.0\.1:\d+)/v1", log.read_text())
        if match:
            return proc, match.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server not ready in {STARTUP_TIMEOUT_S} s:\n{log.read_text()}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_llama_with_tokenizer(tmp_path_factory.mktemp("tiny-served"))


# Every test over HTTP runs against both servers: the engine loop a thread of the server's process, and
# the engine in a process of its own (--engine-process, engine_process.py).
@pytest.fixture(scope="module", params=["engine_thread", "engine_process"])
def server(model_dir, tmp_path_factory, request):
    log = tmp_path_factory.mktemp("server-log") / "stderr.txt"
    proc, url = start_server(model_dir, log, "--device", "cpu", "--api-key", KEY, "--max-request-bytes", "65536",
                             *_flags(ENGINE), "--engine-process" if request.param == "engine_process" else "--no-engine-process")
    yield proc, url, log, request.param
    stop_server(proc)


@pytest.fixture(scope="module")
def url(server) -> str:
    return server[1]


@pytest.fixture(scope="module")
def reference(model_dir) -> LLM:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(str(model_dir), device="cpu", **ENGINE)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=60, max_retries=0)


def _auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def _metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=30).text)


def _chat_prompt_ids(reference: LLM, messages) -> list[int]:
    tok = reference.tokenizer
    return tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]


# -- outputs equal the engine's ---------------------------------------------------------------------

@pytest.mark.parametrize("prompt", [PROMPT, [2, 40, 41, 42, 43]], ids=["text", "token_ids"])
def test_completions_greedy_equal_llm_generate_streamed_and_not(client, reference, prompt):
    [expected] = reference.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))
    extra = {"return_token_ids": True, "ignore_eos": True}
    resp = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body=extra)
    choice = resp.choices[0]
    assert choice.text == expected.text and choice.model_extra["token_ids"] == expected.token_ids
    assert choice.finish_reason == "length"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(expected.prompt_token_ids), 12)
    text, ids, reasons, usage = "", [], [], None
    for chunk in client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                           stream_options={"include_usage": True}, extra_body=extra):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text
            ids += c.model_extra.get("token_ids") or []
            reasons.append(c.finish_reason)
    assert text == expected.text and ids == expected.token_ids
    assert reasons[-1] == "length" and set(reasons[:-1]) <= {None}
    assert usage.completion_tokens == 12


def test_chat_greedy_equals_llm_generate_on_the_chat_template(client, reference):
    [expected] = reference.generate([_chat_prompt_ids(reference, MESSAGES)],
                                    SamplingParams(max_tokens=10, ignore_eos=True))
    resp = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert resp.object == "chat.completion" and resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.text and resp.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=10, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"
    # max_completion_tokens supersedes the deprecated max_tokens, as in OpenAI's API
    resp = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=10, max_completion_tokens=3,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 3 and resp.choices[0].finish_reason == "length"


def test_max_tokens_omitted_and_null_mean_what_they_mean_in_vllm(url):
    """Completions: omitted is OpenAI's 16, null no bound (until EOS, a stop or max_model_len); chat:
    omitted and null are no bound. The bound here is max_model_len: EOS is ignored."""
    prompt = [2, 40, 41]
    unbounded = ENGINE["max_model_len"] - len(prompt)
    messages_len = None
    for route, body, want in [
            ("completions", {"prompt": prompt}, 16),
            ("completions", {"prompt": prompt, "max_tokens": None}, unbounded),
            ("chat/completions", {"messages": MESSAGES}, None),
            ("chat/completions", {"messages": MESSAGES, "max_tokens": None, "max_completion_tokens": None}, None)]:
        resp = httpx.post(f"{url}/v1/{route}", headers=_auth(), timeout=60,
                          json={"model": NAME, "temperature": 0, "ignore_eos": True, **body})
        assert resp.status_code == 200, resp.text
        usage = resp.json()["usage"]
        if want is None:  # chat: its prompt is the rendered template's
            messages_len = messages_len or usage["prompt_tokens"]
            want = ENGINE["max_model_len"] - messages_len
        assert usage["completion_tokens"] == want and resp.json()["choices"][0]["finish_reason"] == "length"
    zero = httpx.post(f"{url}/v1/chat/completions", headers=_auth(), timeout=30,
                      json={"model": NAME, "messages": MESSAGES, "max_completion_tokens": 0})
    assert zero.status_code == 400 and zero.json()["error"]["param"] == "max_completion_tokens"


def test_sse_framing_stop_strings_and_eos_as_stop_over_raw_http(url, reference):
    """What the SDK hides: each event is 'data: ...' and a blank line, the stream ends with [DONE]."""
    [base] = reference.generate([PROMPT], SamplingParams(max_tokens=16, ignore_eos=True))
    stop = base.text[6:9]
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stream": True, "stop": [stop],
            "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=_auth(), timeout=30) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]" and all(e.startswith("data: ") for e in events[:-1])
    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == base.text[:base.text.find(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


# -- logprobs ----------------------------------------------------------------------------------------

def _char_offsets(tokenizer, token_ids: list[int]) -> list[int]:
    """Where each token's text starts in the decoded text: the characters that the text before it and the
    whole text share (a character split over tokens starts where its first token does). Quadratic."""
    full = tokenizer.decode(token_ids, skip_special_tokens=True)
    return [len(os.path.commonprefix([tokenizer.decode(token_ids[:i], skip_special_tokens=True), full]))
            for i in range(len(token_ids))]


def _token_string(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_token_bytes_are_the_raw_bytes_even_for_half_a_character_and_offsets_count_each_character_once(reference):
    tok = reference.tokenizer
    text = "Café crème 🙂 日本語 ± µ"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    token_text = TokenText(tok)
    pieces = [token_text(i) for i in ids]
    assert any("\ufffd" in string for string, _ in pieces)  # the text does split characters
    assert b"".join(bytes(raw) for _, raw in pieces) == text.encode()
    assert [string for string, _ in pieces] == [_token_string(tok, i) for i in ids]
    steps = [TokenLogprobs(i, -1.0, ((i, -1.0),)) for i in ids]
    formatter = LogprobsFormatter(token_text, chat=False)
    first, rest = formatter([2], steps[:3]), formatter([2], steps[3:])  # as two stream chunks
    assert first["text_offset"] + rest["text_offset"] == _char_offsets(tok, ids)
    # a byte that never becomes a character: a lone continuation byte, a lead byte followed by ASCII
    broken = tok.convert_tokens_to_ids(["©", "ld", "æ", "x", "Ġc"])
    assert "\ufffd" in tok.decode(broken) and TokenText(tok)(broken[0])[1] == [0xA9]
    got = LogprobsFormatter(token_text, chat=False)([2], [TokenLogprobs(i, -1.0) for i in broken])
    assert got["text_offset"] == _char_offsets(tok, broken) == [0, 1, 3, 4, 5]
    chat = LogprobsFormatter(token_text, chat=True)([2], steps)["content"]
    assert [bytes(e["bytes"]) for e in chat] == [bytes(raw) for _, raw in pieces]
    # a masked logit (-inf) is a finite number JSON can carry
    [inf] = LogprobsFormatter(token_text, chat=True)([2], [TokenLogprobs(ids[0], float("-inf"))])["content"]
    assert inf["logprob"] == -9999.0 and inf["top_logprobs"] == []


def test_completions_logprobs_equal_llm_generate_streamed_and_not(client, reference):
    tok = reference.tokenizer
    [expected] = reference.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3))
    extra = {"ignore_eos": True, "return_token_ids": True}
    resp = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                     extra_body=extra)
    choice, n = resp.choices[0], resp.usage.completion_tokens
    lp = choice.logprobs
    assert choice.model_extra["token_ids"] == expected.token_ids and choice.text == expected.text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n == 8
    assert lp.tokens == [_token_string(tok, t) for t in expected.token_ids]
    assert lp.token_logprobs == pytest.approx([t.logprob for t in expected.logprobs], abs=1e-5)
    assert lp.text_offset == _char_offsets(tok, expected.token_ids)
    for token, logprob, top, want in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, expected.logprobs):
        assert logprob <= 0 and top[token] == logprob and len(top) <= 3 + 1
        values = list(top.values())
        assert values == sorted(values, reverse=True) and logprob == max(values)  # greedy: the likeliest
        want_top = {}
        for token_id, value in want.top:
            want_top.setdefault(_token_string(tok, token_id), value)
        assert top == pytest.approx({**want_top, token: logprob}, abs=1e-5)
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                           stream=True, extra_body=extra):
        for c in chunk.choices:
            if c.logprobs is not None:
                assert len(c.logprobs.tokens) == len(c.model_extra["token_ids"])  # a chunk's own tokens
                for key in streamed:
                    streamed[key] += getattr(c.logprobs, key)
    # equal up to float rounding: the second request's prefill is shorter (the prefix cache has the prompt)
    assert streamed["tokens"] == lp.tokens and streamed["text_offset"] == lp.text_offset
    assert streamed["token_logprobs"] == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert [list(t) for t in streamed["top_logprobs"]] == [list(t) for t in lp.top_logprobs]
    assert all(a == pytest.approx(b, abs=1e-5) for a, b in zip(streamed["top_logprobs"], lp.top_logprobs))
    plain = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_chat_logprobs_with_top_logprobs_streamed_and_not(client, reference):
    tok = reference.tokenizer
    [expected] = reference.generate([_chat_prompt_ids(reference, MESSAGES)],
                                    SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2))
    kwargs = dict(model=NAME, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                  extra_body={"ignore_eos": True})
    resp = client.chat.completions.create(**kwargs)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 6
    assert [e.token for e in content] == [_token_string(tok, t) for t in expected.token_ids]
    assert [e.logprob for e in content] == pytest.approx([t.logprob for t in expected.logprobs], abs=1e-5)
    for entry, want in zip(content, expected.logprobs):
        assert entry.logprob <= 0 and all(isinstance(b, int) and 0 <= b < 256 for b in entry.bytes)
        if "\ufffd" not in entry.token:
            assert bytes(entry.bytes).decode() == entry.token
        top = entry.top_logprobs
        assert [t.token for t in top] == [_token_string(tok, i) for i, _ in want.top] and len(top) == 2
        assert [t.logprob for t in top] == pytest.approx([v for _, v in want.top], abs=1e-5)
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        assert entry.logprob == top[0].logprob  # greedy
    special = set(tok.all_special_ids)
    raw = b"".join(bytes(e.bytes) for e, t in zip(content, expected.token_ids) if t not in special)
    assert raw.decode("utf-8", errors="replace") == resp.choices[0].message.content == expected.text
    streamed = []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            streamed += c.logprobs.content if c.logprobs is not None else []
    def strings(entries):
        return [(e.token, e.bytes, [(t.token, t.bytes) for t in e.top_logprobs]) for e in entries]

    def values(entries):
        return [v for e in entries for v in (e.logprob, *(t.logprob for t in e.top_logprobs))]

    # equal up to float rounding: the second request's prefill is shorter (the prefix cache has the prompt)
    assert strings(streamed) == strings(content) and values(streamed) == pytest.approx(values(content), abs=1e-5)


# -- n choices ---------------------------------------------------------------------------------------

def _seeded(seed: int, n: int, **params) -> list[SamplingParams]:
    """What choice i of a request with `seed` samples with: seed + i."""
    return [SamplingParams(seed=seed + i, **params) for i in range(n)]


def test_n_seeded_choices_equal_llm_generate_with_seed_plus_index_and_share_the_prompt_blocks(url, client,
                                                                                             reference):
    # a prompt no other test sends: 13 tokens, so 3 full blocks of 4 (block_size) to share
    prompt = [2] + [int(t) for t in torch.randint(30, 300, (12,))]
    sampling = dict(max_tokens=8, temperature=1.0, top_p=0.95, ignore_eos=True, logprobs=2)
    expected = reference.generate([prompt] * 3, _seeded(11, 3, **sampling))
    assert len({tuple(e.token_ids) for e in expected}) == 3  # the three seeds sample three different texts
    before = _metrics(url)
    resp = client.completions.create(model=NAME, prompt=prompt, n=3, seed=11, max_tokens=8, temperature=1.0,
                                     top_p=0.95, logprobs=2, extra_body={"ignore_eos": True, "return_token_ids": True})
    after = _metrics(url)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    for choice, want in zip(resp.choices, expected):
        assert choice.model_extra["token_ids"] == want.token_ids and choice.text == want.text
        assert choice.finish_reason == "length"
        assert choice.logprobs.token_logprobs == pytest.approx([t.logprob for t in want.logprobs], abs=1e-5)
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (13, 24)  # the prompt counted once
    # choices 1 and 2 start once choice 0 has prefilled: both find its 3 full blocks in the prefix cache
    hits = after["infer_graphs_prefix_cache_hit_tokens"] - before["infer_graphs_prefix_cache_hit_tokens"]
    assert hits == 2 * 12
    # each choice is a request that ended; the prompt and the time to first token are the call's, once
    def moved(name):
        return after.get(name, 0) - before.get(name, 0)
    assert moved("infer_graphs_requests_total{finish_reason=length}") == 3
    assert moved("infer_graphs_generation_tokens_total") == 24 and moved("infer_graphs_prompt_tokens_total") == 13
    assert moved("infer_graphs_time_to_first_token_seconds_count") == 1
    # the same request again: the same choices (choice i's seed is seed + i, whatever runs beside it)
    again = client.completions.create(model=NAME, prompt=prompt, n=3, seed=11, max_tokens=8, temperature=1.0,
                                      top_p=0.95, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]
    # without a seed the choices differ by themselves
    unseeded = client.completions.create(model=NAME, prompt=prompt, n=3, max_tokens=8, temperature=1.0,
                                         extra_body={"ignore_eos": True})
    assert len({c.text for c in unseeded.choices}) > 1


def test_n_streamed_interleaves_choices_each_with_one_finish_reason_then_one_usage_chunk_and_done(url, reference):
    expected = reference.generate([PROMPT] * 3, _seeded(5, 3, max_tokens=10, temperature=0.9, ignore_eos=True,
                                                         logprobs=1))
    body = {"model": NAME, "prompt": PROMPT, "n": 3, "seed": 5, "max_tokens": 10, "temperature": 0.9, "logprobs": 1,
            "ignore_eos": True, "return_token_ids": True, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=_auth(), timeout=30) as resp:
        assert resp.status_code == 200
        events = resp.read().decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]" and events.count("data: [DONE]") == 1
    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    *token_chunks, usage_chunk = chunks
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == {
        "prompt_tokens": len(expected[0].prompt_token_ids), "completion_tokens": 30,
        "total_tokens": len(expected[0].prompt_token_ids) + 30}
    ids, text, reasons, logprobs, offsets = {}, {}, {}, {}, {}
    for chunk in token_chunks:
        [choice] = chunk["choices"]  # one choice per chunk, named by its index
        i = choice["index"]
        assert i not in reasons, f"choice {i} sent a chunk after its finish_reason"
        ids.setdefault(i, []).extend(choice.get("token_ids") or [])
        text[i] = text.get(i, "") + choice["text"]
        if choice["logprobs"] is not None:  # this chunk's own tokens, with offsets in its own choice's text
            logprobs.setdefault(i, []).extend(choice["logprobs"]["token_logprobs"])
            offsets.setdefault(i, []).extend(choice["logprobs"]["text_offset"])
        if choice["finish_reason"] is not None:
            reasons[i] = choice["finish_reason"]
    assert reasons == {0: "length", 1: "length", 2: "length"}
    assert [ids[i] for i in range(3)] == [e.token_ids for e in expected]
    assert [text[i] for i in range(3)] == [e.text for e in expected]
    for i, want in enumerate(expected):
        assert logprobs[i] == pytest.approx([t.logprob for t in want.logprobs], abs=1e-5)
        # as one formatter gives for the whole choice: each choice's offsets carry on from its own chunks
        whole = LogprobsFormatter(TokenText(reference.tokenizer), chat=False)(want.prompt_token_ids, want.logprobs)
        assert offsets[i] == whole["text_offset"]
    order = [c["choices"][0]["index"] for c in token_chunks]
    assert order != sorted(order)  # interleaved as the tokens come, not one choice after the other


def test_n_greedy_chat_gives_identical_choices_streamed_and_not(client, reference):
    [expected] = reference.generate([_chat_prompt_ids(reference, MESSAGES)],
                                    SamplingParams(max_tokens=6, ignore_eos=True))
    kwargs = dict(model=NAME, messages=MESSAGES, n=2, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    resp = client.chat.completions.create(**kwargs)
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.message.content for c in resp.choices] == [expected.text] * 2
    assert resp.usage.completion_tokens == 12
    content, roles = {0: "", 1: ""}, {0: [], 1: []}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            content[c.index] += c.delta.content or ""
            roles[c.index].append(c.delta.role)
    assert content == {0: expected.text, 1: expected.text}
    assert all(r[0] == "assistant" and set(r[1:]) <= {None} for r in roles.values())  # each choice's first delta


# -- load ------------------------------------------------------------------------------------------

def test_32_concurrent_streams_with_different_lengths_and_sampling_all_finish(url):
    async def one(client, i):
        max_tokens = 1 + (i * 7) % 24
        sampling = {"temperature": 0} if i % 3 == 0 else {"temperature": 0.8, "top_p": 0.9, "seed": i}
        extra = {"ignore_eos": True, "return_token_ids": True, "top_k": 20 * (i % 2)}
        n_tokens, usage = 0, None
        stream = await client.completions.create(
            model=NAME, prompt=PROMPT if i % 2 else [2] + list(range(30, 30 + i + 1)), max_tokens=max_tokens,
            stream=True, stream_options={"include_usage": True},
            extra_body=extra, **sampling)
        async for chunk in stream:
            usage = chunk.usage or usage
            n_tokens += sum(len(c.model_extra.get("token_ids") or []) for c in chunk.choices)
        return max_tokens, n_tokens, usage.completion_tokens

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=60, max_retries=0) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(32))), 120)

    results = asyncio.run(all_of_them())
    assert all(want == got == used for want, got, used in results), results
    metrics = _metrics(url)
    assert metrics["infer_graphs_kv_blocks_used"] == 0 and metrics["infer_graphs_requests_running"] == 0


def test_disconnected_clients_are_aborted_and_their_blocks_come_back_while_others_finish(url):
    before = _metrics(url)
    long = {"model": NAME, "prompt": PROMPT, "max_tokens": 500, "temperature": 0, "ignore_eos": True}

    async def leave_mid_stream(client):
        async with client.stream("POST", f"{url}/v1/completions", json={**long, "stream": True}) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    break  # first token seen: leave

    async def leave_mid_request(client):
        with pytest.raises(httpx.ReadTimeout):
            await client.post(f"{url}/v1/completions", json=long, timeout=httpx.Timeout(30, read=0.1))

    async def leave_mid_stream_of_n(client, last_index):
        async with client.stream("POST", f"{url}/v1/completions", json={**long, "stream": True, "n": 4}) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["index"] >= last_index:
                    break  # leave before, or after, choices 1..3 have started

    async def stay(client):
        resp = await client.post(f"{url}/v1/completions", json={**long, "max_tokens": 8}, timeout=60)
        return resp.json()["usage"]["completion_tokens"]

    async def run():
        async with httpx.AsyncClient(headers=_auth(), timeout=60) as client:
            return await asyncio.wait_for(asyncio.gather(
                *(leave_mid_stream(client) for _ in range(3)), *(leave_mid_request(client) for _ in range(2)),
                leave_mid_stream_of_n(client, 0), leave_mid_stream_of_n(client, 3),
                *(stay(client) for _ in range(3))), 60)

    results = asyncio.run(run())
    assert results[-3:] == [8, 8, 8]
    deadline = time.monotonic() + 30
    while (m := _metrics(url))["infer_graphs_kv_blocks_used"] != 0 or m["infer_graphs_requests_running"] != 0:
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
    # requests of 500 tokens that ran to the end would need >= 500 decode steps; aborted, far fewer
    steps = m['infer_graphs_steps_total{mode=none}'] - before['infer_graphs_steps_total{mode=none}']
    assert steps < 400, steps


def test_a_client_gone_before_its_body_arrived_is_counted_not_an_error(server):
    """A client whose timeout fires while it is still sending (the soak's load saw 27 such) costs
    nothing: no error or traceback in the log, a counter moves, the next request is served."""
    import socket
    _, url, log, _ = server
    host, port = url.removeprefix("http://").split(":")
    before = _metrics(url).get("infer_graphs_requests_left_before_body_total", 0)
    for _ in range(3):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                         f"Content-Type: application/json\r\nContent-Length: 4096\r\n\r\n".encode()
                         + b'{"model": "' + NAME.encode() + b'", "prompt": ')  # then leave
    deadline = time.monotonic() + 30
    while _metrics(url).get("infer_graphs_requests_left_before_body_total", 0) < before + 3:
        assert time.monotonic() < deadline, "the disconnects were not counted"
        time.sleep(0.1)
    text = log.read_text()
    assert "ClientDisconnect" not in text and "Exception in ASGI application" not in text, text[-3000:]
    reply = httpx.post(f"{url}/v1/completions", headers=_auth(), timeout=60,
                       json={"model": NAME, "prompt": PROMPT, "max_tokens": 2})
    assert reply.status_code == 200, reply.text


# -- bad input, keys, limits -------------------------------------------------------------------------

BAD = [
    ("completions", b'{"model": "tiny", "prompt": ', None),
    ("completions", {"model": NAME, "prompt": ""}, "prompt"),
    ("completions", {"model": NAME, "prompt": [5] * 600}, "prompt"),
    ("completions", {"model": NAME, "prompt": [5, 10_000]}, "prompt"),
    ("completions", {"model": NAME, "prompt": "hi", "temperature": -1}, "temperature"),
    ("completions", {"model": NAME, "prompt": "hi", "temperature": "hot"}, "temperature"),
    ("completions", {"model": NAME, "prompt": "hi", "top_p": 2}, "top_p"),
    ("completions", {"model": NAME, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"model": NAME, "prompt": "hi", "n": 17}, "n"),
    ("completions", {"model": NAME, "prompt": "hi", "n": 0}, "n"),
    ("completions", {"model": NAME, "prompt": [5] * 600, "n": 3}, "prompt"),  # the engine refuses choice 0
    ("completions", {"model": NAME, "prompt": "hi", "n": 2, "best_of": 3}, "best_of"),
    ("completions", {"model": NAME, "prompt": "hi", "n": 3, "seed": 2**63 - 2}, "seed"),
    ("completions", {"model": NAME, "prompt": "hi", "stop_token_ids": [10_000]}, "stop_token_ids"),
    ("completions", {"model": NAME, "prompt": "hi", "stop": [""]}, "stop"),
    ("completions", {"model": NAME}, "prompt"),
    ("chat/completions", {"model": NAME, "messages": []}, "messages"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x " * 1000}]}, "messages"),
    ("chat/completions", {"model": NAME, "messages": MESSAGES, "n": 17, "stream": True}, "n"),
    ("chat/completions", {"model": NAME, "messages": [], "n": 3}, "messages"),  # refused once, not per choice
    # sampling features this server does not implement: refused by name, never silently ignored
    ("completions", {"model": NAME, "prompt": "hi", "frequency_penalty": 2.5}, "frequency_penalty"),
    ("completions", {"model": NAME, "prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"model": NAME, "prompt": "hi", "min_p": 1.5}, "min_p"),
    ("completions", {"model": NAME, "prompt": "hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ("completions", {"model": NAME, "prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {"model": NAME, "prompt": "hi", "logit_bias": {"five": 1}}, "logit_bias"),
    ("completions", {"model": NAME, "prompt": "hi", "suffix": "end"}, "suffix"),
    ("chat/completions", {"model": NAME, "messages": MESSAGES, "presence_penalty": -3}, "presence_penalty"),
    ("completions", {"model": NAME, "prompt": "hi", "echo": True}, "echo"),
    # logprobs: the engine's range check names the field as the request spells it
    ("completions", {"model": NAME, "prompt": "hi", "logprobs": 21}, "logprobs"),
    ("completions", {"model": NAME, "prompt": "hi", "logprobs": -1}, "logprobs"),
    ("chat/completions", {"model": NAME, "messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"model": NAME, "messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"model": NAME, "messages": MESSAGES, "response_format": {"type": "json_object"}},
     "response_format"),
    ("chat/completions", {"model": NAME, "messages": MESSAGES,
                          "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
]


@pytest.mark.parametrize("route,body,param", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_is_400_naming_the_field_and_the_server_keeps_serving(url, route, body, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    resp = httpx.post(f"{url}/v1/{route}", headers={**_auth(), "content-type": "application/json"}, timeout=30,
                      **kwargs)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param or (param and error["param"].startswith(param)), error
    ok = httpx.post(f"{url}/v1/completions", headers=_auth(), timeout=30,
                    json={"model": NAME, "prompt": PROMPT, "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2


def test_penalties_min_p_min_tokens_and_logit_bias_over_http_give_llm_generate_tokens(client, reference):
    params = dict(max_tokens=12, presence_penalty=0.8, frequency_penalty=1.2, repetition_penalty=1.5)
    [expected] = reference.generate([PROMPT], SamplingParams(ignore_eos=True, **params))
    [plain] = reference.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True))
    assert expected.token_ids != plain.token_ids  # the penalties change this prompt's tokens
    resp = client.completions.create(model=NAME, prompt=PROMPT, temperature=0, max_tokens=12,
                                     presence_penalty=0.8, frequency_penalty=1.2,
                                     extra_body={"repetition_penalty": 1.5, "ignore_eos": True, "return_token_ids": True})
    assert resp.choices[0].model_extra["token_ids"] == expected.token_ids
    # vLLM's min_p and min_tokens reach the engine too (seeded: the same draw as in-process)
    sampled = dict(max_tokens=12, temperature=1.0, seed=5, min_p=0.2, min_tokens=12)
    [expected] = reference.generate([PROMPT], SamplingParams(**sampled))
    resp = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=5,
                                     extra_body={"min_p": 0.2, "min_tokens": 12, "return_token_ids": True})
    assert resp.choices[0].model_extra["token_ids"] == expected.token_ids and len(expected.token_ids) == 12
    # logit_bias: JSON keys are strings
    resp = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0, logit_bias={"45": 100},
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    assert resp.choices[0].model_extra["token_ids"] == [45] * 4


def test_neutral_sampling_extras_are_accepted(client):
    """Clients that send every field at its neutral value (or null) are served, not refused."""
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2, temperature=0, presence_penalty=0,
                                    frequency_penalty=0, logit_bias={},
                                    extra_body={"repetition_penalty": 1.0, "min_p": None, "min_tokens": 0,
                                                "n": None, "best_of": None})
    assert out.usage.completion_tokens == 2 and len(out.choices) == 1


def test_the_sdk_sees_an_openai_error_object(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, n=17)
    assert info.value.param == "n" and "n=17" in info.value.message


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_an_unknown_model_is_404_model_not_found_as_openai_answers_it(url, client, route):
    resp = httpx.post(f"{url}/v1/{route}", headers=_auth(), timeout=30,
                      json={"model": "gpt-4", "prompt": "hi", "messages": MESSAGES})
    assert resp.status_code == 404, resp.text
    error = resp.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model", "invalid_request_error")
    assert "'gpt-4'" in error["message"] and f"'{NAME}'" in error["message"]
    with pytest.raises(openai.NotFoundError) as info:  # what the official client raises for it
        client.chat.completions.create(model="gpt-4", messages=MESSAGES, max_tokens=2)
    assert info.value.code == "model_not_found"


def test_a_missing_or_wrong_api_key_is_401_on_every_v1_route_and_health_needs_none(url):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, route in (("GET", "models"), ("POST", "completions"), ("POST", "chat/completions")):
            resp = httpx.request(method, f"{url}/v1/{route}", headers=headers, timeout=30,
                                 json={"model": NAME, "prompt": PROMPT, "messages": MESSAGES})
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    models = httpx.get(f"{url}/v1/models", headers=_auth(), timeout=30).json()
    assert [m["id"] for m in models["data"]] == [NAME]


def test_a_body_over_the_limit_is_413_with_or_without_content_length(url):
    big = b'{"model": "tiny", "prompt": "' + b"a" * 70_000 + b'"}'
    resp = httpx.post(f"{url}/v1/completions", headers=_auth(), content=big, timeout=30)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    chunked = httpx.post(f"{url}/v1/completions", headers=_auth(), content=iter([big[:40_000], big[40_000:]]),
                         timeout=30)
    assert chunked.status_code == 413


def test_metrics_parse_as_prometheus_text_and_counters_move(url, client, server):
    before = _metrics(url)
    client.completions.create(model=NAME, prompt=PROMPT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
                                   extra_body={"ignore_eos": True}))
    after = _metrics(url)
    assert after["infer_graphs_generation_tokens_total"] - before["infer_graphs_generation_tokens_total"] == 10
    assert after["infer_graphs_prompt_tokens_total"] > before["infer_graphs_prompt_tokens_total"]
    assert after["infer_graphs_steps_total{mode=none}"] >= before["infer_graphs_steps_total{mode=none}"] + 10
    assert after["infer_graphs_time_to_first_token_seconds_count"] == \
        before["infer_graphs_time_to_first_token_seconds_count"] + 2
    assert after["infer_graphs_inter_token_latency_seconds_count"] == \
        before["infer_graphs_inter_token_latency_seconds_count"] + 8
    assert after["infer_graphs_requests_total{finish_reason=length}"] == \
        before.get("infer_graphs_requests_total{finish_reason=length}", 0) + 2
    for name in ("requests_waiting", "kv_blocks_free", "graph_fallbacks_total", "preemptions_total",
                 "steps_total{mode=full}", "steps_total{mode=piecewise}", "kv_group_blocks_free{kind=full}"):
        assert f"infer_graphs_{name}" in after
    # the engine's own process (--engine-process) holds the model: its memory is shown beside the server's
    engine_rss = after.get("infer_graphs_engine_process_resident_memory_bytes")
    assert (engine_rss is not None and engine_rss > 50 * 2**20) == (server[3] == "engine_process")


def test_prompts_are_not_logged(server):
    assert "capital of France" not in server[2].read_text()


# -- command line ------------------------------------------------------------------------------------

def test_every_engine_option_is_an_engine_config_field():
    fields = {f for f in EngineConfig.__dataclass_fields__}
    assert {field for field, _ in ENGINE_OPTIONS.values()} <= fields


@pytest.mark.parametrize("argv", [
    ["generate", "--model", "/nonexistent/model", "--prompt", "hi"],
    ["serve", "--model", "/nonexistent/model"],
    ["serve", "--model", "MODEL", "--device", "cpu", "--max-num-seqs", "0"],
    ["generate", "--model", "MODEL", "--device", "cpu", "--prompt", ""],
    ["generate", "--model", "MODEL", "--max-num-seqs", "many", "--prompt", "hi"],
    ["serve", "--model", "MODEL", "--dtype", "int3"],
    # found by the engine's own start-up, in the engine's process: the same one line
    ["serve", "--model", "MODEL", "--device", "cpu", "--max-model-len", "100000", "--engine-process", "--port", "0"],
], ids=["missing-model", "serve-missing-model", "bad-config", "empty-prompt", "not-an-int", "bad-choice",
        "engine-process-start-up"])
def test_a_users_mistake_is_one_error_line_and_status_2(argv, model_dir, capsys):
    argv = [str(model_dir) if a == "MODEL" else a for a in argv]
    try:
        status = cli_main(argv)
    except SystemExit as exc:  # argparse
        status = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) >= 1 and err[-1].startswith("error: ")
    assert not any("Traceback" in line for line in err)


def test_generate_takes_the_shared_engine_options(model_dir, capsys):
    assert cli_main(["generate", "--model", str(model_dir), "--prompt", PROMPT, "--max-tokens", "3", "--ignore-eos",
                     "--device", "cpu", "--max-model-len", "64", "--block-size", "8", "--max-num-seqs", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(PROMPT) and "[3 tokens, finish: length" in out


# -- shutdown (last: it stops the module's server) ----------------------------------------------------

def test_sigterm_lets_a_running_stream_finish_then_exits_0(server, url):
    # the drain in detail (both signals, the timeout, a second signal) is tests/test_server_shutdown.py
    proc, log = server[0], server[2]
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=_auth(), timeout=30) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert proc.wait(30) == 0 and "server stopped" in log.read_text()


# -- GPU ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_server_on_cuda_with_decode_and_prefill_graphs_equals_the_engine(model_dir, tmp_path):
    engine = dict(ENGINE)
    flags = ["--device", "cuda", "--dtype", "float32", "--prefill-graphs", "--no-progress", *_flags(engine)]
    proc, url = start_server(model_dir, tmp_path / "stderr.txt", *flags)
    try:
        reference = LLM(str(model_dir), device="cuda", dtype="float32", prefill_graphs=True, **engine)
        prompts = [PROMPT, "Hello world! How are you today?", [2] + list(range(30, 90))]
        # one at a time, as the client sends them: the same batch shapes, so the same kernels
        # the last prompt also asks for logprobs: computed after the graph's logits, read back with the tokens
        logprobs = [None, None, 2]
        expected = [reference.generate([p], SamplingParams(max_tokens=16, ignore_eos=True, logprobs=k))[0]
                    for p, k in zip(prompts, logprobs)]
        seeded = reference.generate([prompts[2]] * 3, _seeded(3, 3, max_tokens=16, temperature=1.0, ignore_eos=True))
        reference.close()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
        for prompt, k, want in zip(prompts, logprobs, expected):
            resp = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0, logprobs=k,
                                             extra_body={"ignore_eos": True, "return_token_ids": True})
            assert resp.choices[0].model_extra["token_ids"] == want.token_ids
            assert resp.choices[0].text == want.text
            if k is not None:
                got = resp.choices[0].logprobs
                assert got.token_logprobs == pytest.approx([t.logprob for t in want.logprobs], abs=1e-4)
                assert all(len(top) <= k + 1 for top in got.top_logprobs)
        # n choices under the graphs: choices 1 and 2 prefill as extends over choice 0's cached blocks
        resp = client.completions.create(model=NAME, prompt=prompts[2], n=3, seed=3, max_tokens=16, temperature=1.0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
        assert [c.model_extra["token_ids"] for c in resp.choices] == [e.token_ids for e in seeded]
        metrics = _metrics(url)
        assert metrics["infer_graphs_steps_total{mode=full}"] > 0
        assert metrics["infer_graphs_steps_total{mode=piecewise}"] > 0
        assert metrics["infer_graphs_graph_fallbacks_total"] == 0
    finally:
        stop_server(proc)


def test_the_server_on_two_tensor_parallel_ranks_streams_what_one_rank_generates(model_dir, reference, tmp_path):
    # Where the server meets tensor parallelism: the engine loop thread drives rank 0, which sends
    # every step to the spawned rank 1 (gloo on the CPU); an abort by disconnect goes through the same.
    proc, tp_url = start_server(model_dir, tmp_path / "stderr.txt", "--device", "cpu", "--tensor-parallel-size", "2",
                                *_flags(ENGINE))
    try:
        client = openai.OpenAI(base_url=f"{tp_url}/v1", api_key="unused", timeout=60, max_retries=0)
        [expected] = reference.generate([PROMPT], SamplingParams(max_tokens=10, ignore_eos=True))
        extra = {"return_token_ids": True, "ignore_eos": True}
        text, ids = "", []
        for chunk in client.completions.create(model=NAME, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                               extra_body=extra):
            for c in chunk.choices:
                text += c.text
                ids += c.model_extra.get("token_ids") or []
        assert ids == expected.token_ids and text == expected.text
        assert httpx.get(f"{tp_url}/health", timeout=30).status_code == 200
    finally:
        stop_server(proc)
    assert proc.returncode is not None


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_speculating_server_answers_as_the_engine_without_speculation(model_dir, reference, tmp_path, method):
    """`serve --speculative-config`, prompt lookup or a draft model (here the target itself): streamed
    and plain completions equal LLM.generate without speculation, and /metrics carries the speculation
    counters."""
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                       "prompt_lookup_max": 2} if method == "ngram" else
                      {"model": str(model_dir), "num_speculative_tokens": 3})
    proc, url = start_server(model_dir, tmp_path / "stderr.txt", "--device", "cpu", "--api-key", KEY,
                             "--speculative-config", spec, *_flags(ENGINE))
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=60, max_retries=0)
        prompt = [2, 40, 41, 42, 43, 40, 41, 42, 43, 40, 41]
        want = reference.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True))[0].text
        got = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert got.choices[0].text == want
        stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == want
        metrics = _metrics(url)
        # prompt lookup ran for every decode it was eligible for: found proposals, or counted a miss
        assert (metrics["infer_graphs_spec_decode_verify_chunks_total"]
                + metrics["infer_graphs_spec_decode_no_proposal_total"]) > 0
        assert "infer_graphs_spec_decode_acceptance_rate" in metrics
        if method == "draft_model":  # the target as its own draft: every proposal accepted
            assert metrics["infer_graphs_spec_decode_acceptance_rate"] > 0.9
            assert metrics["infer_graphs_spec_decode_draft_forwards_total"] > 0
    finally:
        stop_server(proc)
