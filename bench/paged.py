"""A paged KV cache and step metadata for model-level benchmarks (no engine, no scheduler).

Each sequence owns its own contiguous run of blocks (block 0 stays the scratch block), so a batch
reads as many distinct K/V bytes as it would in serving: sharing blocks between sequences would
let the L2 cache serve part of the reads and flatter the kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from custom_ops import SCRATCH_BLOCK, AttentionMetadata, allocate_kv_cache, get_attention_layer

BLOCK_SIZE = 16


def blocks_per_seq(num_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-num_tokens // block_size)


@dataclass
class PagedKV:
    """One cache per attention layer; pass `caches` to `forward_context(..., kv_caches=kv.caches)`."""

    caches: dict[str, torch.Tensor]

    @classmethod
    def allocate(cls, model: torch.nn.Module, num_blocks: int, block_size: int = BLOCK_SIZE,
                 fill: bool = True) -> "PagedKV":
        """One cache per attention layer, bound to it; random contents (never time on zeros)."""
        names = list(model.attention_layer_names)
        caches = {}
        dtype = model.model.embed_tokens.weight.dtype
        device = model.model.embed_tokens.weight.device
        for name in names:
            layer = get_attention_layer(name)
            cache = allocate_kv_cache(num_blocks, block_size, layer.num_kv_heads, layer.head_dim, dtype, device)
            if fill:
                cache.normal_(0.0, 1.0)
            caches[name] = cache
        return cls(caches)

    def release(self) -> None:
        self.caches.clear()


def step_metadata(num_seqs: int, context_len: int, query_len: int, device: torch.device | str,
                  block_size: int = BLOCK_SIZE, max_seq_len: int | None = None) -> AttentionMetadata:
    """`num_seqs` sequences with `context_len` cached tokens each and `query_len` new ones.

    Sequence i owns blocks 1 + i * n .. 1 + (i + 1) * n - 1, n = blocks for context + query tokens.
    `max_seq_len` overrides the host-side bound (a graph captured for longer contexts uses it).
    """
    total = context_len + query_len
    n = blocks_per_seq(total, block_size)
    first = SCRATCH_BLOCK + 1
    tables = first + torch.arange(num_seqs * n, dtype=torch.int32).view(num_seqs, n)
    pos = torch.arange(context_len, total)
    slots = (tables[:, pos // block_size].to(torch.int64) * block_size + (pos % block_size)).reshape(-1)
    return AttentionMetadata(
        slot_mapping=slots.to(device),
        query_start_loc=(torch.arange(num_seqs + 1, dtype=torch.int32) * query_len).to(device),
        seq_lens=torch.full((num_seqs,), total, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        num_actual_tokens=num_seqs * query_len,
        max_query_len=query_len,
        max_seq_len=max_seq_len or total,
        is_uniform_decode=query_len == 1,
    )


def step_inputs(num_seqs: int, context_len: int, query_len: int, vocab_size: int, device: torch.device | str,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and the matching positions, flat [num_seqs * query_len]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (num_seqs * query_len,), generator=g)
    positions = torch.arange(context_len, context_len + query_len).repeat(num_seqs)
    return ids.to(device), positions.to(device)
