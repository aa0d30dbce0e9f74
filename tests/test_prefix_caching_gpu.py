"""Prefix caching on CUDA with decode and prefill graphs: the cached prefix only makes a step's context
longer, so graphs change nothing. float32, so the outputs can be compared exactly (in bf16 a prefix
computed in another chunk rounds differently). The same workloads as the CPU tests, with the pool's
debug checks on."""
from __future__ import annotations

import pytest
import torch

from engine import LLM
from tests.test_engine_generate import ARCHS
from tests.test_prefix_caching_generate import ENGINE, model_dirs, run_workload  # noqa: F401 (fixture)

pytestmark = pytest.mark.gpu

GPU = dict(ENGINE, device="cuda", dtype="float32", show_progress=False)


@pytest.fixture(autouse=True)
def _debug_checks(monkeypatch):
    monkeypatch.setenv("INFER_GRAPHS_DEBUG_CHECKS", "1")


def _engine(path, **fields) -> LLM:
    torch._dynamo.reset()  # every LLM compiles its own model with its own backend instance
    return LLM(str(path), **{**GPU, **fields})


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_prefix_caching_with_decode_and_prefill_graphs_gives_the_outputs_of_no_caching(model_dirs, arch):
    with _engine(model_dirs[arch], enable_prefix_caching=False, cuda_graphs=False, prefill_graphs=False) as llm:
        expected, _ = run_workload(llm)
    with _engine(model_dirs[arch], cuda_graphs=True, prefill_graphs=True) as llm:
        got, hits = run_workload(llm)
        stats = llm.stats()
    assert got == expected
    assert hits == [0, 3 * 12, 16 + 20 + 28, 4 + 2 * 16, 2 * 16, 2 * 16]  # as on the CPU
    assert stats["modes"]["full"] > 0 and stats["modes"]["piecewise"] > 0 and stats["fallbacks"] == 0


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_prefix_caching_under_eviction_and_preemption_with_graphs(model_dirs, arch):
    small = dict(num_gpu_blocks=18)  # 17 usable blocks: one max_model_len request needs 16
    with _engine(model_dirs[arch], enable_prefix_caching=False, cuda_graphs=False, prefill_graphs=False, **small) as llm:
        expected, _ = run_workload(llm)
    with _engine(model_dirs[arch], cuda_graphs=True, prefill_graphs=True, **small) as llm:
        got, _ = run_workload(llm)
        stats = llm.stats()
    assert got == expected
    assert stats["prefix_cache"]["evicted_blocks"] > 0 and stats["prefix_cache"]["hit_tokens"] > 0
