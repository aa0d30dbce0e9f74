"""The OpenAI wire format: request bodies, response objects, stream chunks and error objects.

The request models check only the shape of a body (types, which fields exist); the values are
checked once, by SamplingParams.check and the engine's prompt check, whose InvalidRequestError
names the field that the 400 reports (as the request's wire names it: a chat request's `top_logprobs`
is SamplingParams.logprobs). Unknown fields are ignored, as OpenAI's own server does; fields this
server does not implement (best_of other than n, echo, suffix, tools, ...) are refused by name.
"""
from __future__ import annotations

import json
import time
from json.encoder import encode_basestring
from typing import Any, ClassVar, Optional, Union

from pydantic import BaseModel, ConfigDict, field_validator

from engine.params import SamplingParams

MAX_N = 16  # choices per request: each is an engine request, so n is bounded like a batch is
SEED_LIMIT = 2**63  # SamplingParams.check's bound: choice i samples with seed + i, which must stay below it

# the engine's finish reasons as OpenAI names them ("eos" is a stop; "abort" has no OpenAI name)
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}

# one encoder for every event: json.dumps with these options builds a new one per call
_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


# Line breaks that str.splitlines() honours beyond CR / LF, and with it clients that read a stream by it
# (httpx's aiter_lines): raw inside an event's JSON (ensure_ascii=False leaves them), they cut the
# event's data line in two and the client's JSON parse fails. JSON's own escapes carry them unchanged.
_LINE_BREAKS = (("\u2028", "\\u2028"), ("\u2029", "\\u2029"), ("\x85", "\\u0085"))


def _one_line(event: str) -> str:
    if event.isascii():  # (O(1) in CPython: most events)
        return event
    for raw, escaped in _LINE_BREAKS:
        if raw in event:
            event = event.replace(raw, escaped)
    return event


def sse(obj: Any) -> str:
    """One server-sent event carrying `obj` as compact JSON, on one line for every client."""
    return _one_line(f"data: {_JSON.encode(obj)}\n\n")


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    # null: no bound of the request's own (until EOS, a stop or max_model_len), as vLLM reads it;
    # omitted: the same for chat, OpenAI's 16 for completions (CompletionRequest)
    max_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    n: int = 1
    best_of: Optional[int] = None
    echo: bool = False
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    return_token_ids: bool = False  # vLLM's extension: the generated token ids in each choice
    # None (JSON null, as clients send for unset) leaves sampling as it is
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None  # vLLM's extension
    min_p: Optional[float] = None  # vLLM's extension
    min_tokens: Optional[int] = None  # vLLM's extension
    logit_bias: Optional[dict[str, float]] = None  # token id (a JSON key, so a string) -> bias
    # Accepted only at the values that leave sampling as it is: a client that asks for a format gets
    # a 400 naming the field, not tokens sampled as if it had not asked.
    response_format: Optional[dict[str, Any]] = None

    # SamplingParams field -> the request field that set it, for the `param` of a 400
    WIRE_NAMES: ClassVar[dict[str, str]] = {}

    @field_validator("n", mode="before")
    @classmethod
    def _null_n_is_one(cls, n: Any) -> Any:
        return 1 if n is None else n  # JSON null, as clients send for unset: OpenAI's default

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None, or the number of most likely tokens to report per token."""
        raise NotImplementedError

    def unsupported(self) -> tuple[str, str] | None:
        """(field, message) for a feature this server does not implement, or a combination of fields
        OpenAI refuses, else None."""
        if not 1 <= self.n <= MAX_N:
            return "n", f"n={self.n} is out of range: n must be an int in [1, {MAX_N}]"
        if self.best_of not in (None, self.n):
            return "best_of", (f"best_of={self.best_of} is not supported: best_of must be null or equal to n "
                               f"({self.n}); this server returns every sample, it does not rank them")
        if self.seed is not None and 0 <= self.seed < SEED_LIMIT <= self.seed + self.n - 1:
            return "seed", (f"seed={self.seed} with n={self.n}: choice i samples with seed + i, which must be "
                            "below 2**63")
        if self.echo:
            return "echo", "echo is not supported"
        if self.logit_bias and not all(key.strip().lstrip("-").isdigit() for key in self.logit_bias):
            return "logit_bias", "logit_bias keys must be token ids"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format", f"response_format {self.response_format.get('type')!r} is not supported (only 'text')"
        return None

    @property
    def max_new_tokens(self) -> int | None:
        """SamplingParams.max_tokens (None: until EOS, a stop or max_model_len)."""
        return self.max_tokens

    def wire_name(self, field: str | None) -> str | None:
        """The request field that set SamplingParams.`field` (for the `param` of a 400)."""
        return self.WIRE_NAMES.get(field, field)

    def sampling_params(self) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=self.max_new_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            stop=stop, stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=self.num_logprobs,
            presence_penalty=0.0 if self.presence_penalty is None else self.presence_penalty,
            frequency_penalty=0.0 if self.frequency_penalty is None else self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=self.min_p or 0.0, min_tokens=self.min_tokens or 0,
            logit_bias=tuple((int(key), bias) for key, bias in (self.logit_bias or {}).items()))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int]]
    max_tokens: Optional[int] = 16  # OpenAI's default when omitted; null: no bound (vLLM)
    suffix: Optional[str] = None
    logprobs: Optional[int] = None  # the k most likely tokens (and the sampled one) per token

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix is not supported"
        return super().unsupported()


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: Union[str, list[dict[str, Any]], None] = None

    def text(self) -> str:
        """The content as text: a string, or the text parts of a list of content parts."""
        if isinstance(self.content, list):
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None  # with logprobs: the k most likely tokens per token
    tools: Optional[list[dict[str, Any]]] = None

    WIRE_NAMES: ClassVar[dict[str, str]] = {"prompt": "messages", "logprobs": "top_logprobs"}

    @property
    def max_new_tokens(self) -> int | None:
        """max_completion_tokens supersedes the deprecated max_tokens (OpenAI); neither: no bound."""
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    def wire_name(self, field: str | None) -> str | None:
        if field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return super().wire_name(field)

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs not in (None, 0) and not self.logprobs:  # OpenAI's rule (0 is a default clients send)
            return "top_logprobs", f"top_logprobs={self.top_logprobs} needs logprobs: true"
        if self.tools:  # ignoring them would answer as if the model had never been offered the tools
            return "tools", "tools (function calling) are not supported"
        return super().unsupported()


def error_body(message: str, param: str | None = None, code: str | None = None,
               type: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def usage(num_prompt: int, num_completion: int) -> dict[str, int]:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion}


class ResponseBuilder:
    """The response objects of one request, completions or chat."""

    def __init__(self, request_id: str, model: str, chat: bool, return_token_ids: bool) -> None:
        self.id, self.model, self.chat = request_id, model, chat
        self.created = int(time.time())
        self.return_token_ids = return_token_ids
        self._event_prefix: str | None = None  # chunk_event's start, made at the first chunk

    def _object(self, kind: str, choices: list, **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def final(self, outs: list[Any], logprobs: list[dict[str, Any] | None]) -> dict[str, Any]:
        """The response for the finished outputs of choices 0..n-1. `logprobs`: per choice, the
        LogprobsFormatter's object for every generated token, or None (not asked)."""
        choices = []
        for index, (out, choice_logprobs) in enumerate(zip(outs, logprobs)):
            reason = FINISH_REASONS.get(out.finish_reason, out.finish_reason)
            if self.chat:
                choice = {"index": index, "message": {"role": "assistant", "content": out.text},
                          "logprobs": choice_logprobs, "finish_reason": reason}
            else:
                choice = {"index": index, "text": out.text, "logprobs": choice_logprobs, "finish_reason": reason}
            if self.return_token_ids:
                choice["token_ids"] = list(out.token_ids)
            choices.append(choice)
        # the prompt is one for all choices: counted once, as OpenAI does
        return self._object("chat.completion" if self.chat else "text_completion", choices,
                            usage=usage(len(outs[0].prompt_token_ids), sum(len(o.token_ids) for o in outs)))

    def chunk(self, index: int, text: str, token_ids: list[int] | None, finish_reason: str | None,
              first: bool = False, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """Choice `index`'s new text; `first`: its first chunk. `logprobs`: the object for this chunk's
        tokens (token_ids), or None."""
        reason = FINISH_REASONS.get(finish_reason, finish_reason) if finish_reason else None
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        if self.return_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def chunk_event(self, index: int, text: str, token_ids: list[int] | None, finish_reason: str | None,
                    first: bool = False, logprobs: dict[str, Any] | None = None) -> str:
        """`sse(self.chunk(...))`, byte for byte, written from a per-request prefix: a stream sends one
        per request and step, on the event loop that shares the GIL with the engine's step thread, and
        building then encoding the whole object each time was a quarter of the loop's own work a chunk
        (bench/results/cpu-2026-12-07/sse-chunk/)."""
        prefix = self._event_prefix
        if prefix is None:
            kind = "chat.completion.chunk" if self.chat else "text_completion"
            prefix = self._event_prefix = (f'data: {{"id":{encode_basestring(self.id)},"object":"{kind}",'
                                           f'"created":{self.created},"model":{encode_basestring(self.model)},'
                                           '"choices":[{"index":')
        if self.chat:
            body = (',"delta":{"role":"assistant","content":' if first else ',"delta":{"content":') + \
                encode_basestring(text) + '},"logprobs":'
        else:
            body = ',"text":' + encode_basestring(text) + ',"logprobs":'
        reason = FINISH_REASONS.get(finish_reason, finish_reason) if finish_reason else None
        tail = (',"finish_reason":' + ("null" if reason is None else encode_basestring(reason)) +
                (',"token_ids":[' + ",".join(map(str, token_ids)) + "]"
                 if self.return_token_ids and token_ids is not None else ""))
        return _one_line(prefix + str(index) + body + ("null" if logprobs is None else _JSON.encode(logprobs))
                         + tail + "}]}\n\n")

    def usage_chunk(self, num_prompt: int, num_completion: int) -> dict[str, Any]:
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [],
                            usage=usage(num_prompt, num_completion))
