"""What a user asks for (SamplingParams), what the engine tracks per request (Request), and what it
hands back (RequestOutput).

SamplingParams are validated when the request is added (`check`), so an error names the request as
well as the field, and is raised before the request touches the GPU.
"""
from __future__ import annotations

import enum
import functools
import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch


class InvalidRequestError(ValueError):
    """A request (prompt or sampling parameters) the engine refuses; the message names request and field.

    `param` is the field at fault ("prompt", "max_tokens", ...), for callers that report it separately
    (the HTTP server's error object)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"  # max_tokens generated, or the sequence reached max_model_len
    EOS = "eos"        # the model's end-of-sequence token (unless ignore_eos)
    STOP = "stop"      # one of SamplingParams.stop_token_ids, or a SamplingParams.stop string in the text
    ABORT = "abort"    # LLM.abort: stopped by the caller, its KV blocks returned at once


GREEDY_BELOW_TEMPERATURE = 1e-5  # as vLLM: dividing logits by a smaller one overflows (1e-45 -> inf / nan)
MAX_LOGPROBS = 20  # top tokens per generated token (vLLM's default limit; OpenAI's chat API allows 20)


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-probability under the model's distribution (log_softmax of its logits,
    before temperature, top-k and top-p: what vLLM returns by default), and the k most likely tokens
    of that step, most likely first (k = SamplingParams.logprobs)."""
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """Greedy when temperature < 1e-5 (0, the default, included: a smaller positive temperature
    is made exactly 0, since dividing logits by it overflows); top_k 0 and top_p 1.0 disable those
    filters."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None  # same seed (and prompt), same output, whatever else is in the batch
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Strings that end the request when they appear in the detokenized text; the text stops before
    # them (they and the stop / EOS token's text are left out unless include_stop_str_in_output).
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    # None: no log-probabilities; k: each generated token's log-probability and the k most likely
    # tokens of its step (RequestOutput.logprobs)
    logprobs: int | None = None
    # OpenAI's penalties: a token's logit loses presence_penalty once it has been generated and
    # frequency_penalty per time it has; vLLM's / transformers' repetition_penalty divides a positive
    # logit (multiplies a negative one) of every token in the prompt or the output. Applied before
    # temperature, top-k and top-p, greedy included; 0, 0 and 1 leave the logits as they are.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # vLLM's: sampled rows keep only tokens with at least min_p times the top token's probability
    # (after temperature); until min_tokens tokens are out, EOS and stop_token_ids cannot be sampled
    # and stop strings do not end the request.
    min_p: float = 0.0
    min_tokens: int = 0
    # OpenAI's logit_bias: (token id, bias in [-100, 100]) pairs added to the logits before
    # everything else (penalties, temperature, filters); a dict {token id: bias} is taken too
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        t = self.temperature
        if _is_number(t) and 0 < t < GREEDY_BELOW_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))

    def check(self, request_id: str, vocab_size: int) -> None:
        def bad(name: str, allowed: str) -> InvalidRequestError:
            return InvalidRequestError(
                f"request {request_id!r}: SamplingParams.{name}={getattr(self, name)!r} is invalid: "
                f"expected {allowed}", param=name)

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "an int >= 1")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"a finite number >= 0 (below {GREEDY_BELOW_TEMPERATURE:g} = greedy)")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "an int >= 0 (0 = off)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a number in (0, 1] (1 = off)")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise bad("seed", "None or an int in [0, 2**63)")
        ids = self.stop_token_ids
        if not isinstance(ids, (tuple, list)) or not all(_is_int(t) and 0 <= t < vocab_size for t in ids):
            raise bad("stop_token_ids", f"a list of token ids in [0, {vocab_size})")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "a bool")
        if not isinstance(self.stop, (tuple, list)) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "a list of non-empty strings")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise bad("include_stop_str_in_output", "a bool")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"None or an int in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise bad(name, "a number in [-2, 2] (0 = off), as OpenAI's API")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 100:
            raise bad("repetition_penalty", "a number in (0, 100] (1 = off)")
        bias = self.logit_bias
        if not isinstance(bias, (tuple, list)) or not all(
                isinstance(pair, (tuple, list)) and len(pair) == 2 and _is_int(pair[0]) and 0 <= pair[0] < vocab_size
                and _is_number(pair[1]) and -100 <= pair[1] <= 100 for pair in bias):
            raise bad("logit_bias", f"{{token id in [0, {vocab_size}): bias in [-100, 100]}}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "a number in [0, 1] (0 = off)")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"an int in [0, max_tokens={self.max_tokens}]")

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @functools.cached_property
    def adjusts_logits(self) -> bool:
        """Whether the sampler changes this request's logits before drawing (bias, penalties,
        min_tokens): computed once, read for every row of every step."""
        return bool(self.logit_bias) or self.has_penalties or self.min_tokens > 0


@dataclass(eq=False)  # identity: a request is itself, whatever its tokens
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.perf_counter)
    token_ids: list[int] = field(init=False)   # prompt + generated tokens the host has read; only grows
    num_computed_tokens: int = 0               # tokens whose K/V are in the cache (or being written)
    # Tokens sampled by launched steps that the host has not read yet (vLLM's num_output_placeholders):
    # they count for planning (`num_planned_tokens`), never appear in token_ids.
    num_inflight_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    token_times: list[float] = field(default_factory=list)  # perf_counter at each generated token
    generator: torch.Generator | None = field(default=None, repr=False)
    logprobs: list[TokenLogprobs] = field(default_factory=list, repr=False)  # per generated token, if asked
    # With penalties (engine.sample.sampler): how often each vocabulary token has been generated, and which
    # appear in the prompt, on the device; updated by every step that samples for the request.
    output_counts: torch.Tensor | None = field(default=None, repr=False)
    prompt_mask: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens the host knows (prompt + generated and read)."""
        return len(self.token_ids)

    @property
    def num_planned_tokens(self) -> int:
        """Known tokens plus those in flight: where the request's next chunk ends."""
        return len(self.token_ids) + self.num_inflight_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True)
class TextHistory:
    """Cursors into a request's own lists: what an output's cumulative fields hold, read on demand.
    The lists only grow (tokens, times, text pieces), so a prefix of them never changes."""
    all_token_ids: list[int]    # prompt + generated (Request.token_ids)
    num_prompt_tokens: int
    num_output_tokens: int
    text_pieces: list[str]
    num_text_pieces: int
    token_times: list[float]
    token_logprobs: list[TokenLogprobs] | None = None  # Request.logprobs when the request asked for them


@dataclass(eq=False)
class RequestOutput:
    """One request's state after a step.

    The delta fields (`new_token_ids`, `new_text`) hold what is new since this request's previous
    output; a stream sends those. The cumulative fields (`token_ids`, `text`,
    `inter_token_latencies_s`) are built from the request's lists on first access, so making an
    output costs the same at the 16th and at the 4,096th token.
    """

    request_id: str
    prompt_token_ids: list[int]            # the request's own list, not a copy: do not mutate
    new_token_ids: list[int]               # generated since the previous output (a stop / EOS token included)
    new_text: str                          # text since the previous output (held-back text excluded)
    finished: bool
    finish_reason: str | None              # "length" | "eos" | "stop" | "abort"
    ttft_s: float | None                   # arrival -> first generated token
    num_preemptions: int = 0
    history: TextHistory | None = field(default=None, repr=False)
    new_logprobs: list[TokenLogprobs] | None = None  # one per new_token_ids entry; None unless asked for

    @functools.cached_property
    def logprobs(self) -> list[TokenLogprobs] | None:
        """One per generated token (aligned with token_ids); None unless SamplingParams.logprobs was set."""
        h = self.history
        if h is None or h.token_logprobs is None:
            return None if self.new_logprobs is None else list(self.new_logprobs)
        return h.token_logprobs[:h.num_output_tokens]

    @functools.cached_property
    def token_ids(self) -> list[int]:
        """Every generated token so far (a stop / EOS token included)."""
        h = self.history
        if h is None:
            return list(self.new_token_ids)
        return h.all_token_ids[h.num_prompt_tokens:h.num_prompt_tokens + h.num_output_tokens]

    @functools.cached_property
    def text(self) -> str:
        """The decoded generated text so far ("" without a tokenizer); stop strings and the text of a
        stop / EOS token are left out unless SamplingParams.include_stop_str_in_output."""
        h = self.history
        return self.new_text if h is None else "".join(h.text_pieces[:h.num_text_pieces])

    @functools.cached_property
    def inter_token_latencies_s(self) -> list[float]:
        """Seconds between consecutive generated tokens."""
        times = self.history.token_times[:self.history.num_output_tokens] if self.history else []
        return [b - a for a, b in zip(times, times[1:])]


def check_prompt(request_id: str, prompt_token_ids: Sequence[int], vocab_size: int, max_model_len: int) -> list[int]:
    """The prompt as a list of ints, or InvalidRequestError naming the request and what is wrong."""
    if isinstance(prompt_token_ids, torch.Tensor):
        prompt_token_ids = prompt_token_ids.tolist()
    try:
        ids = list(prompt_token_ids)
    except TypeError:
        raise InvalidRequestError(f"request {request_id!r}: prompt must be a string or a sequence of token "
                                  f"ids, got {type(prompt_token_ids).__name__}", param="prompt") from None
    if not ids:
        raise InvalidRequestError(f"request {request_id!r}: prompt is empty", param="prompt")
    if not all(_is_int(t) for t in ids):
        raise InvalidRequestError(f"request {request_id!r}: prompt token ids must be ints", param="prompt")
    if len(ids) > max_model_len:
        raise InvalidRequestError(
            f"request {request_id!r}: prompt has {len(ids)} tokens, longer than max_model_len ({max_model_len})",
            param="prompt")
    out_of_vocab = [t for t in ids if not 0 <= t < vocab_size]
    if out_of_vocab:
        raise InvalidRequestError(
            f"request {request_id!r}: prompt token ids {out_of_vocab[:5]} are outside the vocabulary "
            f"[0, {vocab_size})", param="prompt")
    return [int(t) for t in ids]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
