"""torch.library.opcheck on infer::attention: schema (declared mutation of `out`), fake impl, and
dispatch registrations, with and without a sliding window / softcap, MHA and GQA, and under a
forward context with a paged KV cache."""
from __future__ import annotations

import pytest
import torch

import custom_ops
from custom_ops import AttentionLayer, register_attention_layer
from tests.paged_helpers import build_metadata

# (num_heads, num_kv_heads, sliding_window, softcap)
VARIANTS = [(4, 4, None, None), (4, 2, None, None), (4, 1, 3, None), (2, 2, None, 7.5), (6, 2, 5, 20.0)]


def _layer(name: str, heads: int, kv_heads: int, window: int | None, softcap: float | None) -> str:
    register_attention_layer(name, AttentionLayer(
        num_heads=heads, num_kv_heads=kv_heads, head_dim=16, scale=16 ** -0.5,
        sliding_window=window, logit_softcap=softcap))
    return name


def _inputs(tokens: int, heads: int, kv_heads: int) -> tuple[torch.Tensor, ...]:
    q = torch.randn(tokens, heads, 16)
    k = torch.randn(tokens, kv_heads, 16)
    v = torch.randn(tokens, kv_heads, 16)
    return q, k, v, torch.empty_like(q)


@pytest.mark.parametrize("heads,kv_heads,window,softcap", VARIANTS)
def test_opcheck_without_forward_context(heads, kv_heads, window, softcap):
    name = _layer(f"opcheck.dense.{heads}.{kv_heads}.{window}.{softcap}", heads, kv_heads, window, softcap)
    for tokens in (1, 9):
        torch.library.opcheck(torch.ops.infer.attention.default, (*_inputs(tokens, heads, kv_heads), name))


@pytest.mark.parametrize("heads,kv_heads,window,softcap", VARIANTS)
def test_opcheck_with_paged_cache(heads, kv_heads, window, softcap):
    """Two sequences, one with 5 cached tokens and 3 new, one with 2 cached and 1 new."""
    name = _layer(f"opcheck.paged.{heads}.{kv_heads}.{window}.{softcap}", heads, kv_heads, window, softcap)
    block_size = 4
    meta = build_metadata(block_size, [[3, 1], [5]], cached_lens=[5, 2], new_lens=[3, 1])
    kv = custom_ops.allocate_kv_cache(8, block_size, kv_heads, 16, torch.float32, "cpu")
    kv.normal_()  # the cached prefix: arbitrary but fixed keys and values
    custom_ops.bind_kv_cache(name, kv)
    try:
        with custom_ops.forward_context(meta):
            torch.library.opcheck(torch.ops.infer.attention.default, (*_inputs(4, heads, kv_heads), name))
    finally:
        custom_ops.bind_kv_cache(name, None)
