"""A step's shape: the chunks the scheduler (engine.core.scheduler) plans and the model runner
(engine.worker.model_runner) runs; a draft model's steps (engine.spec.draft) have it too."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request


@dataclass(slots=True)  # not frozen (nothing changes a chunk once made): a frozen one costs 4x to make, 64 a step
class ScheduledChunk:
    request: Request
    start: int        # position of the chunk's first token (= tokens already cached)
    num_tokens: int   # tokens computed this step (the proposals included)
    samples: bool     # the chunk reaches the end of the request's tokens: its last logits give the next one
    # Speculative decoding: tokens proposed after the request's last one (engine.spec). The chunk is
    # then a verify chunk: its last token and the proposals, num_tokens = 1 + len(proposals), and
    # every one of its rows gives logits (engine.spec.sampling).
    proposals: tuple[int, ...] = ()

    @classmethod
    def next_for(cls, request: Request, num_tokens: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        return cls(request, start, num_tokens, start + num_tokens == request.num_planned_tokens)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_uniform_decode(self) -> bool:
        return bool(self.chunks) and all(c.num_tokens == 1 for c in self.chunks)

    @property
    def is_verify(self) -> bool:
        """Some chunk verifies proposals and every chunk is a decode (of one token or with proposals):
        a step of uniform shape that speculation's graphs serve (engine.worker.dispatch)."""
        return (any(c.proposals for c in self.chunks)
                and all(c.samples and c.num_tokens == 1 + len(c.proposals) for c in self.chunks))

    @property
    def is_empty(self) -> bool:
        return not self.chunks
