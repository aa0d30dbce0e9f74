"""Plain-torch attention: the CPU implementation of the op and the reference the kernels test against.

Computes in float32 (or float64 if given float64) whatever the input dtype, so it is a reference, not
a mirror of a kernel's rounding.
"""
from __future__ import annotations

import torch

from custom_ops.layers import AttentionLayer
from custom_ops.metadata import AttentionMetadata


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_pos: torch.Tensor, k_pos: torch.Tensor, layer: AttentionLayer,
) -> torch.Tensor:
    """q [Tq, Hq, D], k/v [Tk, Hkv, D] at absolute positions q_pos [Tq], k_pos [Tk] -> [Tq, Hq, D]."""
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = layer.num_heads // layer.num_kv_heads
    qf = q.to(compute_dtype).transpose(0, 1)                                   # [Hq, Tq, D]
    kf = k.to(compute_dtype).repeat_interleave(group, dim=1).transpose(0, 1)   # [Hq, Tk, D]
    vf = v.to(compute_dtype).repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (qf @ kf.transpose(1, 2)) * layer.scale                           # [Hq, Tq, Tk]
    if layer.logit_softcap:
        scores = layer.logit_softcap * torch.tanh(scores / layer.logit_softcap)
    distance = q_pos[:, None] - k_pos[None, :]
    visible = distance >= 0
    if layer.sliding_window:
        visible &= distance < layer.sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return (probs @ vf).transpose(0, 1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
    """All tokens form one sequence at positions 0..T-1 (no cache): the op with no forward context."""
    pos = torch.arange(q.shape[0], device=q.device)
    return attend(q, k, v, pos, pos, layer)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write k/v [T, Hkv, D] into the paged cache at slot_mapping[:T]."""
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    slots = slot_mapping[: k.shape[0]].long()
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slots] = k.to(kv_cache.dtype)
    kv_cache[1].view(-1, num_kv_heads, head_dim)[slots] = v.to(kv_cache.dtype)


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
              start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached keys and values of positions start..seq_len-1 of one sequence, in position order."""
    block_size = kv_cache.shape[2]
    pos = torch.arange(start, seq_len, device=kv_cache.device)
    blocks = block_table.long()[pos // block_size]
    offsets = pos % block_size
    return kv_cache[0, blocks, offsets], kv_cache[1, blocks, offsets]


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    layer: AttentionLayer, kv_cache: torch.Tensor, meta: AttentionMetadata,
) -> None:
    """Store the real tokens' K/V by slot, then attend each sequence over its cached prefix + new tokens."""
    starts = meta.query_start_loc.tolist()
    n = starts[-1] if meta.real_tokens_on_device else meta.num_actual_tokens
    store_kv(k[:n], v[:n], kv_cache, meta.slot_mapping)
    seq_lens = meta.seq_lens.tolist()
    for i, seq_len in enumerate(seq_lens):
        q_begin, q_end = starts[i], starts[i + 1]
        if q_end <= q_begin:
            continue
        first_query = seq_len - (q_end - q_begin)
        # Keys before the first query's window are never read, as in the kernels: a sliding-window
        # pool gives those blocks back, and their table entries point at the scratch block.
        start = max(0, first_query - layer.sliding_window + 1) if layer.sliding_window else 0
        keys, values = gather_kv(kv_cache, meta.block_tables[i], seq_len, start)
        q_pos = torch.arange(first_query, seq_len, device=q.device)
        k_pos = torch.arange(start, seq_len, device=q.device)
        out[q_begin:q_end] = attend(q[q_begin:q_end], keys, values, q_pos, k_pos, layer).to(out.dtype)
    out[n:] = 0  # padding rows read nothing; zero keeps them deterministic
