"""Engine lifecycle on CUDA: closed engines give their GPU memory back, and two engines over one
model each replay decode graphs that recorded their OWN KV pool."""
from __future__ import annotations

import gc

import pytest
import torch

import models
from engine import LLM, SamplingParams
from tests.test_engine_gpu import BASE, WORKLOAD, model_dirs  # noqa: F401 (fixture)

pytestmark = pytest.mark.gpu


def _allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def test_fifty_build_close_cycles_give_the_gpu_memory_back(model_dirs):
    """Compile, piecewise and decode graphs, KV pool: 50 engines built, used and closed, and the
    allocated memory ends within 16 MiB of where it started. One cycle runs before the baseline:
    it creates what belongs to the process, not to an engine (cuBLAS workspaces of the default and
    the capture stream, loaded Triton kernels, the decode split workspace)."""
    fields = dict(num_gpu_blocks=64, prefill_graphs=True, prefill_graph_sizes=(8, 64), decode_graph_sizes=(1, 4, 8))
    prompts = [[1] + [(5 * i + j) % 90 + 3 for j in range(3 + 7 * i)] for i in range(4)]

    def cycle() -> list[list[int]]:
        with LLM(str(model_dirs["llama"]), **{**BASE, **fields}) as llm:
            return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))]

    expected = cycle()
    start = _allocated()
    after = []
    for _ in range(50):
        assert cycle() == expected
        after.append(_allocated())
    assert max(after) - start < 16 * 2**20, [(a - start) / 2**20 for a in after]


def test_two_engines_over_one_model_replay_decode_graphs_of_their_own_kv_pool(model_dirs):
    """Decode graphs record KV addresses: each engine's must be its own pool (different sizes here),
    so stepping the two alternately gives exactly what each gives alone without graphs (each engine
    gets the same requests at once in both runs, so its batches are the same)."""
    path = model_dirs["qwen3"]
    half = len(WORKLOAD) // 2
    halves = (list(enumerate(WORKLOAD))[:half], list(enumerate(WORKLOAD))[half:])

    def add(llm: LLM, requests) -> None:
        for i, (_, prompt, max_tokens) in requests:
            llm.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=str(i))

    def drain(*engines: LLM) -> dict[str, list[int]]:
        got: dict[str, list[int]] = {}
        while any(llm.has_unfinished_requests() for llm in engines):
            for llm in engines:
                for out in llm.step():
                    if out.finished:
                        got[out.request_id] = out.token_ids
        return got

    pools = (64, 300)  # the same pool per half in both runs: the same preemptions, the same batches
    expected: dict[str, list[int]] = {}
    for requests, blocks in zip(halves, pools):
        with LLM(str(path), **{**BASE, "cuda_graphs": False, "num_gpu_blocks": blocks}) as reference:
            add(reference, requests)
            expected.update(drain(reference))
    model = models.from_pretrained(path, dtype=torch.float32, device="cuda")
    first = LLM(model, **{**BASE, "num_gpu_blocks": pools[0]})
    second = LLM(model, **{**BASE, "num_gpu_blocks": pools[1]})
    add(first, halves[0])
    add(second, halves[1])
    assert drain(first, second) == expected
    assert first.stats()["modes"]["full"] > 0 and second.stats()["modes"]["full"] > 0
    first.close()
    with second:  # the other engine's close takes nothing of this one's: its half again, same tokens
        add(second, halves[1])
        assert drain(second) == {str(i): expected[str(i)] for i, _ in halves[1]}


def test_close_frees_every_cuda_graph_the_engine_captured_without_the_caller_collecting(model_dirs):
    """NCCL cannot leave a communicator while a graph that captured one of its collectives lives
    (tensor parallelism's close would wait for it), and a graph's pool memory goes back only with the
    graph: after close() none of the engine's piecewise, decode or pool-keeping graphs is left, with no
    `gc.collect()` by the caller."""
    from compile_backend.pool import live_graphs
    gc.collect()
    before = live_graphs()
    llm = LLM(str(model_dirs["llama"]), **{**BASE, "num_gpu_blocks": 64, "prefill_graphs": True,
                                           "prefill_graph_sizes": (8, 64), "decode_graph_sizes": (1, 4)})
    llm.generate([[1, 5, 9, 13, 17, 21], [1, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    stats = llm.stats()
    assert stats["modes"]["full"] > 0 and stats["backend"]["piece_replays"] > 0
    assert live_graphs() > before + 2  # the pool's, two decode graphs, the pieces per prefill size
    llm.close()
    assert live_graphs() == before
