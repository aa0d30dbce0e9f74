"""KV cache tensors: how many blocks fit, allocating them, and handing them to attention.

The engine owns its cache: `by_layer` (layer name -> tensor) is what the model runner passes in every
step's forward context, so two engines over one model never share or clobber a cache, and a decode
graph records the tensors of the engine that captured it. `allocate` and `release` update `by_layer`
in place (the runner holds that very dict).

Sizing on CUDA (`blocks_for_memory`): the pool gets `kv_memory_fraction` of the device memory that
is free once the weights, the static buffers, the piecewise graphs (captured before the pool: they
do not record the KV address because attention runs between pieces) are resident, minus the
warm-up step's measured activation peak and the measured memory of the largest full-decode graph
(those graphs record the pool's address, so they are captured after it, into memory reserved here).
On CPU there is no free-memory probe: an explicit `num_gpu_blocks`, else `CPU_KV_BYTES` worth.
Both are counted in blocks of every layer (one pool's unit); with several KV groups (engine.kv.groups)
that budget is split per group, each group's block costing only its own layers' bytes.
"""
from __future__ import annotations

import torch

from custom_ops import allocate_kv_cache, check_kv_cache, get_attention_layer
from engine.kv.groups import group_layers

CPU_KV_BYTES = 512 * 2**20  # default CPU pool: enough for tests and `make run`, small beside the weights


class KVCache:
    """`groups` (engine.kv.groups): the layers by kind, each group with its own number of blocks; with
    by_kind=False, or a model of one kind, one group of every layer (as before groups existed)."""

    def __init__(self, layer_names: list[str], block_size: int, dtype: torch.dtype, device: torch.device,
                 by_kind: bool = True) -> None:
        self.layer_names = list(layer_names)
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.by_layer: dict[str, torch.Tensor] = {}
        self.num_blocks_by_group: list[int] = []
        self.groups = group_layers(self.layer_names, by_kind)

        def bytes_per_block(names) -> int:
            layers = [get_attention_layer(n) for n in names]
            per_token = sum(2 * layer.num_kv_heads * layer.head_dim for layer in layers)  # K and V
            return per_token * self.block_size * self.dtype.itemsize

        self.bytes_per_block = bytes_per_block(self.layer_names)  # a block of every layer: one pool's unit
        self.group_bytes_per_block = [bytes_per_block(g.layer_names) for g in self.groups]

    @property
    def num_blocks(self) -> int:
        """Blocks of group 0 (the full-attention layers; every layer with one group)."""
        return self.num_blocks_by_group[0] if self.num_blocks_by_group else 0

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The caches in layer order."""
        return [self.by_layer[name] for name in self.layer_names if name in self.by_layer]

    def blocks_for_memory(self, available_bytes: int) -> int:
        """Blocks of every layer (the one-pool unit) that fit; engine.kv.groups splits them per group."""
        return max(0, int(available_bytes) // self.bytes_per_block)

    def allocate(self, num_blocks: int | list[int]) -> None:
        """Allocate `num_blocks` blocks (one int: for every group; a list: per group) per layer, block 0
        of each the scratch block; replaces any old pool."""
        self.release()
        blocks = [num_blocks] * len(self.groups) if isinstance(num_blocks, int) else list(num_blocks)
        if len(blocks) != len(self.groups):
            raise ValueError(f"KVCache.allocate got {len(blocks)} block counts for {len(self.groups)} KV groups")
        for group, n in zip(self.groups, blocks):
            for name in group.layer_names:
                layer = get_attention_layer(name)
                tensor = allocate_kv_cache(n, self.block_size, layer.num_kv_heads, layer.head_dim,
                                           self.dtype, self.device)
                check_kv_cache(name, tensor)
                self.by_layer[name] = tensor
        self.num_blocks_by_group = blocks

    def release(self) -> None:
        self.by_layer.clear()
        self.num_blocks_by_group = []

    @property
    def pool_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.by_layer.values())
