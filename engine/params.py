"""What a user asks for: SamplingParams, and the validation of a request (its prompt and its parameters).

SamplingParams validate themselves when they are made (as vLLM's do): an invalid value raises
InvalidRequestError naming the field. What depends on the engine (token ids against the vocabulary,
the prompt against max_model_len) is checked when the request is added (`check`, `check_prompt`),
naming the request as well, before the request touches the GPU.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import torch


class InvalidRequestError(ValueError):
    """A request (prompt or sampling parameters) the engine refuses; the message names request and field.

    `param` is the field at fault ("prompt", "max_tokens", ...), for callers that report it separately
    (the HTTP server's error object)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # crosses from the server's engine process to its HTTP process
        return type(self), (str(self), self.param)


GREEDY_BELOW_TEMPERATURE = 1e-5  # as vLLM: dividing logits by a smaller one overflows (1e-45 -> inf / nan)
MAX_LOGPROBS = 20  # top tokens per generated token (vLLM's default limit; OpenAI's chat API allows 20)


@dataclass(frozen=True)
class SamplingParams:
    """Greedy when temperature < 1e-5 (0, the default, included: a smaller positive temperature
    is made exactly 0, since dividing logits by it overflows); top_k 0 (or vLLM's -1) and top_p 1.0
    disable those filters. Validated when made: an invalid value raises InvalidRequestError naming
    the field. List fields (stop, stop_token_ids, logit_bias) are kept as tuples, so the object
    stays hashable and immutable."""

    # None (vLLM's): no bound of its own; the request runs until EOS, a stop, or max_model_len
    max_tokens: int | None = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None  # same seed (and prompt), same output, whatever else is in the batch
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Strings that end the request when they appear in the detokenized text; the text stops before
    # them (they and the stop / EOS token's text are left out unless include_stop_str_in_output).
    # None, one string or a list are taken too (vLLM), and kept as a tuple.
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
    # vLLM's completions per prompt: 1 here (one request, one completion); the server's `n` fans a
    # request out into n of them
    n: int = 1

    def __post_init__(self) -> None:
        t = self.temperature
        if _is_number(t) and 0 < t < GREEDY_BELOW_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        # vLLM's spellings: stop as None, one string or a list; top_k=-1 for "off"; None for "none"
        stop = self.stop
        if stop is None or isinstance(stop, str):
            object.__setattr__(self, "stop", () if stop is None else (stop,))
        elif isinstance(stop, list):
            object.__setattr__(self, "stop", tuple(stop))
        if _is_int(self.top_k) and self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.stop_token_ids is None or isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.logit_bias is None or isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple((self.logit_bias or {}).items()))
        elif isinstance(self.logit_bias, list):
            object.__setattr__(self, "logit_bias", tuple(
                tuple(pair) if isinstance(pair, list) else pair for pair in self.logit_bias))
        self._validate()

    def _bad(self, name: str, allowed: str, request_id: str | None = None) -> InvalidRequestError:
        where = "" if request_id is None else f"request {request_id!r}: "
        return InvalidRequestError(f"{where}SamplingParams.{name}={getattr(self, name)!r} is invalid: "
                                   f"expected {allowed}", param=name)

    def _validate(self) -> None:
        """Every rule that needs nothing but the values themselves (run when the object is made)."""
        bad = self._bad
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "an int >= 1, or None (until EOS, a stop or max_model_len)")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"a finite number >= 0 (below {GREEDY_BELOW_TEMPERATURE:g} = greedy)")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "an int >= 0 (0 or -1 = off)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a number in (0, 1] (1 = off)")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise bad("seed", "None or an int in [0, 2**63)")
        if not isinstance(self.stop_token_ids, tuple) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "None or a list of token ids (ints >= 0)")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "a bool")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "None, a non-empty string or a list of non-empty strings")
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
        if not isinstance(self.logit_bias, tuple) or not all(
                isinstance(pair, tuple) and len(pair) == 2 and _is_int(pair[0]) and pair[0] >= 0
                and _is_number(pair[1]) and -100 <= pair[1] <= 100 for pair in self.logit_bias):
            raise bad("logit_bias", "{token id (int >= 0): bias in [-100, 100]}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "a number in [0, 1] (0 = off)")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an int >= 0")
        if not _is_int(self.n) or self.n != 1:
            raise bad("n", "1: LLM.generate gives one completion per prompt; for n samples pass the prompt n "
                           "times (with seeds seed + i to make them differ reproducibly), as the server's n does")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"an int in [0, max_tokens={self.max_tokens}]")

    def check(self, request_id: str, vocab_size: int) -> None:
        """The rules that depend on the engine's model: token ids inside its vocabulary."""
        if any(t >= vocab_size for t in self.stop_token_ids):
            raise self._bad("stop_token_ids", f"a list of token ids in [0, {vocab_size})", request_id)
        if any(token >= vocab_size for token, _ in self.logit_bias):
            raise self._bad("logit_bias", f"{{token id in [0, {vocab_size}): bias in [-100, 100]}}", request_id)

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @functools.cached_property
    def adjusts_logits(self) -> bool:
        """Whether the sampler changes this request's logits before drawing (bias, penalties,
        min_tokens): computed once, read for every row of every step."""
        return bool(self.logit_bias) or self.has_penalties or self.min_tokens > 0


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
    # set(map(type, ...)), min and max run in C: a 512-token prompt checks in 26 us, not 79 us of
    # per-token Python (CPU box), on the thread that adds requests
    if set(map(type, ids)) != {int}:
        if not all(_is_int(t) for t in ids):
            raise InvalidRequestError(f"request {request_id!r}: prompt token ids must be ints", param="prompt")
        ids = [int(t) for t in ids]  # int subclasses (IntEnum, ...) as plain ints
    if len(ids) > max_model_len:
        raise InvalidRequestError(
            f"request {request_id!r}: prompt has {len(ids)} tokens, longer than max_model_len ({max_model_len})",
            param="prompt")
    if min(ids) < 0 or max(ids) >= vocab_size:
        out_of_vocab = [t for t in ids if not 0 <= t < vocab_size]
        raise InvalidRequestError(
            f"request {request_id!r}: prompt token ids {out_of_vocab[:5]} are outside the vocabulary "
            f"[0, {vocab_size})", param="prompt")
    return ids


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def batch_of_prompts(prompts, params, sampling_params=None) -> tuple[list, list[SamplingParams]]:
    """generate()'s arguments as two lists of equal length: one prompt (a string, a list of ids, a 1-D
    tensor) or many (a [B, T] tensor too); one SamplingParams for all, or one each. `sampling_params`
    is vLLM's name for `params`."""
    if sampling_params is not None:
        if params is not None:
            raise InvalidRequestError("generate got both params and sampling_params (the same argument)")
        params = sampling_params
    if isinstance(prompts, torch.Tensor):  # [T] is one prompt, [B, T] a batch
        prompts = [prompts] if prompts.dim() == 1 else list(prompts)
    elif isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    prompts = list(prompts)
    if params is None or isinstance(params, SamplingParams):
        params = [params or SamplingParams()] * len(prompts)
    params = list(params)
    if len(params) != len(prompts):
        raise InvalidRequestError(f"generate got {len(prompts)} prompts but {len(params)} SamplingParams")
    return prompts, params
