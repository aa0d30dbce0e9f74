"""Per-layer attention constants, registered by layer name.

The op's signature carries only tensors and a layer name (so Dynamo sees one node per layer and
the graph stays free of Python constants that would specialize it); everything that is fixed for a
layer lives here. The KV cache does NOT: it belongs to an engine (two engines may run one model),
and reaches the op through the forward context (`forward_context(..., kv_caches={name: tensor})`).
An entry registered with an `owner` (the model's attention module) is removed when the owner is
garbage, so a dropped model leaves nothing behind in this registry.
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch


@dataclass
class AttentionLayer:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None  # key kp is visible to query qp iff qp - kp < window
    logit_softcap: float | None = None  # scores -> softcap * tanh(scores / softcap)
    # The per-head q/k RMSNorm's constants, for the op's calls that pass raw q / k and the norm weights
    qk_norm_eps: float = 1e-6
    qk_norm_unit_offset: bool = False  # Gemma's (1 + w) scaling

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


def register_attention_layer(name: str, layer: AttentionLayer, owner: object | None = None) -> None:
    """Register `layer` under `name`; with an `owner`, the entry goes when the owner is collected."""
    _layers[name] = layer
    if owner is not None:
        weakref.finalize(owner, _unregister, name, layer)


def _unregister(name: str, layer: AttentionLayer) -> None:
    if _layers.get(name) is layer:  # a later registration under the same name is not ours to drop
        del _layers[name]


def get_attention_layer(name: str) -> AttentionLayer:
    try:
        return _layers[name]
    except KeyError:
        raise KeyError(f"attention layer {name!r} is not registered") from None


def is_registered(name: str) -> bool:
    return name in _layers


def check_kv_cache(name: str, kv_cache: torch.Tensor) -> None:
    """Refuse a cache whose shape does not fit layer `name` (checked once, when an owner makes it)."""
    layer = get_attention_layer(name)
    expected = (2, layer.num_kv_heads, layer.head_dim)
    got = (kv_cache.shape[0], kv_cache.shape[3], kv_cache.shape[4]) if kv_cache.dim() == 5 else None
    if got != expected:
        raise ValueError(
            f"kv cache for layer {name!r} has shape {tuple(kv_cache.shape)}; expected "
            f"[2, num_blocks, block_size, {layer.num_kv_heads}, {layer.head_dim}]")
