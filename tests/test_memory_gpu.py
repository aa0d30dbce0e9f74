"""gpu_memory_utilization on a real GPU: the engine's KV pool grows to vLLM's share of the device and no
further, everything the engine holds included (weights, graphs, the pool), and a larger share buys more
blocks."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.test_engine_generate import save_arch_models

pytestmark = pytest.mark.gpu

BASE = dict(device="cuda", dtype="bfloat16", block_size=16, max_model_len=256, max_num_seqs=8,
            max_num_batched_tokens=64, show_progress=False)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_arch_models(tmp_path_factory, "memory")["llama"]


def _used_after_start(path, share: float) -> tuple[int, int, list[int]]:
    """(device bytes in use after start-up, the engine's KV blocks, greedy tokens of one prompt)."""
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    with LLM(str(path), gpu_memory_utilization=share, **BASE) as llm:
        free, total = torch.cuda.mem_get_info()
        tokens = llm.generate([[1, 5, 9, 13]], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
        return total - free, llm.stats()["kv_blocks"], tokens


def test_gpu_memory_utilization_caps_the_device_memory_the_engine_takes(llama_dir):
    total = torch.cuda.mem_get_info()[1]
    used_small, blocks_small, tokens_small = _used_after_start(llama_dir, 0.2)
    used_large, blocks_large, tokens_large = _used_after_start(llama_dir, 0.35)
    # the share bounds the whole device's use after start-up (the caching allocator rounds a little)
    assert used_small <= 0.2 * total + 256 * 2**20, (used_small / total)
    assert used_large <= 0.35 * total + 256 * 2**20, (used_large / total)
    # and is used: most of it goes to the pool, so the larger share holds more blocks in proportion
    assert used_small >= 0.15 * total and used_large >= 0.3 * total, (used_small / total, used_large / total)
    assert blocks_large > blocks_small * 1.5
    assert tokens_small == tokens_large
