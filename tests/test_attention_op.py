"""infer::attention: torch.library.opcheck (schema with the declared mutation of `out`, fake impl,
dispatch registrations) and the CPU implementation's numerics against plain torch, with and without
a sliding window / softcap, MHA and GQA, without a forward context and with a paged KV cache."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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
    with custom_ops.forward_context(meta, kv_caches={name: kv}):
        torch.library.opcheck(torch.ops.infer.attention.default, (*_inputs(4, heads, kv_heads), name))


def _plain_attention(q, k, v, q_pos, k_pos, window, softcap):
    """Plain torch, independent of custom_ops.reference: SDPA with an explicit causal / window mask,
    or (softcap, which SDPA has no hook for) the scores written out; K/V expanded to every q head."""
    group = q.shape[1] // k.shape[1]
    qh, kh, vh = (x.transpose(0, 1) for x in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
    distance = q_pos[:, None] - k_pos[None, :]
    visible = (distance >= 0) & (distance < window if window else True)
    if softcap is None:
        return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible, scale=16 ** -0.5).transpose(0, 1)
    scores = softcap * torch.tanh(qh @ kh.transpose(1, 2) * 16 ** -0.5 / softcap)
    return (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ vh).transpose(0, 1)


@pytest.mark.parametrize("heads,kv_heads,window,softcap", VARIANTS)
def test_op_without_context_matches_plain_torch(heads, kv_heads, window, softcap):
    name = _layer(f"plain.dense.{heads}.{kv_heads}.{window}.{softcap}", heads, kv_heads, window, softcap)
    q, k, v, out = _inputs(11, heads, kv_heads)
    torch.ops.infer.attention(q, k, v, out, name)
    pos = torch.arange(11)
    torch.testing.assert_close(out, _plain_attention(q, k, v, pos, pos, window, softcap))


@pytest.mark.parametrize("heads,kv_heads,window,softcap", VARIANTS)
def test_op_with_paged_cache_matches_plain_torch_over_the_whole_sequence(heads, kv_heads, window, softcap):
    """Sequence 0: 5 cached + 3 new tokens, sequence 1: 2 cached + 1 new, blocks out of order. The new
    rows equal plain attention over each whole sequence; the new K/V land in their slots."""
    name = _layer(f"plain.paged.{heads}.{kv_heads}.{window}.{softcap}", heads, kv_heads, window, softcap)
    block_size, tables, cached, new = 4, [[3, 1], [5]], [5, 2], [3, 1]
    kv = custom_ops.allocate_kv_cache(8, block_size, kv_heads, 16, torch.float32, "cpu")
    keys = [torch.randn(c + n, kv_heads, 16) for c, n in zip(cached, new)]
    values = [torch.randn(c + n, kv_heads, 16) for c, n in zip(cached, new)]
    for table, c, seq_k, seq_v in zip(tables, cached, keys, values):
        for pos in range(c):
            kv[0, table[pos // block_size], pos % block_size] = seq_k[pos]
            kv[1, table[pos // block_size], pos % block_size] = seq_v[pos]
    q = torch.randn(sum(new), heads, 16)
    k = torch.cat([seq_k[c:] for seq_k, c in zip(keys, cached)])
    v = torch.cat([seq_v[c:] for seq_v, c in zip(values, cached)])
    out = torch.full_like(q, float("nan"))
    with custom_ops.forward_context(build_metadata(block_size, tables, cached, new), kv_caches={name: kv}):
        torch.ops.infer.attention(q, k, v, out, name)
    start = 0
    for table, c, n, seq_k, seq_v in zip(tables, cached, new, keys, values):
        expected = _plain_attention(q[start:start + n], seq_k, seq_v, torch.arange(c, c + n),
                                    torch.arange(c + n), window, softcap)
        torch.testing.assert_close(out[start:start + n], expected)
        last = c + n - 1
        assert torch.equal(kv[0, table[last // block_size], last % block_size], seq_k[last])
        assert torch.equal(kv[1, table[last // block_size], last % block_size], seq_v[last])
        start += n
