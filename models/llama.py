"""Llama 3.x: pre-norm blocks of attention and a SiLU-gated MLP, one rope for all layers."""
from __future__ import annotations

import torch
from torch import nn

from models.base import CausalLM, DecoderModel
from models.config import ModelConfig
from models.errors import UnsupportedConfigError
from models.layers import Attention, GatedMLP, RMSNorm
from models.parallel import TensorParallel


class LlamaDecoderLayer(nn.Module):
    branch_norm = None  # what this layer's returned delta still needs before the add: nothing

    def __init__(self, config: ModelConfig, layer_name: str, qk_norm: bool, tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.self_attn = Attention(config, layer_name, sliding_window=None, qk_norm=qk_norm, tp=tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.mlp = GatedMLP(config, tp)

    def forward(self, h: torch.Tensor, delta: torch.Tensor | None, delta_norm: RMSNorm | None,
                cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, what this layer adds to it): the add is left to the next norm
        (models.base.DecoderModel), which does both in one kernel; `delta`, `delta_norm`: the previous
        layer's, not yet added."""
        h, x = self.input_layernorm.add_and_norm(h, delta, delta_norm)
        h, x = self.post_attention_layernorm.add_and_norm(h, self.self_attn(x, cos, sin))
        return h, self.mlp(x)


class LlamaForCausalLM(CausalLM):
    name_stem = "llama_"
    qk_norm = False

    def build_decoder(self, config: ModelConfig) -> nn.Module:
        if config.sliding_window is not None:
            raise UnsupportedConfigError(
                f"{config.architecture} with sliding-window layers (use_sliding_window / layer_types) "
                "is not implemented; only Gemma3ForCausalLM has sliding layers here")
        layers = [LlamaDecoderLayer(config, self.layer_name(i), self.qk_norm, self.tp)
                  for i in range(config.num_layers)]
        norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        return DecoderModel(config, layers, norm, ropes=(config.rope,), layer_rope=[0] * config.num_layers,
                            tp=self.tp)
