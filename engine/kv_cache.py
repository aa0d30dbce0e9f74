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
"""
from __future__ import annotations

import torch

from custom_ops import allocate_kv_cache, check_kv_cache, get_attention_layer

CPU_KV_BYTES = 512 * 2**20  # default CPU pool: enough for tests and `make run`, small beside the weights


class KVCache:
    def __init__(self, layer_names: list[str], block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.layer_names = list(layer_names)
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.by_layer: dict[str, torch.Tensor] = {}
        self.num_blocks = 0
        layers = [get_attention_layer(n) for n in self.layer_names]
        per_token = sum(2 * layer.num_kv_heads * layer.head_dim for layer in layers)  # K and V
        self.bytes_per_block = per_token * self.block_size * self.dtype.itemsize

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The caches in layer order."""
        return list(self.by_layer.values())

    def blocks_for_memory(self, available_bytes: int) -> int:
        return max(0, int(available_bytes) // self.bytes_per_block)

    def allocate(self, num_blocks: int) -> None:
        """Allocate `num_blocks` blocks per layer (block 0 is scratch); replaces any old pool."""
        self.release()
        for name in self.layer_names:
            layer = get_attention_layer(name)
            tensor = allocate_kv_cache(num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim,
                                       self.dtype, self.device)
            check_kv_cache(name, tensor)
            self.by_layer[name] = tensor
        self.num_blocks = num_blocks

    def release(self) -> None:
        self.by_layer.clear()
        self.num_blocks = 0

    @property
    def pool_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.by_layer.values())
