"""What the engine tracks per request (Request), how a request ends (FinishReason), and the
log-probabilities it collects (TokenLogprobs)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from engine.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"  # max_tokens generated, or the sequence reached max_model_len
    EOS = "eos"        # the model's end-of-sequence token (unless ignore_eos)
    STOP = "stop"      # one of SamplingParams.stop_token_ids, or a SamplingParams.stop string in the text
    ABORT = "abort"    # LLM.abort: stopped by the caller, its KV blocks returned at once


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-probability under the model's distribution (log_softmax of its logits,
    before temperature, top-k and top-p: what vLLM returns by default), and the k most likely tokens
    of that step, most likely first (k = SamplingParams.logprobs)."""
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


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
    # The token count (prompt + output) at which it ends by length: max_tokens or max_model_len,
    # whichever comes first; set by the scheduler that admits it (Scheduler.add).
    length_limit: int | None = field(default=None, init=False, repr=False)

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
