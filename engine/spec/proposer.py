"""Proposer: which requests get proposals this step, what they are, and what speculation has earned.

Proposals come from the request's own tokens (engine.spec.ngram). A request is eligible when its
sampling does not change its logits from earlier tokens of the same step (logit bias, penalties and
min_tokens make a row's distribution depend on the rows before it: those requests decode one token a
step) and it is not backing off.

Back-off, so that speculation costs little where it does not pay: a verify step waits for the step
before it (proposals continue tokens the host must have read), so every step in which some request is
eligible gives up the host/device overlap of async scheduling. A request whose attempt gains nothing
(no proposal found, or none accepted) is next eligible at the next multiple of a window of 4, 16, 64
steps as its misses go on (aligned: every backing-off request probes on the same steps, and a probe
at batch 32 costs the GPU a whole host step, ~1.5 ms on an H200, so the windows grow fast); one
accepted proposal makes it eligible every step again. Free generation thus settles at
one probe in MAX_BACKOFF_STEPS steps for the whole batch, and copy-heavy text speculates every step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request
from engine.spec.config import SpeculativeConfig
from engine.spec.ngram import TokenBytes, ngram_propose

MAX_BACKOFF_STEPS = 64
MISSES_BEFORE_BACKOFF = 1
BACKOFF_GROWTH = 4  # the window after each further miss: 4, 16, 64 steps


@dataclass
class SpecStats:
    verify_chunks: int = 0     # chunks that carried proposals
    proposed: int = 0          # proposed tokens verified
    accepted: int = 0          # of them accepted
    no_proposal: int = 0       # attempts of an eligible request that found nothing to propose
    dropped: int = 0           # proposed tokens dropped for want of a KV block
    backoffs: int = 0          # times a request started backing off

    def as_dict(self) -> dict[str, float | int]:
        return {
            "verify_chunks": self.verify_chunks,
            "proposed_tokens": self.proposed,
            "accepted_tokens": self.accepted,
            "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            # tokens a verify chunk adds: its accepted proposals and the one after them
            "mean_accepted_length": (self.accepted + self.verify_chunks) / self.verify_chunks
            if self.verify_chunks else 0.0,
            "no_proposal": self.no_proposal,
            "dropped_tokens": self.dropped,
            "backoffs": self.backoffs,
        }


@dataclass
class _Backoff:
    misses: int = 0
    until: int = 0  # not eligible before this schedule count


class Proposer:
    # consecutive attempts that gain nothing before a request backs off (engine.spec.draft raises it:
    # a draft that usually agrees still has rounds where none of its proposals is accepted)
    misses_before_backoff = MISSES_BEFORE_BACKOFF

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.stats = SpecStats()
        self.backoff = True  # False: propose on every step whatever is rejected (benchmarks' cost rows)
        self._backoff: dict[Request, _Backoff] = {}
        self._bytes: dict[Request, TokenBytes] = {}  # prompt lookup's copy of each request's tokens

    def eligible(self, request: Request, now: int) -> bool:
        if request.params.adjusts_logits:
            return False
        state = self._backoff.get(request)
        return state is None or now >= state.until

    def propose_batch(self, items: list[tuple[Request, int]], now: int) -> list[list[int]]:
        """Proposals for each (request, room) of a step, at most room tokens each, [] where none."""
        return [self.propose(request, room, now) for request, room in items]

    def propose(self, request: Request, max_tokens: int, now: int) -> list[int]:
        """Up to min(k, max_tokens) tokens to verify after the request's last one; [] counts as a miss."""
        tokens = self.lookup(request, min(self.config.num_speculative_tokens, max_tokens))
        if not tokens:
            self.stats.no_proposal += 1
            self._miss(request, now)
        return tokens

    def lookup(self, request: Request, num_tokens: int) -> list[int]:
        """The proposals themselves: prompt lookup (a benchmark's replay overrides this)."""
        config = self.config
        data = self._bytes.get(request)
        if data is None:
            data = self._bytes[request] = TokenBytes()
        tokens = request.token_ids
        return ngram_propose(tokens, num_tokens, config.prompt_lookup_min, config.prompt_lookup_max,
                             data.update(tokens))

    def verified(self, request: Request, proposed: int, accepted: int, now: int) -> None:
        stats = self.stats
        stats.verify_chunks += 1
        stats.proposed += proposed
        stats.accepted += accepted
        if accepted:
            self._backoff.pop(request, None)
        else:
            self._miss(request, now)

    def dropped(self, num_tokens: int) -> None:
        self.stats.dropped += num_tokens

    def forget(self, request: Request) -> None:
        """A finished request leaves the back-off table and prompt lookup's copy of its tokens."""
        self._backoff.pop(request, None)
        self._bytes.pop(request, None)

    def preempted(self, request: Request) -> None:
        """The scheduler preempted the request (its KV blocks are gone; it recomputes when readmitted)."""

    def draft_probs(self, requests: list[Request]) -> torch.Tensor | None:
        """[len(requests), k, V] the distributions the proposals of these (sampled) requests were drawn
        from, for rejection sampling; None where proposals are deterministic (one-hot: prompt lookup)."""
        return None

    def close(self) -> None:
        """Release what the proposer holds on the device (a draft model's engine)."""

    def stats_dict(self) -> dict[str, object]:
        """Counts of the proposer's own beyond SpecStats (a draft model's forwards)."""
        return {}

    def reset_stats(self) -> None:
        self.stats = SpecStats()

    def _miss(self, request: Request, now: int) -> None:
        if not self.backoff:
            return
        state = self._backoff.setdefault(request, _Backoff())
        state.misses += 1
        first = self.misses_before_backoff
        if state.misses >= first:
            if state.misses == first:
                self.stats.backoffs += 1
            window = min(BACKOFF_GROWTH ** (state.misses - first + 1), MAX_BACKOFF_STEPS)
            # The next probe at a multiple of the window: a multiple of a window is one of every smaller
            # window too, so the probes of all backing-off requests fall on the same steps, and a batch
            # of them waits for the step in flight once per window, not whenever one of them probes.
            state.until = (now // window + 1) * window
