"""Tensor parallelism on 2 GPUs: the same greedy tokens as one GPU, with every graph replayed.

The workload of test_engine_gpu (staggered arrivals, chunked prefills mixed with decodes, decode
batches crossing buckets) runs with decode and piecewise graphs on, float32, on one GPU and split
over two (NCCL, rank 1 a spawned process). The all-reduces sit inside the captured graphs, so every
rank must report its graphs captured and replayed, and no step of either rank may fall back.
"""
from __future__ import annotations

import pytest
import torch

from custom_ops import all_reduce
from tests.test_engine_gpu import _engine, _run_workload
from tests.test_engine_generate import ARCHS, save_arch_models

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

GRAPHS = dict(cuda_graphs=True, prefill_graphs=True)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return save_arch_models(tmp_path_factory, "tp_gpu")


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_two_gpus_give_the_same_greedy_tokens_with_decode_and_prefill_graphs(model_dirs, arch):
    one = _engine(model_dirs[arch], **GRAPHS)
    expected = _run_workload(one)
    single = one.stats()["backend"]
    one.close()
    # torch keeps a group's symmetric-memory store by the group's name for the process's life, so
    # only the first tensor-parallel engine of a process maps a buffer (custom_ops.all_reduce)
    symmetric = not all_reduce.mapped_group_names()
    llm = _engine(model_dirs[arch], **GRAPHS, tensor_parallel_size=2)
    try:
        assert _run_workload(llm) == expected
        stats = llm.stats()
        ranks = stats["ranks"]
        assert [r["device"] for r in ranks] == ["cuda:0", "cuda:1"]
        for rank in ranks:
            assert rank["modes"] == stats["modes"]
            assert rank["fallbacks"] == 0, rank["fallback_reasons"]
            assert rank["decode_graphs"] == len(llm.config.decode_graph_sizes)
            assert rank["decode_graph_replays"] == ranks[0]["decode_graph_replays"] > 0
            backend = rank["backend"]
            # the collectives add no trace and no split: the pieces are those of one GPU
            for key in ("graphs_compiled", "splitting_pieces", "compute_pieces"):
                assert backend[key] == single[key], key
            assert backend["piece_replays"] > 0 and backend["fallback_steps"] == 0
            if symmetric:  # decode-sized messages and a 64-token float32 prefill chunk: one-shot
                assert rank["all_reduce"].startswith("symmetric memory"), rank["all_reduce"]
                assert rank["all_reduce_calls"].get("one_shot", 0) > 0, rank["all_reduce_calls"]
            else:
                assert "earlier process group" in rank["all_reduce"] or "another rank" in rank["all_reduce"]
                assert rank["all_reduce_calls"] == {}
        processes = list(llm.tp.processes)
    finally:
        llm.close()
    assert all(not p.is_alive() for p in processes)
    # the group goes with the engine (its graphs first, which hold NCCL's communicator): the next
    # parametrization builds a new tensor-parallel engine in this process
    assert not torch.distributed.is_initialized()


def test_nccl_only_all_reduce_gives_the_same_tokens(model_dirs):
    path = model_dirs["llama"]
    one = _engine(path, **GRAPHS)
    expected = _run_workload(one)
    one.close()
    llm = _engine(path, **GRAPHS, tensor_parallel_size=2, disable_custom_all_reduce=True)
    try:
        assert _run_workload(llm) == expected
        for rank in llm.stats()["ranks"]:
            assert rank["all_reduce_calls"] == {}
            assert rank["all_reduce"] == "nccl: EngineConfig.disable_custom_all_reduce"
    finally:
        llm.close()


_KILL_SCENARIO = """
import os, signal, sys, time
import torch
from engine import LLM, SamplingParams
from engine.distributed.tp import TensorParallelError
from tests.test_engine_gpu import BASE
llm = LLM(sys.argv[1], **{**BASE, "cuda_graphs": True, "prefill_graphs": True, "tensor_parallel_size": 2})
for i in range(4):  # decode steps until the kill (max_model_len bounds them)
    llm.add_request([1, 5 + i, 9], SamplingParams(max_tokens=100, ignore_eos=True))
for _ in range(5):
    llm.step()
os.kill(llm.tp.processes[0].pid, signal.SIGKILL)
start = time.monotonic()
try:
    for _ in range(1000):
        llm.step()
    print("NO ERROR")
except TensorParallelError as exc:
    print(f"RAISED after {time.monotonic() - start:.1f} s: {exc}")
start = time.monotonic()
llm.close()
print(f"CLOSED in {time.monotonic() - start:.1f} s")
"""


def test_a_rank_killed_while_steps_are_in_flight_makes_the_engine_raise_naming_it(model_dirs):
    """The kill lands while rank 0 has steps queued (async scheduling keeps one in flight): a
    symmetric-memory all-reduce whose peer died spins with no timeout, so rank 0 must notice the
    death while it waits for the step (LLM raises TensorParallelError naming the rank) and release
    its own GPU's waits so that close() can free the graphs. In a child process with a deadline, so
    a regression fails this test instead of hanging the suite."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", _KILL_SCENARIO, str(model_dirs["llama"])], cwd=root,
                         capture_output=True, text=True, timeout=180,
                         env={**os.environ, "PYTHONPATH": str(root)})
    raised = re.search(r"RAISED after ([\d.]+) s: .*rank 1 \(pid \d+\) exited with code -9", run.stdout)
    closed = re.search(r"CLOSED in ([\d.]+) s", run.stdout)
    assert raised and closed, run.stdout + run.stderr[-3000:]
    assert float(raised.group(1)) < 30 and float(closed.group(1)) < 60
