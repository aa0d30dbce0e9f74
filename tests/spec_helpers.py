"""Test helpers for speculative decoding: a proposer that knows the answer (with a share of it wrong).

Acceptance needs proposals the model agrees with, and the tiny random models of the tests do not
repeat themselves, so prompt lookup finds little they accept. bench.spec.ReplayProposer proposes each
request's continuation from a run without speculation, tokens replaced by wrong ones at random with
probability `wrong`: every path of the verification runs, accepted prefixes of every length and
rejections at every position, while greedy outputs must stay identical to that run.
"""
from __future__ import annotations

from bench.spec import ReplayProposer


def replay(llm, continuations: dict[tuple[int, ...], list[int]], wrong: float = 0.2, seed: int = 0) -> ReplayProposer:
    """Give a speculating engine a ReplayProposer (same k) in place of its prompt lookup."""
    proposer = ReplayProposer(llm.scheduler.proposer.config, continuations, llm.model_config.vocab_size, wrong, seed)
    llm.scheduler.proposer = proposer
    return proposer
