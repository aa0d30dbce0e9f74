"""Sliding-window KV pool (engine.kv.groups) on CUDA: decode graphs and prefill graphs read the sliding
group's own block tables, whose entries out of the window point at the scratch block, and change
nothing: greedy output equals transformers' (uncached forward) with graphs, prefix caching, both
step loops and preemption, and equals the one-pool engine.
"""
from __future__ import annotations

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.kv.grouped_pool import GroupedBlockPool
from tests.hf_helpers import random_hf_model
from tests.test_sliding_window_kv import greedy_without_cache

pytestmark = pytest.mark.gpu

WINDOW = 16
CONFIG = dict(vocab_size=96, max_position_embeddings=512, initializer_range=0.5, pad_token_id=0, bos_token_id=1,
              eos_token_id=None, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
              sliding_window_pattern=3, final_logit_softcapping=30.0)
SHARED = [(5 * j) % 90 + 3 for j in range(48)]
PROMPTS = [[1] + [(3 * j) % 90 + 3 for j in range(70)], [1, *SHARED, 7, 8], [1] + [(7 * j) % 90 + 3 for j in range(20)],
           [1, *SHARED, 9, 10, 11, 12], [1, 4, 5]]
MAX_TOKENS = 40
BASE = dict(device="cuda", dtype="float32", block_size=16, max_model_len=256, max_num_seqs=8,
            max_num_batched_tokens=64, show_progress=False)
VARIANTS = {
    "graphs_prefix_async": dict(prefill_graphs=True),
    "graphs_no_prefix_sync": dict(prefill_graphs=True, enable_prefix_caching=False, async_scheduling=False),
    "graphs_preempting": dict(prefill_graphs=True, num_gpu_blocks=20),
    "eager_one_pool": dict(compile=False, cuda_graphs=False, hybrid_kv_cache=False),
}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    hf = random_hf_model(transformers.Gemma3TextConfig(**CONFIG), seed=5)
    path = tmp_path_factory.mktemp("gemma_window_gpu")
    hf.save_pretrained(path)
    hf = hf.cuda()
    return path, [greedy_without_cache(hf, p, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gemma_window_pool_with_graphs_matches_transformers(gemma, variant):
    path, expected = gemma
    torch._dynamo.reset()
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(path), **{**BASE, **VARIANTS[variant]}) as llm:
        first = [o.token_ids for o in llm.generate(PROMPTS, params)]
        again = [o.token_ids for o in llm.generate(PROMPTS[1:2], params)]  # hits the blocks of the first run
        stats = llm.stats()
        pool = llm.runtime.block_pool
        hybrid = VARIANTS[variant].get("hybrid_kv_cache", True)
        assert isinstance(pool, GroupedBlockPool) == hybrid
        if hybrid:
            assert [g["kind"] for g in stats["kv_groups"]] == ["full", f"sliding_{WINDOW}"]
            assert pool.sliding[0].released_blocks > 0
            assert pool.sliding[0].num_free_blocks == pool.sliding[0].num_usable_blocks
    assert first == expected and again == expected[1:2]
    if VARIANTS[variant].get("cuda_graphs", True):
        assert stats["modes"].get("full", 0) > 0 and stats["modes"].get("piecewise", 0) > 0
        assert stats["fallbacks"] == 0
    if variant == "graphs_preempting":
        assert stats["preemptions"] > 0
    if VARIANTS[variant].get("enable_prefix_caching", True) and variant != "graphs_preempting":
        assert stats["prefix_cache"]["hit_tokens"] > 0
