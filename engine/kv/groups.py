"""KV cache groups: layers grouped by attention kind, each group with its own tensors and block pool,
and how one memory budget is split between them.

A model whose layers are all of one kind (Llama, Qwen3) has one group and runs exactly as with one
BlockPool. A model that mixes full-attention and sliding-window layers (Gemma 3: window 512 on 5 of
every 6 layers) gets group 0 for the full layers (a BlockPool: every block of a sequence is kept,
with the prefix cache's chained keys) and one group per window size (a SlidingBlockPool: blocks
given back once out of the window). Each group's tensors hold only its own layers, so a block of a
group costs only its layers' bytes, and each sequence has one block table per group (the attention
op finds its layer's table through the forward context's group metadata, engine.worker.model_runner).
`split_memory` sizes the groups from one memory budget; engine.kv.grouped_pool puts their pools
behind one interface.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from custom_ops import get_attention_layer


@dataclass(frozen=True)
class KVGroup:
    layer_names: tuple[str, ...]
    sliding_window: int | None  # None: full attention

    @property
    def kind(self) -> str:
        return "full" if self.sliding_window is None else f"sliding_{self.sliding_window}"


def group_layers(layer_names: Sequence[str], by_kind: bool = True) -> list[KVGroup]:
    """The registered attention layers' groups (group_by_window)."""
    return group_by_window({name: get_attention_layer(name).sliding_window for name in layer_names}, by_kind)


def group_by_window(windows: Mapping[str, int | None], by_kind: bool = True) -> list[KVGroup]:
    """Group 0: the full-attention layers (window None); then one group per window size. One group
    (all layers) when every layer is of one kind, when no layer has full attention (sliding blocks
    are published under full ones, so there is nothing to key them by), or with by_kind=False."""
    layer_names = list(windows)
    kinds = sorted({w for w in windows.values() if w is not None})
    if not by_kind or not kinds or None not in windows.values():
        return [KVGroup(tuple(layer_names), None)]  # every layer keeps every block, as one pool always did
    return [KVGroup(tuple(n for n in layer_names if windows[n] == w), w) for w in [None, *kinds]]


def blocks_per_sequence(group: KVGroup, max_model_len: int, block_size: int) -> int:
    """Blocks one sequence of max_model_len holds in this group between steps (decode steady state)."""
    full = -(-max_model_len // block_size)
    if group.sliding_window is None:
        return full
    return min(full, -(-(group.sliding_window - 1) // block_size) + 1)


def split_memory(budget_bytes: int, bytes_per_block: Sequence[int], per_sequence: Sequence[int],
                 min_blocks: Sequence[int]) -> list[int]:
    """Blocks per group (scratch included) for a budget: shares proportional to what one sequence
    needs of each group times its block's bytes, so every group runs out at the same number of
    sequences of max_model_len; never below a group's minimum (one request plus scratch)."""
    per_seq_bytes = sum(n * b for n, b in zip(per_sequence, bytes_per_block))
    sequences = budget_bytes / per_seq_bytes if per_seq_bytes else 0.0
    return [max(low, int(sequences * n) + 1) for n, low in zip(per_sequence, min_blocks)]


def blocks_per_group(groups: Sequence[KVGroup], bytes_per_block: Sequence[int], budget_bytes: int,
                     max_model_len: int, block_size: int, max_num_batched_tokens: int) -> list[int]:
    """Blocks per group (scratch included) for a memory budget: split_memory over what a sequence of
    max_model_len holds between steps, each group at least one request (a sliding group: its window
    plus a chunk of max_num_batched_tokens) plus scratch."""
    if len(groups) == 1:
        return [budget_bytes // bytes_per_block[0]]
    full = -(-max_model_len // block_size)
    per_sequence = [blocks_per_sequence(g, max_model_len, block_size) for g in groups]
    minimum = [full + 1] + [min(full, -(-(g.sliding_window - 1 + max_num_batched_tokens) // block_size) + 1) + 1
                            for g in groups[1:]]
    return split_memory(budget_bytes - sum(bytes_per_block), bytes_per_block, per_sequence, minimum)
