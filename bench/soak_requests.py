"""The soak's traffic (bench/soak.py): the seeded request mix and one request as its client sees it,
judged into an Outcome (completed, rejected, aborted, invalid, failed). docs/server.md describes the mix."""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

REQUEST_TIMEOUT_S = 120.0      # a response or stream silent this long is a failure
DISCONNECT_SHARE, INVALID_SHARE = 0.20, 0.05
STOP_STRINGS = ("\n", ".", " the", "e ", "ing")
WORDS = "the of and to in is was for on that with as by at from his her an are were which this be or".split()


@dataclass
class Target:
    url: str
    model: str
    max_model_len: int
    text: bool  # the server has a tokenizer: text prompts and stop strings work
    chat: bool  # ... and a chat template


@dataclass
class Outcome:
    kind: str = "failed"  # completed | rejected | aborted | invalid | failed
    sent_s: float = field(default_factory=time.perf_counter)
    ttft_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    retry_after_s: float = 1.0
    error: str | None = None


def make_request(rng: random.Random, t: Target, plain: bool = False) -> tuple[str, Any, float | None, bool]:
    """(route, body, disconnect, invalid): `disconnect` is the events a stream reads or the seconds a
    plain request waits before its client leaves (None: it stays); `plain`: valid, and stays."""
    if not plain and rng.random() < INVALID_SHARE:
        return (*_invalid(rng, t), None, True)
    chat = t.chat and rng.random() < 0.5
    stream, n, length = rng.random() < 0.5, 1 if rng.random() < 0.6 else rng.randint(2, 4), t.max_model_len
    r = rng.random()
    prompt_len = rng.randint(1, min(64, length - 1) if r < 0.7 else max(1, length // 4) if r < 0.95 else length - 1)
    body: dict[str, Any] = {"model": t.model, "max_tokens": rng.randint(1, 64), "n": n, "stream": stream,
                            "temperature": rng.choice([0.0, 0.8]), "return_token_ids": True}
    if rng.random() < 0.25:
        body["seed"] = rng.randrange(2**31)
    if t.text and rng.random() < 0.25:
        body["stop"] = rng.sample(STOP_STRINGS, rng.randint(1, 2))
    if rng.random() < 0.25:
        body["ignore_eos"] = True
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if chat:  # about a token per 2 characters at worst: a quarter of max_model_len stays far inside it
        words = max(1, min(prompt_len, length // 4) // 4)
        body["messages"] = [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(words))}]
        if rng.random() < 0.25:
            body.update(logprobs=True, top_logprobs=rng.randint(0, 5))
    else:  # token ids below 256: every vocabulary has them
        body["prompt"] = [rng.randrange(3, 256) for _ in range(prompt_len)]
        if rng.random() < 0.25:
            body["logprobs"] = rng.randint(0, 5)
    disconnect = None
    if not plain and rng.random() < DISCONNECT_SHARE:
        disconnect = float(rng.randint(1, 8)) if stream else rng.uniform(0.005, 0.5)
    return ("chat/completions" if chat else "completions"), body, disconnect, False


def _invalid(rng: random.Random, t: Target) -> tuple[str, Any]:
    m = t.model
    return rng.choice([
        ("completions", b'{"model": ' + json.dumps(m).encode() + b', "prompt": '),  # truncated JSON
        ("completions", {"model": m}),
        ("completions", {"model": m, "prompt": [5], "temperature": -1}),
        ("completions", {"model": m, "prompt": [5], "n": 99}),
        ("completions", {"model": m + "-missing", "prompt": [5]}),
        ("completions", {"model": m, "prompt": [5] * (t.max_model_len + 1)}),
        ("chat/completions", {"model": m, "messages": []}),
    ])


def _judge(status: int, headers: Any, payload: Any, body: Any, invalid: bool, out: Outcome) -> None:
    """A complete (non-streamed, or refused) response's outcome."""
    error = payload.get("error") if isinstance(payload, dict) else None
    if status == 503 and error and error.get("code") == "server_overloaded" and "retry-after" in headers:
        out.kind, out.retry_after_s = "rejected", float(headers["retry-after"])
    elif invalid:
        out.kind = "invalid" if 400 <= status < 500 else "failed"
        out.error = None if out.kind == "invalid" else f"a bad body got HTTP {status}"
    elif status != 200:
        out.error = f"HTTP {status}: {str(payload)[:200]}"
    elif len(payload["choices"]) != body["n"] or not all(c.get("finish_reason") for c in payload["choices"]):
        out.error = "a choice is missing or has no finish_reason"
    else:
        out.kind = "completed"


async def send(client: Any, t: Target, rng: random.Random, plain: bool = False) -> Outcome:
    """One request of the mix; never raises (a lost request is an outcome, never hides the others)."""
    route, body, disconnect, invalid = make_request(rng, t, plain)
    url, out = f"{t.url}/v1/{route}", Outcome()
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {
        "json": body}
    try:
        if isinstance(body, dict) and body.get("stream") and not invalid:
            await _stream(client, url, kwargs, body, disconnect, out)
            return out
        request = client.post(url, **kwargs)
        if disconnect is not None:
            try:
                resp = await asyncio.wait_for(request, disconnect)
            except asyncio.TimeoutError:
                out.kind = "aborted"
                return out
        else:
            resp = await request
        try:
            payload = resp.json()
        except ValueError:
            payload = resp.text
        _judge(resp.status_code, resp.headers, payload, body, invalid, out)
    except Exception as exc:
        out.kind, out.error = "failed", f"{type(exc).__name__}: {exc}"
    return out


async def _stream(client: Any, url: str, kwargs: dict, body: dict, disconnect: float | None, out: Outcome) -> None:
    async with client.stream("POST", url, **kwargs) as resp:
        if resp.status_code != 200:
            raw = await resp.aread()
            try:
                payload = json.loads(raw)
            except ValueError:
                payload = raw[:200]
            return _judge(resp.status_code, resp.headers, payload, body, False, out)
        events, finished, last, done = 0, set(), {}, False
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk, now = json.loads(line[len("data: "):]), time.perf_counter()
            if "error" in chunk:
                out.error = f"error event: {chunk['error'].get('message')}"
                continue
            for choice in chunk["choices"]:
                index, k = choice["index"], len(choice.get("token_ids") or [])
                if k:
                    if out.ttft_s is None:
                        out.ttft_s = now - out.sent_s
                    if index in last:
                        out.itls_s.extend([(now - last[index]) / k] * k)
                    last[index] = now
                if choice.get("finish_reason"):
                    finished.add(index)
            events += 1
            if disconnect is not None and events >= disconnect and len(finished) < body["n"]:
                out.kind = "aborted"
                return
        if out.error is None and not done:
            out.error = "the stream ended without [DONE]"
        elif out.error is None and len(finished) != body["n"]:
            out.error = f"{body['n'] - len(finished)} choices ended without a finish_reason"
        out.kind = "failed" if out.error else "completed"
