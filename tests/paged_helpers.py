"""Drive a model through the paged KV cache the way the engine does, on the CPU reference op.

A tiny stand-in for the engine's KV pool and model runner, for tests: bind one cache per attention
layer, hand out blocks in a scrambled order (so block tables are never contiguous and sequences
cross block boundaries), build the AttentionMetadata of one step, and run prefill + greedy decode of
several sequences batched together.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

import custom_ops
from custom_ops import AttentionMetadata, allocate_kv_cache, forward_context


@dataclass
class PagedCache:
    """One KV cache per model layer (`caches`, for the forward context) plus a scrambled free list of
    blocks (block 0 is scratch)."""

    model: torch.nn.Module
    num_blocks: int
    block_size: int
    seed: int = 0
    free_blocks: list[int] = field(init=False)
    caches: dict[str, torch.Tensor] = field(init=False)

    def __post_init__(self) -> None:
        cfg = self.model.config
        device = self.model.model.embed_tokens.weight.device
        self.caches = {name: allocate_kv_cache(self.num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim,
                                               cfg.dtype, device)
                       for name in self.model.attention_layer_names}
        blocks = [b for b in range(self.num_blocks) if b != custom_ops.SCRATCH_BLOCK]
        random.Random(self.seed).shuffle(blocks)
        self.free_blocks = blocks

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append blocks to `block_table` until it holds `num_tokens` tokens."""
        while len(block_table) * self.block_size < num_tokens:
            if not self.free_blocks:
                raise RuntimeError("test KV cache ran out of blocks; raise num_blocks")
            block_table.append(self.free_blocks.pop())

    def release(self) -> None:
        self.caches.clear()


def build_metadata(
    block_size: int, block_tables: list[list[int]], cached_lens: list[int], new_lens: list[int],
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Metadata for one step: sequence i has cached_lens[i] tokens in the cache and new_lens[i] new ones."""
    slots: list[int] = []
    for table, cached, new in zip(block_tables, cached_lens, new_lens):
        for pos in range(cached, cached + new):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    starts = [0]
    for new in new_lens:
        starts.append(starts[-1] + new)
    seq_lens = [c + n for c, n in zip(cached_lens, new_lens)]
    width = max(len(t) for t in block_tables)
    padded = [t + [custom_ops.SCRATCH_BLOCK] * (width - len(t)) for t in block_tables]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        num_actual_tokens=len(slots),
        max_query_len=max(new_lens),
        max_seq_len=max(seq_lens),
        is_uniform_decode=all(n == 1 for n in new_lens),
    )


@torch.no_grad()
def paged_step(
    model: torch.nn.Module, cache: PagedCache, block_tables: list[list[int]],
    cached_lens: list[int], new_tokens: list[list[int]],
) -> torch.Tensor:
    """One batched step: append new_tokens[i] to sequence i; returns logits [sum(new), V]."""
    device = model.model.embed_tokens.weight.device
    new_lens = [len(t) for t in new_tokens]
    for table, cached, new in zip(block_tables, cached_lens, new_lens):
        cache.grow(table, cached + new)
    meta = build_metadata(cache.block_size, block_tables, cached_lens, new_lens, device)
    ids = torch.tensor([tok for toks in new_tokens for tok in toks], dtype=torch.int64, device=device)
    positions = torch.tensor(
        [p for cached, new in zip(cached_lens, new_lens) for p in range(cached, cached + new)],
        dtype=torch.int64, device=device)
    with forward_context(meta, kv_caches=cache.caches):
        hidden = model(ids, positions)
    return model.compute_logits(hidden)


@torch.no_grad()
def paged_greedy_generate(
    model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int,
    block_size: int = 4, num_blocks: int = 128, prefill_chunk: int | None = None,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy decode of all prompts batched: prefill (in chunks of `prefill_chunk` tokens if given),
    then one token per sequence per step. Returns the generated ids per prompt and, per prompt, the
    logits [len(prompt) + max_new_tokens - 1, V] of every position the model was run on, in order."""
    cache = PagedCache(model, num_blocks, block_size)
    try:
        tables: list[list[int]] = [[] for _ in prompts]
        cached = [0] * len(prompts)
        logits: list[list[torch.Tensor]] = [[] for _ in prompts]
        chunk = prefill_chunk or max(len(p) for p in prompts)
        pending = [list(p) for p in prompts]
        while any(pending):  # prefill; a sequence whose prompt is done contributes no tokens
            step_tokens = [p[:chunk] for p in pending]
            out = paged_step(model, cache, tables, cached, step_tokens)
            for i, part in enumerate(_split(out, [len(t) for t in step_tokens])):
                logits[i].append(part)
                cached[i] += len(step_tokens[i])
                pending[i] = pending[i][len(step_tokens[i]):]
        generated = [[int(torch.cat(lg)[-1].argmax())] for lg in logits]
        for _ in range(max_new_tokens - 1):
            out = paged_step(model, cache, tables, cached, [[g[-1]] for g in generated])
            for i in range(len(prompts)):
                logits[i].append(out[i:i + 1])
                cached[i] += 1
                generated[i].append(int(out[i].argmax()))
        return generated, [torch.cat(lg) for lg in logits]
    finally:
        cache.release()


def _split(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(t.split(sizes)) if sizes else []
