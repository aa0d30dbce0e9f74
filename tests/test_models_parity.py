"""Parity with transformers on tiny random configs: prefill logits, greedy generation, paged decode.

Each case builds a transformers model, saves it with save_pretrained, and loads OUR model from that
directory (so loading is under test too); the reference is always transformers, never ourselves.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

import models
from tests.hf_helpers import random_hf_model
from tests.paged_helpers import paged_greedy_generate

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, max_position_embeddings=128, initializer_range=0.5,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)

CASES = {
    # GQA, untied, Llama 3.1 rope scaling with a short original context so positions here are affected
    "llama_gqa_untied_llama3rope": (transformers.LlamaConfig, dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=16))),
    # MHA, tied, biases on attention and MLP
    "llama_mha_tied_bias": (transformers.LlamaConfig, dict(
        hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=3, tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    # GQA, untied, head_dim independent of hidden_size (4 * 24 != 64)
    "qwen3_gqa_untied": (transformers.Qwen3Config, dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, tie_word_embeddings=False)),
    "qwen3_mha_tied": (transformers.Qwen3Config, dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)),
    # GQA, tied, window 4 << sequence, final softcap, interleave from sliding_window_pattern.
    # (No attention softcap: transformers' Gemma 3 ignores attn_logit_softcapping, so there is no
    # reference for it; tests/test_attention_op.py covers the op's softcap.)
    "gemma3_gqa_tied_softcap": (transformers.Gemma3TextConfig, dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
        sliding_window_pattern=2, final_logit_softcapping=20.0,
        tie_word_embeddings=True)),
    # MHA, untied, explicit layer_types, own local/global rope bases, linear scaling on global layers
    "gemma3_mha_untied_layer_types": (transformers.Gemma3TextConfig, dict(
        hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=5,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        rope_parameters={"full_attention": dict(rope_type="linear", factor=2.0, rope_theta=20000.0),
                         "sliding_attention": dict(rope_type="default", rope_theta=100.0)},
        tie_word_embeddings=False)),
}


def _hf_model(case: str) -> transformers.PreTrainedModel:
    config_cls, kwargs = CASES[case]
    return random_hf_model(config_cls(**COMMON, **kwargs), seed=1234)


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory) -> tuple[transformers.PreTrainedModel, models.CausalLM]:
    hf = _hf_model(request.param)
    path: Path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ours = models.from_pretrained(path, dtype=torch.float32)
    return hf, ours


def _prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=g).tolist()


@torch.no_grad()
def test_prefill_logits_match_transformers(pair):
    hf, ours = pair
    ids = torch.tensor(_prompt(19, 0))
    expected = hf(ids[None]).logits[0]
    got = ours.compute_logits(ours(ids, torch.arange(len(ids))))
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@torch.no_grad()
def test_logits_written_into_a_buffer_are_the_same_bits(pair):
    """compute_logits(out=) (the decode graphs' static logits, no copy pass) returns that buffer,
    holding exactly what the plain call returns (the Gemma case has a final softcap)."""
    _, ours = pair
    hidden = ours(torch.tensor(_prompt(7, 3)), torch.arange(7))
    expected = ours.compute_logits(hidden)
    buffer = torch.full((9, VOCAB), float("nan"))
    got = ours.compute_logits(hidden, out=buffer[:7])
    assert got.data_ptr() == buffer.data_ptr()
    assert torch.equal(got, expected) and buffer[7:].isnan().all()
    with pytest.raises(ValueError, match="compute_logits out"):
        ours.compute_logits(hidden, out=buffer[:6])


@torch.no_grad()
def test_32_greedy_tokens_match_transformers_generate(pair):
    hf, ours = pair
    prompts = [_prompt(11, 1), _prompt(6, 2)]
    generated, _ = paged_greedy_generate(ours, prompts, max_new_tokens=32, block_size=4)
    for prompt, tokens in zip(prompts, generated):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
        expected = out[0, len(prompt):].tolist()
        assert len(expected) == 32
        assert tokens == expected


@torch.no_grad()
@pytest.mark.parametrize("prefill_chunk", [None, 1, 5])
def test_paged_decode_logits_equal_full_prefill(pair, prefill_chunk):
    """Prefill a prefix (whole, token by token, or in chunks of 5) and decode the rest one token at a
    time through the paged cache (block size 4, scrambled block tables, two sequences batched): every
    position's logits equal those of one cache-free forward over the whole sequence, and those of
    transformers over the whole sequence."""
    hf, ours = pair
    sequences = [_prompt(23, 3), _prompt(14, 4)]
    prefixes = [s[:9] for s in sequences]
    # Teacher-forced: feed the known continuation instead of argmax so every position is compared.
    from tests.paged_helpers import PagedCache, paged_step
    cache = PagedCache(ours, num_blocks=64, block_size=4, seed=7)
    try:
        tables: list[list[int]] = [[], []]
        cached = [0, 0]
        got: list[list[torch.Tensor]] = [[], []]
        chunk = prefill_chunk or 9
        while cached[0] < 9:
            step = [p[c:c + chunk] for p, c in zip(prefixes, cached)]
            out = paged_step(ours, cache, tables, cached, step)
            for i, part in enumerate(out.split([len(s) for s in step])):
                got[i].append(part)
                cached[i] += len(step[i])
        while any(c < len(s) for c, s in zip(cached, sequences)):
            step = [s[c:c + 1] for s, c in zip(sequences, cached)]  # a finished sequence sends nothing
            out = paged_step(ours, cache, tables, cached, step)
            for i, part in enumerate(out.split([len(s) for s in step])):
                got[i].append(part)
                cached[i] += len(step[i])
    finally:
        cache.release()
    for seq, parts in zip(sequences, got):
        ids = torch.tensor(seq)
        full = ours.compute_logits(ours(ids, torch.arange(len(seq))))
        torch.testing.assert_close(torch.cat(parts), full, atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.cat(parts), hf(ids[None]).logits[0], atol=1e-4, rtol=0)
        assert any(len(t) > 1 for t in tables)  # sequences did cross block boundaries
