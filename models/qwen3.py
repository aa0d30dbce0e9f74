"""Qwen3: Llama's block plus a per-head RMSNorm on q and k before rope (head_dim set independently
of hidden_size in its configs, which ModelConfig already reads)."""
from __future__ import annotations

from models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    name_stem = "qwen3_"
    qk_norm = True
