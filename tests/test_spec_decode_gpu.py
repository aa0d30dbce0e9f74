"""Speculative decoding on CUDA: verify steps replay full graphs and change nothing.

Greedy output over the staggered workload of tests/test_engine_gpu.py is identical with and without
speculation (float32, three architectures), under the default graph mode (decode graphs, piecewise
graphs for prefills, verify graphs with a decode row per token, mixed-step graphs for larger verify
steps) and under FULL; every verify step within the captured sizes replays a graph (no verify
fallback), and the steps with proposals are fewer. A draft model beside the target replays its own
decode graphs.
"""
from __future__ import annotations

import pytest

from tests.spec_helpers import replay
from tests.test_engine_gpu import WORKLOAD, _engine, _run_workload
from tests.test_engine_generate import ARCHS, save_arch_models

pytestmark = pytest.mark.gpu

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return save_arch_models(tmp_path_factory, "spec_gpu")


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_identical_and_verify_steps_replay_graphs(model_dirs, arch):
    with _engine(model_dirs[arch]) as llm:
        expected = _run_workload(llm)
        plain_steps = llm.stats()["steps"]
    prompts = {tuple(p): None for _, p, _ in WORKLOAD}
    for mode in ("FULL_AND_PIECEWISE", "FULL"):
        with _engine(model_dirs[arch], cudagraph_mode=mode, speculative_config=SPEC) as llm:
            # the workload's own continuation as proposals, a fifth of them wrong
            continuations = {}
            for index, (_, prompt, _) in enumerate(WORKLOAD):
                continuations[tuple(prompt)] = list(prompt) + expected[str(index)]
            assert len(continuations) == len(prompts)
            replay(llm, continuations, wrong=0.2)
            got = _run_workload(llm)
            stats = llm.stats()
        assert got == expected, mode
        spec = stats["spec_decode"]
        assert spec["accepted_tokens"] > 0 and spec["verify_graph_fallbacks"] == 0, spec
        assert stats["verify_graph_replays"] > 0 and "none" not in stats["modes"], stats["modes"]
        assert stats["mixed_graph_replays"] > 0  # verify steps of more than 8 tokens
        assert stats["steps"] < plain_steps


def test_one_request_at_a_time_verifies_under_its_own_verify_graph(model_dirs):
    """max_num_seqs 1: each verify step of 1 + 4 tokens replays the verify graph of exactly 5 decode
    rows (no mixed-step graph, none padded), and the tokens are those of decoding without speculation."""
    path = model_dirs["llama"]
    with _engine(path, max_num_seqs=1) as llm:
        expected = _run_workload(llm)
    with _engine(path, max_num_seqs=1, speculative_config=SPEC) as llm:
        continuations = {tuple(p): list(p) + expected[str(i)] for i, (_, p, _) in enumerate(WORKLOAD)}
        replay(llm, continuations, wrong=0.2)
        got = _run_workload(llm)
        stats = llm.stats()
        by_size = dict(llm.runtime.runner.verify_graphs.replays_by_size)
    assert got == expected
    assert stats["spec_decode"]["accepted_tokens"] > 0 and stats["spec_decode"]["verify_graph_fallbacks"] == 0
    assert set(by_size) == {5} and by_size[5] > 0, by_size
    assert stats["mixed_graph_replays"] == 0


def test_prompt_lookup_greedy_identical(model_dirs):
    """The real proposer on prompts that repeat themselves: the same tokens as without it."""
    path = model_dirs["llama"]
    with _engine(path) as llm:
        expected = _run_workload(llm)
    with _engine(path, speculative_config=SPEC) as llm:
        assert _run_workload(llm) == expected
        assert llm.stats()["spec_decode"]["verify_chunks"] > 0


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_draft_model_greedy_identical_and_its_steps_replay_graphs(model_dirs, arch):
    """A draft model (the target itself: float32, so it agrees with the verify step but where logits
    tie) beside the target under the default graph mode: the same tokens as without speculation, every
    draft decode step a decode-graph replay, no verify or draft step without its graph."""
    path = model_dirs[arch]
    with _engine(path) as llm:
        expected = _run_workload(llm)
        plain_steps = llm.stats()["steps"]
    with _engine(path, speculative_config={"model": str(path), "num_speculative_tokens": 4}) as llm:
        got = _run_workload(llm)
        stats = llm.stats()
    assert got == expected
    spec = stats["spec_decode"]
    assert spec["acceptance_rate"] > 0.9 and stats["steps"] < plain_steps, spec
    assert spec["verify_graph_fallbacks"] == 0 and spec["draft_graph_fallbacks"] == 0, spec
    assert spec["draft_modes"].get("full", 0) > 0 and "none" not in spec["draft_modes"], spec
