"""Verification of proposed tokens against the target model's distributions, for a batch of
requests at once, on the device and without a host sync.

Each request i has k_i <= K proposals (a row of `proposals`, padded with any token) and the target's
distributions at its K + 1 positions (the verify forward's rows: its last accepted token, then each
proposal). The result is the accepted proposals and one more token per request:
- greedy: the longest prefix of proposals equal to the target's argmax, then the argmax after it
  (identical, token for token, to decoding without proposals);
- sampled (rejection sampling, Leviathan et al. 2023 / Chen et al. 2023): proposal j is accepted with
  probability min(1, p_j(x) / q_j(x)) while every earlier one was; at the first rejection the extra
  token is drawn from max(p_j - q_j, 0) renormalized, after k_i acceptances from p_{k_i}. q is the
  draft model's distribution, or one-hot at the proposal (n-gram proposals: accepted with
  probability p_j(x)). The tokens are then distributed exactly as sampling from the target one by one.
The random numbers come from the caller (per-request generators keep seeded requests reproducible).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Verified:
    tokens: torch.Tensor      # [B, K + 1] int64: the accepted proposals, then the extra token; the rest -1
    num_tokens: torch.Tensor  # [B] int64: accepted + 1


def _assemble(proposals: torch.Tensor, accepted: torch.Tensor, extra: torch.Tensor) -> Verified:
    batch, width = proposals.shape[0], proposals.shape[1] + 1
    cols = torch.arange(width, device=proposals.device).expand(batch, width)
    padded = torch.cat([proposals, proposals.new_full((batch, 1), -1)], dim=1)
    tokens = torch.where(cols < accepted[:, None], padded, torch.full_like(padded, -1))
    tokens = tokens.scatter(1, accepted[:, None], extra[:, None])
    return Verified(tokens, accepted + 1)


def _accepted_count(accept: torch.Tensor) -> torch.Tensor:
    """[B, K] bool -> [B] the length of each row's leading run of True."""
    return accept.to(torch.int64).cumprod(dim=1).sum(dim=1)


def greedy_tokens(target_argmax: torch.Tensor, proposals: torch.Tensor) -> torch.Tensor:
    """target_argmax [B, K + 1], proposals [B, K] padded with -1 past each row's own -> [B, K + 1]: the
    accepted proposals and the target's token after them, then -1.

    An accepted proposal equals the target's argmax at its column, so the result is the argmax itself up
    to the accepted count and -1 after it: four kernels besides the arange (a verify step's sampling
    is host time the step waits for; engine.core.step_loop reads it before planning the next)."""
    k = proposals.shape[1]
    accepted = (target_argmax[:, :k] == proposals).cumprod(dim=1).sum(dim=1)  # -1 never equals an argmax
    cols = torch.arange(k + 1, device=proposals.device)
    return torch.where(cols <= accepted[:, None], target_argmax, -1)


def verify_greedy(target_argmax: torch.Tensor, proposals: torch.Tensor, num_proposals: torch.Tensor) -> Verified:
    """target_argmax [B, K + 1], proposals [B, K], num_proposals [B]."""
    k = proposals.shape[1]
    live = torch.arange(k, device=proposals.device)[None, :] < num_proposals[:, None]
    tokens = greedy_tokens(target_argmax, torch.where(live, proposals, -1))
    return Verified(tokens, (tokens >= 0).sum(dim=1))


def verify_sampled(target_probs: torch.Tensor, proposals: torch.Tensor, num_proposals: torch.Tensor,
                   accept_uniforms: torch.Tensor, extra_uniforms: torch.Tensor,
                   draft_probs: torch.Tensor | None = None) -> Verified:
    """target_probs [B, K + 1, V] (rows sum to 1), proposals [B, K], num_proposals [B],
    accept_uniforms [B, K] and extra_uniforms [B] in [0, 1), draft_probs [B, K, V] or None (one-hot)."""
    batch, k = proposals.shape
    index = proposals.clamp(min=0)[:, :, None]
    p = target_probs[:, :k].gather(2, index).squeeze(2)
    q = draft_probs.gather(2, index).squeeze(2) if draft_probs is not None else torch.ones_like(p)
    live = torch.arange(k, device=proposals.device)[None, :] < num_proposals[:, None]
    # u < p / q, written without the division (q may be 0 where the draft never proposes)
    accepted = _accepted_count((accept_uniforms * q < p) & live)
    rows = torch.arange(batch, device=proposals.device)
    dist = target_probs[rows, accepted].clone()  # [B, V]: the bonus distribution where all were accepted
    rejected = accepted < num_proposals
    at = accepted.clamp(max=k - 1) if k else accepted
    if k:
        if draft_probs is not None:
            q_row = draft_probs[rows, at]
        else:
            q_row = torch.zeros_like(dist).scatter_(1, proposals[rows, at].clamp(min=0)[:, None], 1.0)
        residual = (target_probs[rows, at] - q_row).clamp(min=0)
        # a residual of zero mass happens only where p <= q everywhere, i.e. p == q, where nothing is
        # rejected; kept finite for the rows it does not concern
        residual = residual / residual.sum(dim=1, keepdim=True).clamp(min=torch.finfo(residual.dtype).tiny)
        dist = torch.where(rejected[:, None], residual, dist)
    cdf = dist.cumsum(dim=1)
    target = extra_uniforms[:, None].to(cdf.dtype) * cdf[:, -1:]
    extra = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=dist.shape[1] - 1)
    return _assemble(proposals, accepted, extra)
