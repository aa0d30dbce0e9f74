"""Test helpers for speculative decoding: a proposer that knows the answer (with a share of it wrong).

Acceptance needs proposals the model agrees with, and the tiny random models of the tests do not
repeat themselves, so prompt lookup finds little they accept. ReplayProposer proposes each request's
continuation from a run without speculation (tokens replaced by wrong ones at random with
probability `wrong`): every path of the verification runs, accepted prefixes of every length and
rejections at every position, while greedy outputs must stay identical to that run.
"""
from __future__ import annotations

import random

from engine.request import Request
from engine.spec.proposer import Proposer


class ReplayProposer(Proposer):
    def __init__(self, base: Proposer, continuations: dict[tuple[int, ...], list[int]], vocab: int,
                 wrong: float = 0.2, seed: int = 0) -> None:
        super().__init__(base.config)
        self.continuations = continuations  # prompt -> prompt + generated tokens
        self.vocab, self.wrong = vocab, wrong
        self.rng = random.Random(seed)

    def propose(self, request: Request, max_tokens: int, now: int) -> list[int]:
        known = self.continuations.get(tuple(request.prompt_token_ids), [])
        n = len(request.token_ids)
        tokens = known[n:n + min(self.config.num_speculative_tokens, max_tokens)]
        tokens = [t if self.rng.random() >= self.wrong else (t + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
                  for t in tokens]
        if not tokens:
            self.stats.no_proposal += 1
            self._miss(request, now)
        return tokens


def replay(llm, continuations: dict[tuple[int, ...], list[int]], wrong: float = 0.2, seed: int = 0) -> ReplayProposer:
    """Give a speculating engine a ReplayProposer (same k) in place of its prompt lookup."""
    proposer = ReplayProposer(llm.scheduler.proposer, continuations, llm.model_config.vocab_size, wrong, seed)
    llm.scheduler.proposer = proposer
    return proposer
