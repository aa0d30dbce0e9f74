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

from models.base import CausalLM, DecoderModel
from models.config import SLIDING, ModelConfig
from models.layers import Attention, GatedMLP, RMSNorm
from models.parallel import TensorParallel


def _norm(config: ModelConfig) -> RMSNorm:
    return RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype, unit_offset=True)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_name: str, layer_type: str, tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = _norm(config)
        self.self_attn = Attention(
            config, layer_name, sliding_window=config.sliding_window if layer_type == SLIDING else None,
            qk_norm=True, unit_offset_norm=True, tp=tp)
        self.post_attention_layernorm = _norm(config)
        self.pre_feedforward_layernorm = _norm(config)
        self.mlp = GatedMLP(config, tp)
        self.post_feedforward_layernorm = _norm(config)

    @property
    def branch_norm(self) -> RMSNorm:
        """The norm this layer's returned delta (the MLP's output) still needs: the next layer's input
        norm (or the final norm) applies it, adds and normalizes in one kernel."""
        return self.post_feedforward_layernorm

    def forward(self, h: torch.Tensor, delta: torch.Tensor | None, delta_norm: RMSNorm | None,
                cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, the MLP's output before its post-norm), as models.llama's layer."""
        h, x = self.input_layernorm.add_and_norm(h, delta, delta_norm)
        h, x = self.pre_feedforward_layernorm.add_and_norm(h, self.self_attn(x, cos, sin),
                                                           self.post_attention_layernorm)
        return h, self.mlp(x)


class Gemma3ForCausalLM(CausalLM):
    name_stem = "gemma3_"

    def build_decoder(self, config: ModelConfig) -> nn.Module:
        layers = [Gemma3DecoderLayer(config, self.layer_name(i), kind, self.tp)
                  for i, kind in enumerate(config.layer_types)]
        # Table 0 for global layers, table 1 (the sliding layers' own base frequency) for sliding ones.
        return DecoderModel(
            config, layers, _norm(config), ropes=(config.rope, config.rope_local or config.rope),
            layer_rope=[1 if kind == SLIDING else 0 for kind in config.layer_types],
            embed_scale=config.hidden_size ** 0.5, tp=self.tp)
