"""Gemma 3 (text): what differs from Llama.

- Sliding-window and global layers interleave (config.layer_types); each kind has its own rope base.
- Four (1 + w) norms per block (before and after attention, before and after the MLP), and (1 + w)
  q/k norms; gelu-tanh MLP.
- Embeddings are scaled by sqrt(hidden_size), rounded to the model dtype first as transformers does.
- Attention scale query_pre_attn_scalar ** -0.5; optional attention and final logit softcaps (the
  attention softcap goes to the op's layer registry, the final one to compute_logits).
"""
from __future__ import annotations

import torch
from torch import nn

from models.base import CausalLM
from models.config import SLIDING, ModelConfig
from models.layers import Attention, Embedding, GatedMLP, RMSNorm, RotaryEmbedding


def _norm(config: ModelConfig) -> RMSNorm:
    return RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype, unit_offset=True)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_name: str, layer_type: str) -> None:
        super().__init__()
        self.is_sliding = layer_type == SLIDING
        self.input_layernorm = _norm(config)
        self.self_attn = Attention(
            config, layer_name, sliding_window=config.sliding_window if self.is_sliding else None,
            qk_norm=True, unit_offset_norm=True)
        self.post_attention_layernorm = _norm(config)
        self.pre_feedforward_layernorm = _norm(config)
        self.mlp = GatedMLP(config)
        self.post_feedforward_layernorm = _norm(config)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3TextModel(nn.Module):
    def __init__(self, config: ModelConfig, layer_names: list[str]) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, config.dtype)
        # transformers multiplies by sqrt(hidden) rounded to the weight dtype; a buffer (not a Python
        # float) keeps that rounding when the model is cast with .to(dtype).
        self.register_buffer(
            "embed_scale", torch.tensor(config.hidden_size ** 0.5, dtype=config.dtype), persistent=False)
        self.rotary_global = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)
        local = config.rope_local or config.rope
        self.rotary_local = RotaryEmbedding(local, config.head_dim, config.max_position_embeddings)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, name, kind) for name, kind in zip(layer_names, config.layer_types))
        self.norm = _norm(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids) * self.embed_scale.to(self.embed_tokens.weight.dtype)
        # Both tables are gathered once per step; the layer type is static, so the choice below is
        # resolved at trace time and leaves no branch in the graph.
        global_cs, local_cs = self.rotary_global(positions, h.dtype), self.rotary_local(positions, h.dtype)
        for layer in self.layers:
            cos, sin = local_cs if layer.is_sliding else global_cs
            h = layer(h, cos, sin)
        return self.norm(h)


class Gemma3ForCausalLM(CausalLM):
    name_stem = "gemma3_"

    def build_decoder(self, config: ModelConfig) -> nn.Module:
        return Gemma3TextModel(config, [self.layer_name(i) for i in range(config.num_layers)])
