"""Drive a model through the paged KV cache the way the engine does, on the CPU reference op.

A tiny stand-in for the engine's KV pool and model runner, for tests: bench.paged's caches (one per
attention layer, blocks handed out in a scrambled order, so block tables are never contiguous and
sequences cross block boundaries) and its step metadata, driving prefill + greedy decode of several
sequences batched together.
"""
from __future__ import annotations

import torch

from bench.paged import PagedKV, paged_metadata

# One metadata builder for tests and benchmarks (bench.paged): tests may import bench, never the reverse.
build_metadata = paged_metadata


def PagedCache(model: torch.nn.Module, num_blocks: int, block_size: int, seed: int = 0) -> PagedKV:  # noqa: N802
    """Zeroed KV caches bound to the model's layers, with a scrambled free list (block 0 is scratch)."""
    return PagedKV.allocate(model, num_blocks, block_size, fill=False, seed=seed)


@torch.no_grad()
def paged_step(
    model: torch.nn.Module, cache: PagedKV, block_tables: list[list[int]],
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
    with cache.context(meta):
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
