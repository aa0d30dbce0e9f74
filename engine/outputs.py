"""What the engine hands back per request and step: RequestOutput, whose cumulative fields read the
request's own lists through cursors (TextHistory)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.request import TokenLogprobs


class TextHistory(NamedTuple):
    """Cursors into a request's own lists: what an output's cumulative fields hold, read on demand.
    The lists only grow (tokens, times, text pieces), so a prefix of them never changes. A tuple:
    one is made per request and step on the server's path, 0.3 us against a frozen dataclass's 0.9."""
    all_token_ids: list[int]    # prompt + generated (Request.token_ids)
    num_prompt_tokens: int
    num_output_tokens: int
    text_pieces: list[str]
    num_text_pieces: int
    token_times: list[float]
    token_logprobs: list[TokenLogprobs] | None = None  # Request.logprobs when the request asked for them


class CompletionOutput(NamedTuple):
    """vLLM's per-completion view of a RequestOutput (`out.outputs[0].text`), for code written
    against vLLM; finish_reason in vLLM's words: EOS and stop strings / ids are "stop"."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None


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

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's shape: one completion per request here (SamplingParams.n is 1)."""
        reason = "stop" if self.finish_reason == "eos" else self.finish_reason
        return [CompletionOutput(0, self.text, self.token_ids, self.logprobs, reason)]

    @functools.cached_property
    def inter_token_latencies_s(self) -> list[float]:
        """Seconds between consecutive generated tokens."""
        times = self.history.token_times[:self.history.num_output_tokens] if self.history else []
        return [b - a for a, b in zip(times, times[1:])]


def merged(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one: the deltas joined, the rest the later's. What a
    consumer that fell behind reads instead of both (the server under load: one chunk, not two)."""
    logprobs = None if earlier.new_logprobs is None and later.new_logprobs is None else [
        *(earlier.new_logprobs or ()), *(later.new_logprobs or ())]
    # the constructor, not dataclasses.replace (3x its cost, on the event loop once per merged output)
    return RequestOutput(request_id=later.request_id, prompt_token_ids=later.prompt_token_ids,
                         new_token_ids=earlier.new_token_ids + later.new_token_ids,
                         new_text=earlier.new_text + later.new_text, finished=later.finished,
                         finish_reason=later.finish_reason,
                         ttft_s=earlier.ttft_s if earlier.ttft_s is not None else later.ttft_s,
                         num_preemptions=later.num_preemptions, history=later.history, new_logprobs=logprobs)
