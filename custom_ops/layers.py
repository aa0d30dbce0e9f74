"""Per-layer attention constants, registered by layer name.

The op's signature carries only tensors and a layer name (so Dynamo sees one node per layer and
the graph stays free of Python constants that would specialize it); everything that is fixed for a
layer lives here. The engine binds each layer's KV cache here too, because the cache outlives a step.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionLayer:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None  # key kp is visible to query qp iff qp - kp < window
    logit_softcap: float | None = None  # scores -> softcap * tanh(scores / softcap)
    kv_cache: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")


_layers: dict[str, AttentionLayer] = {}
_prefix_counter = itertools.count()


def unique_prefix(stem: str) -> str:
    """A name prefix no other model instance in this process uses (layer names must not collide)."""
    return f"{stem}{next(_prefix_counter)}"


def register_attention_layer(name: str, layer: AttentionLayer) -> None:
    _layers[name] = layer


def get_attention_layer(name: str) -> AttentionLayer:
    try:
        return _layers[name]
    except KeyError:
        raise KeyError(f"attention layer {name!r} is not registered") from None


def bind_kv_cache(name: str, kv_cache: torch.Tensor | None) -> None:
    layer = get_attention_layer(name)
    if kv_cache is not None:
        expected = (2, layer.num_kv_heads, layer.head_dim)
        got = (kv_cache.shape[0], kv_cache.shape[3], kv_cache.shape[4]) if kv_cache.dim() == 5 else None
        if got != expected:
            raise ValueError(
                f"kv cache for layer {name!r} has shape {tuple(kv_cache.shape)}; expected "
                f"[2, num_blocks, block_size, {layer.num_kv_heads}, {layer.head_dim}]")
    layer.kv_cache = kv_cache
