"""Engine on CUDA: graphs change nothing but speed.

Greedy output over a workload where requests arrive and finish at different steps (so the decode
batch crosses buckets and prefill chunks mix with decodes) is identical with graphs off, decode
graphs on, and decode + prefill graphs on, for Llama, Qwen3 and Gemma 3; a batch larger than the
largest decode bucket falls back (counted) and stays correct; 2,000 steps keep memory steady; a
Gemma 3 context longer than its sliding window matches transformers.
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.hf_helpers import random_hf_model
from tests.test_engine_generate import ARCHS, COMMON, save_arch_models

pytestmark = pytest.mark.gpu

BASE = dict(device="cuda", dtype="float32", block_size=16, max_model_len=128, max_num_seqs=8,
            max_num_batched_tokens=64, num_gpu_blocks=256, show_progress=False)
MODES = {
    "graphs_off": dict(cuda_graphs=False, prefill_graphs=False),
    "decode_graphs": dict(cuda_graphs=True, prefill_graphs=False),
    "decode_and_prefill_graphs": dict(cuda_graphs=True, prefill_graphs=True),
    "full": dict(cudagraph_mode="FULL"),            # decode graphs + full graphs of mixed steps
    "piecewise": dict(cudagraph_mode="PIECEWISE"),  # piecewise graphs for every step
}
# (arrival step, prompt, max_tokens): staggered arrivals, different lengths, different finishes.
WORKLOAD = [(3 * i, [1] + [(7 * i + 5 * j) % 90 + 3 for j in range(2 + (11 * i) % 40)], 3 + (13 * i) % 29)
            for i in range(14)]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return save_arch_models(tmp_path_factory, "gpu")


def _engine(path, **fields) -> LLM:
    torch._dynamo.reset()  # every LLM compiles its own model with its own backend instance
    return LLM(str(path), **{**BASE, **fields})


def _run_workload(llm: LLM, workload=WORKLOAD) -> dict[str, list[int]]:
    pending = sorted(enumerate(workload), key=lambda item: item[1][0])
    results: dict[str, list[int]] = {}
    step = 0
    while pending or llm.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            index, (_, prompt, max_tokens) = pending.pop(0)
            llm.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=str(index))
        for out in llm.step():
            if out.finished:
                results[out.request_id] = out.token_ids
        step += 1
    return results


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_output_is_identical_with_graphs_off_decode_graphs_and_prefill_graphs(model_dirs, arch):
    results, stats = {}, {}
    for mode, fields in MODES.items():
        with _engine(model_dirs[arch], **fields) as llm:
            results[mode] = _run_workload(llm)
            stats[mode] = llm.stats()
    assert len(results["graphs_off"]) == len(WORKLOAD)
    for index, (_, _, max_tokens) in enumerate(WORKLOAD):
        assert len(results["graphs_off"][str(index)]) == max_tokens
    for mode in MODES:
        assert results[mode] == results["graphs_off"], mode

    assert "full" not in stats["graphs_off"]["modes"] and stats["graphs_off"]["decode_graphs"] == 0
    for mode in ("decode_graphs", "decode_and_prefill_graphs"):
        s = stats[mode]
        assert s["modes"]["full"] > 0 and s["fallbacks"] == 0
        assert len(s["decode_graph_replays_by_size"]) >= 3, s["decode_graph_replays_by_size"]  # crossed buckets
    s = stats["decode_and_prefill_graphs"]
    assert s["modes"]["piecewise"] > 0 and "none" not in s["modes"]
    assert s["backend"]["replay_steps"] > 0 and s["backend"]["fallback_steps"] == 0
    assert s["backend"]["graphs_compiled"] == 1  # one trace for every token count
    s = stats["full"]
    assert s["cudagraph_mode"] == "FULL" and s["mixed_graphs"] > 0 and s["mixed_graph_replays"] > 0
    assert "none" not in s["modes"] and "piecewise" not in s["modes"] and s["fallbacks"] == 0
    s = stats["piecewise"]
    assert s["decode_graphs"] == 0 and set(s["modes"]) == {"piecewise"} and s["fallbacks"] == 0


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_full_mixed_graphs_equal_piecewise_with_chunked_prefill_and_prefix_hits(model_dirs, arch):
    """Prompts longer than the step budget (chunked over several mixed steps) sharing a long prefix
    (the second round hits the prefix cache), with float32 logprobs: FULL's mixed graphs give the
    PIECEWISE tokens and logprobs."""
    prefix = [1] + [(5 * j) % 80 + 3 for j in range(70)]
    prompts = [prefix + [(11 * i + j) % 90 + 3 for j in range(3 + 7 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    outs = {}
    for mode in ("PIECEWISE", "FULL", "NONE"):
        with _engine(model_dirs[arch], cudagraph_mode=mode, max_num_batched_tokens=48, max_model_len=128) as llm:
            first = llm.generate(prompts, params)
            second = llm.generate(prompts, params)
            stats = llm.stats()
        outs[mode] = first + second
        assert stats["prefix_cache"]["hit_tokens"] > 0
        if mode == "FULL":
            assert stats["mixed_graph_replays"] > 0 and "none" not in stats["modes"], stats["modes"]
    for mode in ("FULL", "NONE"):
        for got, ref in zip(outs[mode], outs["PIECEWISE"]):
            assert got.token_ids == ref.token_ids, mode
            for a, b in zip(got.logprobs, ref.logprobs):
                assert abs(a.logprob - b.logprob) < 1e-3, mode


def test_batch_larger_than_the_largest_decode_graph_falls_back_and_stays_correct(model_dirs):
    prompts = [[1] + [(5 * i + j) % 90 + 3 for j in range(6 + i)] for i in range(12)]
    # staggered lengths: the batch starts at 12 (over the largest graph) and shrinks into the buckets
    params = [SamplingParams(max_tokens=10 + 2 * i, ignore_eos=True) for i in range(12)]
    with _engine(model_dirs["llama"], max_num_seqs=12, cuda_graphs=False, prefill_graphs=False) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, params)]
    with _engine(model_dirs["llama"], max_num_seqs=12, decode_graph_sizes=(1, 2, 4, 8), prefill_graphs=False) as llm:
        got = [o.token_ids for o in llm.generate(prompts, params)]
        stats = llm.stats()
    assert got == expected
    assert stats["fallbacks"] > 0 and any("decode batch of 12" in r for r in stats["fallback_reasons"])
    assert stats["modes"]["full"] > 0  # the tail of the run (fewer than 8 left) still replays


def test_two_thousand_steps_keep_gpu_memory_steady(model_dirs):
    # Auto-sized pool (a small fraction, to leave the GPU to others); requests keep arriving.
    with _engine(model_dirs["qwen3"], num_gpu_blocks=None, kv_memory_fraction=0.05, prefill_graphs=True) as llm:
        assert llm.stats()["kv_blocks"] > 256
        allocated, reserved = [], []
        next_id = 0
        for step in range(2000):
            while len(llm.scheduler.running) + len(llm.scheduler.waiting) < 10:
                prompt = [1] + [(next_id * 3 + j) % 90 + 3 for j in range(3 + next_id % 50)]
                llm.add_request(prompt, SamplingParams(max_tokens=5 + next_id % 60, ignore_eos=True,
                                                       temperature=0.8 if next_id % 3 else 0.0,
                                                       top_p=0.9, seed=next_id))
                next_id += 1
            llm.step()
            if step >= 500 and step % 100 == 0:
                torch.cuda.synchronize()
                allocated.append(torch.cuda.memory_allocated())
                reserved.append(torch.cuda.memory_reserved())
        assert llm.num_steps == 2000 and next_id > 100
        assert max(allocated) - min(allocated) < 2**20, allocated
        assert max(reserved) - min(reserved) <= 32 * 2**20, reserved


def test_gemma_context_longer_than_the_sliding_window_matches_transformers(tmp_path):
    config_cls, kwargs = ARCHS["gemma3"]
    # no EOS (neither side stops early): every context grows past 100 tokens against a window of 16
    config = config_cls(**{**COMMON, "max_position_embeddings": 512, "eos_token_id": None},
                        **{**kwargs, "sliding_window": 16, "sliding_window_pattern": 2})
    hf = random_hf_model(config, seed=11)
    hf.save_pretrained(tmp_path)
    prompts = [[1] + [(3 * j) % 90 + 3 for j in range(70)], [1] + [(7 * j) % 90 + 3 for j in range(40)]]
    hf = hf.cuda()
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=40, do_sample=False,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device="cuda"))
            expected.append(ids[0, len(prompt):].tolist())
    with _engine(tmp_path, prefill_graphs=True, max_model_len=256) as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=40))
    assert [o.token_ids for o in outputs] == expected
    assert max(len(p) + len(o.token_ids) for p, o in zip(prompts, outputs)) > 100  # window is 16


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_an_engine_on_the_second_gpu_steps_correctly_while_the_first_is_current(model_dirs):
    """Triton launches on the current device: the engine makes its own current while it builds and
    steps, so a caller whose current device is cuda:0 gets cuda:1's engine right (graphs included)."""
    with _engine(model_dirs["gemma3"], prefill_graphs=True) as llm:
        expected = _run_workload(llm)
    torch.cuda.set_device(0)
    with _engine(model_dirs["gemma3"], prefill_graphs=True, device="cuda:1") as llm:
        assert _run_workload(llm) == expected
        assert torch.cuda.current_device() == 0  # the caller's device is left as it was
        assert llm.stats()["modes"]["full"] > 0
