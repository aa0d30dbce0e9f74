"""Shared pieces of the compile_backend tests (no tests here): tiny models and a counting run."""
from __future__ import annotations

import torch
import transformers
from torch import nn

import compile_backend
from custom_ops import AttentionLayer, register_attention_layer, unique_prefix

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024)


def hf_config(arch: str, **overrides: object) -> object:
    """A tiny random transformers config of each supported architecture."""
    values = {**TINY, **overrides}
    if arch == "llama":
        return transformers.LlamaConfig(**values)
    if arch == "qwen3":
        return transformers.Qwen3Config(**values)
    if arch == "gemma3":
        return transformers.Gemma3TextConfig(**values, sliding_window=4, sliding_window_pattern=2,
                                             final_logit_softcapping=10.0)
    raise ValueError(f"unknown arch {arch!r}")


ARCHS = ("gemma3", "llama", "qwen3")


class TinyLM(nn.Module):
    """Embedding, then per layer: norm, qkv, rope-like scaling by position, the attention op, o-proj,
    residual. Enough structure for the split (views across the boundary, a residual that skips the
    op, positions used in every piece) without depending on models/."""

    def __init__(self, hidden: int = 32, heads: int = 4, kv_heads: int = 2, head_dim: int = 8,
                 layers: int = 2, vocab: int = 100) -> None:
        super().__init__()
        prefix = unique_prefix("tinylm")
        self.names = [f"{prefix}.{i}" for i in range(layers)]
        for name in self.names:
            register_attention_layer(name, AttentionLayer(heads, kv_heads, head_dim, head_dim ** -0.5))
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        q, kv = heads * head_dim, kv_heads * head_dim
        self.embed = nn.Embedding(vocab, hidden)
        self.qkv = nn.ModuleList(nn.Linear(hidden, q + 2 * kv) for _ in range(layers))
        self.o = nn.ModuleList(nn.Linear(q, hidden) for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(layers + 1))
        self.register_buffer("scale", 1 + 0.1 * torch.randn(2048, q + 2 * kv))
        self.sizes = (q, kv, kv)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for i, name in enumerate(self.names):
            qkv = self.qkv[i](self.norms[i](x)) * self.scale[positions]
            q, k, v = qkv.split(self.sizes, dim=-1)
            q = q.view(-1, self.heads, self.head_dim)
            k = k.view(-1, self.kv_heads, self.head_dim)
            v = v.view(-1, self.kv_heads, self.head_dim)
            out = torch.empty_like(q)
            self.attend(q, k, v, out, name)
            x = x + self.o[i](out.view(q.shape[0], -1))
        return self.norms[-1](x)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, name: str) -> None:
        torch.ops.infer.attention(q, k, v, out, name)


def random_inputs(num_tokens: int, vocab: int, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (num_tokens,), device=device)
    positions = torch.arange(num_tokens, device=device)
    return ids, positions


def run_marked(compiled: object, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    compile_backend.mark_token_dim(ids, positions)
    return compiled(ids, positions)
