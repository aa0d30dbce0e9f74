"""The tokens of a step that verifies proposals, on the device and without a host sync.

The step's logits hold one row per plain sampling chunk and 1 + k rows per verify chunk (its last
token's, then each proposal's: ModelRunner._prepare). The result is a [chunks, 1 + K] int64 tensor
(K the engine's num_speculative_tokens): row i holds chunk i's tokens, its accepted proposals and the
one after them, then -1.

- Plain chunks (no proposal this step, or a request whose sampling adjusts logits) go through the
  Sampler as in any step, so penalties, bias and min_tokens hold.
- Greedy verify chunks: the target's argmax at each row (engine.spec.verify.verify_greedy), so the
  output is token for token that of decoding without speculation.
- Sampled verify chunks: the Sampler's own temperature / top-k / top-p / min-p distribution per row,
  then rejection sampling (verify_sampled) against the distribution the proposals were drawn from: a
  draft model's (the proposer's draft_probs), or one-hot at an n-gram proposal. The tokens are
  distributed exactly as the target's. The uniforms come from the request's generator where it has
  one (a seeded request reproduces), else the engine's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engine.request import Request
from engine.sample.sampler import Sampler, verify_greedy_from_keys
from engine.sample.staging import host_to_device
from engine.spec.verify import greedy_tokens, verify_sampled


@dataclass
class VerifyLayout:
    """Where each sampling chunk's rows are in the step's logits."""
    requests: list[Request]          # per sampling chunk
    proposals: list[tuple[int, ...]]  # per sampling chunk (empty: a plain chunk)
    width: int                       # 1 + K: the columns of the result
    # requests -> [len, K, V] the distributions their proposals were drawn from (None: one-hot)
    draft_probs: Callable[[list[Request]], torch.Tensor | None] | None = None

    @property
    def row_starts(self) -> list[int]:
        starts, row = [], 0
        for proposals in self.proposals:
            starts.append(row)
            row += 1 + len(proposals)
        return starts

    def row_requests(self) -> list[Request]:
        """The request of every logits row."""
        return [r for r, p in zip(self.requests, self.proposals) for _ in range(1 + len(p))]

    def row_cells(self) -> list[int]:
        """Each logits row's cell in the flattened [chunks, width] result: (chunk, j) -> chunk * width + j."""
        return [i * self.width + j for i, p in enumerate(self.proposals) for j in range(1 + len(p))]


def sample_verify(sampler: Sampler, logits: torch.Tensor, layout: VerifyLayout,
                  argmax_keys: torch.Tensor | None = None) -> torch.Tensor:
    """[chunks, width] int64 tokens (-1 past each chunk's own), on the logits' device. `argmax_keys`: the
    LM head's per-tile argmax keys of every logits row (a verify graph's, StepResult.argmax_keys)."""
    device, width = logits.device, layout.width
    requests, proposals = layout.requests, layout.proposals
    starts = layout.row_starts
    speculated = [i for i, p in enumerate(proposals) if p]
    greedy = [i for i in speculated if requests[i].params.temperature == 0]
    if len(greedy) == len(requests):  # every chunk a greedy verify (batch 1's case): no scatter into `out`
        index, padded = _verify_rows(greedy, starts, proposals, width, device)
        if argmax_keys is not None and argmax_keys.shape[0] == logits.shape[0]:
            # each row's argmax from its keys (a few thousand bytes a row, not the vocabulary: torch's
            # argmax over 5 rows of 128k logits took 26.6 us of the step's tail on an H100) and the
            # accepted prefix, in one launch
            return verify_greedy_from_keys(argmax_keys, index, padded)
        return _greedy(logits, index, padded)
    out = torch.full((len(requests), width), -1, dtype=torch.int64, device=device)
    plain = [i for i, p in enumerate(proposals) if not p]
    if plain:
        rows = host_to_device([starts[i] for i in plain], torch.int64, device)
        tokens = sampler.sample(logits.index_select(0, rows), [requests[i] for i in plain])
        out[:, 0].index_copy_(0, host_to_device(plain, torch.int64, device), tokens)
    sampled = [i for i in speculated if requests[i].params.temperature != 0]
    if greedy:
        out.index_copy_(0, host_to_device(greedy, torch.int64, device),
                        _greedy(logits, *_verify_rows(greedy, starts, proposals, width, device)))
    if sampled:
        index, padded = _verify_rows(sampled, starts, proposals, width, device)
        counts = host_to_device([len(proposals[i]) for i in sampled], torch.int64, device)
        chosen_requests = [requests[i] for i in sampled]
        draft = layout.draft_probs(chosen_requests) if layout.draft_probs else None
        tokens = _verify_sampled(sampler, logits, index, padded, counts, chosen_requests, draft)
        out.index_copy_(0, host_to_device(sampled, torch.int64, device), tokens)
    return out


def _verify_rows(chosen: list[int], starts: list[int], proposals: list[tuple[int, ...]], width: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen chunks' logits rows [n, width] and proposals [n, width - 1] (-1 past a chunk's own),
    in one copy to the device. Row (i, j) of the verify is chunk i's row j, its last row for j past its
    proposals (never read by the verification, which stops at each chunk's own count)."""
    rows = [[starts[i] + min(j, len(proposals[i])) for j in range(width)] for i in chosen]
    rows += [[*proposals[i], *[-1] * (width - len(proposals[i]))] for i in chosen]  # a spare -1 column
    both = host_to_device(rows, torch.int64, device)
    return both[:len(chosen)], both[len(chosen):, :width - 1]


def _greedy(logits: torch.Tensor, index: torch.Tensor, proposals: torch.Tensor) -> torch.Tensor:
    # torch's argmax, not the Sampler's per-row-count Triton variants: a verify step's row count
    # varies with the proposals, and each new count would compile mid-serving; both take the first
    # index of a tie, as greedy decoding without speculation does
    target = logits.index_select(0, index.flatten()).argmax(dim=-1).view(index.shape)
    return greedy_tokens(target, proposals)


def _verify_sampled(sampler: Sampler, logits: torch.Tensor, index: torch.Tensor, proposals: torch.Tensor,
                    counts: torch.Tensor, requests: list[Request], draft: torch.Tensor | None) -> torch.Tensor:
    batch, width = index.shape
    rows = logits.index_select(0, index.flatten()).float()
    row_requests = [r for r in requests for _ in range(width)]
    temperature = host_to_device([r.params.temperature for r in row_requests], torch.float32, logits.device)
    probs = Sampler._filtered_probs(rows / temperature[:, None], row_requests).view(batch, width, -1)
    uniforms = torch.empty(batch, width, dtype=torch.float32, device=logits.device)
    for i, request in enumerate(requests):
        uniforms[i].uniform_(generator=request.generator or sampler.generator)
    return verify_sampled(probs, proposals, counts, uniforms[:, :width - 1], uniforms[:, width - 1], draft).tokens
