"""A paged KV cache and step metadata without the engine: for model-level benchmarks and for tests.

`PagedKV` holds one cache per attention layer, bound to the layer, and hands out blocks (block 0,
the scratch block, never): in order, or scrambled when given a seed, so tests get block tables that
are never contiguous. `paged_metadata` builds the AttentionMetadata of one step from block tables;
`step_metadata` is the benchmarks' uniform step, where each sequence owns its own contiguous run of
blocks, so a batch reads as many distinct K/V bytes as it would in serving (sharing blocks between
sequences would let the L2 cache serve part of the reads and flatter the kernels).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from custom_ops import (
    SCRATCH_BLOCK, AttentionMetadata, RuntimeMode, allocate_kv_cache, forward_context, get_attention_layer,
)

BLOCK_SIZE = 16


def blocks_per_seq(num_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-num_tokens // block_size)


@dataclass
class PagedKV:
    """One cache per attention layer (handed to attention by `context`, the one place bench and the
    tests' helpers tell the op where K/V live), and the blocks `grow` hands out."""

    caches: dict[str, torch.Tensor]
    block_size: int
    free_blocks: list[int]

    @classmethod
    def allocate(cls, model: torch.nn.Module, num_blocks: int, block_size: int = BLOCK_SIZE,
                 fill: bool = True, seed: int | None = None) -> "PagedKV":
        """One cache per attention layer, in the model's dtype and on its device. fill: random
        contents (benchmarks never time on zeros), else zeros. seed: scramble the free blocks."""
        weight = model.model.embed_tokens.weight
        caches = {}
        for name in model.attention_layer_names:
            layer = get_attention_layer(name)
            cache = allocate_kv_cache(num_blocks, block_size, layer.num_kv_heads, layer.head_dim, weight.dtype,
                                      weight.device)
            if fill:
                cache.normal_(0.0, 1.0)
            caches[name] = cache
        blocks = [b for b in range(num_blocks) if b != SCRATCH_BLOCK]
        if seed is not None:
            random.Random(seed).shuffle(blocks)
        else:
            blocks.reverse()  # grow() pops from the end: unscrambled, blocks come out in ascending order
        return cls(caches, block_size, blocks)

    def context(self, meta: AttentionMetadata, mode: RuntimeMode = RuntimeMode.NONE, num_tokens: int | None = None):
        """The forward context of one step over these caches."""
        return forward_context(meta, mode, num_tokens, self.caches)

    @property
    def layer_names(self) -> list[str]:
        return list(self.caches)

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append free blocks to `block_table` until it holds `num_tokens` tokens."""
        while len(block_table) * self.block_size < num_tokens:
            if not self.free_blocks:
                raise RuntimeError(f"PagedKV ran out of blocks ({len(self.caches)} layers of "
                                   f"{next(iter(self.caches.values())).shape[1]} blocks); allocate more")
            block_table.append(self.free_blocks.pop())

    def release(self) -> None:
        self.caches = {}


def paged_metadata(block_size: int, block_tables: list[list[int]], cached_lens: list[int], new_lens: list[int],
                   device: torch.device | str = "cpu", max_seq_len: int | None = None) -> AttentionMetadata:
    """One step: sequence i has cached_lens[i] tokens in its blocks and new_lens[i] new ones (0: none).
    Short block tables are padded with the scratch block. `max_seq_len` overrides the host-side bound
    (a graph captured for longer contexts uses it)."""
    slots: list[int] = []
    for table, cached, new in zip(block_tables, cached_lens, new_lens):
        for pos in range(cached, cached + new):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    starts = [0]
    for new in new_lens:
        starts.append(starts[-1] + new)
    seq_lens = [c + n for c, n in zip(cached_lens, new_lens)]
    width = max(len(t) for t in block_tables)
    padded = [t + [SCRATCH_BLOCK] * (width - len(t)) for t in block_tables]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        num_actual_tokens=len(slots),
        max_query_len=max(new_lens),
        max_seq_len=max_seq_len or max(seq_lens),
        is_uniform_decode=all(n == 1 for n in new_lens),
    )


def step_metadata(num_seqs: int, context_len: int, query_len: int, device: torch.device | str,
                  block_size: int = BLOCK_SIZE, max_seq_len: int | None = None) -> AttentionMetadata:
    """`num_seqs` sequences with `context_len` cached tokens each and `query_len` new ones.

    Sequence i owns blocks 1 + i * n .. 1 + (i + 1) * n - 1, n = blocks for context + query tokens.
    """
    n = blocks_per_seq(context_len + query_len, block_size)
    first = SCRATCH_BLOCK + 1
    tables = [list(range(first + i * n, first + (i + 1) * n)) for i in range(num_seqs)]
    return paged_metadata(block_size, tables, [context_len] * num_seqs, [query_len] * num_seqs, device,
                          max_seq_len)


def step_inputs(num_seqs: int, context_len: int, query_len: int, vocab_size: int, device: torch.device | str,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and the matching positions, flat [num_seqs * query_len]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (num_seqs * query_len,), generator=g)
    positions = torch.arange(context_len, context_len + query_len).repeat(num_seqs)
    return ids.to(device), positions.to(device)
