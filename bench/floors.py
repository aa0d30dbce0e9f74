"""The floors every table row is divided by: pure arithmetic over a model's sizes and the ceilings.

Decode reads every weight once and, per sequence, the K/V of every cached token it attends to (a
sliding layer only its window). Prefill of T tokens is bound by the larger of one pass over the
weights and its matmul FLOPs, 2 * (non-embedding parameters) * T plus the last token's logits
(attention FLOPs are left out, as the issue's formula does: at 2048 tokens they would add 6% for
Llama 3.2 3B and 8% for Qwen3 4B, so the floor is that much optimistic there).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayer:
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None


@dataclass(frozen=True)
class ModelCost:
    """What the floors need to know about a model."""

    weight_bytes: int          # every parameter once (a tied embedding counts once)
    matmul_params: int         # parameters of the per-token matmuls (all but the embedding table)
    logits_params: int         # hidden * vocab: the logits matmul, for the sampled tokens only
    kv_layers: tuple[KVLayer, ...]
    dtype_bytes: int = 2

    def kv_bytes_read(self, context_len: int) -> int:
        """K and V bytes one sequence reads in one step attending to `context_len` tokens."""
        total = 0
        for layer in self.kv_layers:
            tokens = context_len if layer.sliding_window is None else min(context_len, layer.sliding_window)
            total += 2 * layer.num_kv_heads * layer.head_dim * tokens * self.dtype_bytes
        return total

    def kv_bytes_per_token(self) -> int:
        """K and V bytes one cached token occupies over all layers (the pool's cost of a token)."""
        return sum(2 * l.num_kv_heads * l.head_dim * self.dtype_bytes for l in self.kv_layers)


def decode_bytes(cost: ModelCost, batch_size: int, context_len: int) -> int:
    """Bytes one decode step must move: the weights once, each sequence's attended K/V."""
    return cost.weight_bytes + batch_size * cost.kv_bytes_read(context_len)


def decode_floor_ms(cost: ModelCost, batch_size: int, context_len: int, copy_bytes_per_s: float) -> float:
    return decode_bytes(cost, batch_size, context_len) / copy_bytes_per_s * 1e3


def prefill_flops(cost: ModelCost, num_tokens: int) -> float:
    return 2.0 * cost.matmul_params * num_tokens + 2.0 * cost.logits_params


def prefill_floor_ms(cost: ModelCost, num_tokens: int, copy_bytes_per_s: float,
                     matmul_flops_per_s: float) -> float:
    """max(weights / bandwidth, FLOPs / matmul rate)."""
    memory_ms = cost.weight_bytes / copy_bytes_per_s * 1e3
    compute_ms = prefill_flops(cost, num_tokens) / matmul_flops_per_s * 1e3
    return max(memory_ms, compute_ms)


def model_cost(model: torch.nn.Module) -> ModelCost:
    """The ModelCost of one of our models (models.CausalLM), from its parameters and attention layers."""
    from custom_ops import get_attention_layer
    seen: set[int] = set()
    weight_bytes = 0
    embed = model.model.embed_tokens.weight
    embed_params = embed.numel()
    total_params = 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        weight_bytes += p.numel() * p.element_size()
        total_params += p.numel()
    layers = []
    for name in model.attention_layer_names:
        layer = get_attention_layer(name)
        layers.append(KVLayer(layer.num_kv_heads, layer.head_dim, layer.sliding_window))
    cfg = model.config
    return ModelCost(
        weight_bytes=weight_bytes,
        # An untied lm_head is a parameter too, but it only multiplies the sampled tokens: count it
        # with the logits, not per token.
        matmul_params=total_params - embed_params - (0 if cfg.tie_word_embeddings else embed_params),
        logits_params=cfg.hidden_size * cfg.vocab_size,
        kv_layers=tuple(layers),
        dtype_bytes=embed.element_size(),
    )
