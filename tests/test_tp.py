"""Tensor parallelism on the CPU: 2 ranks over gloo give the same greedy tokens as one rank.

Each architecture is a tiny random float32 transformers model saved with save_pretrained; the TP
engine (rank 0 here, rank 1 a spawned process) loads its shards from that directory. The configs
cover the three ways a weight is split: KV heads split (2 over 2 ranks) and replicated (1 KV head on
2 ranks), a vocabulary that 2 does not divide (the last shard is padded), and biases on the
row-parallel o_proj (added once, after the all-reduce). The engine's token budget and KV pool are so
small that prefills are chunked and requests are preempted and recomputed. Spawning costs seconds
on a small machine, so each architecture builds one TP engine: Llama and Gemma 3 with spawned ranks
(Llama compiled), Qwen3 under torchrun (its processes are the ranks).
"""
from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
import transformers

from engine import LLM, ConfigError, SamplingParams
from engine.distributed.tp import TensorParallelError
from tests.hf_helpers import random_hf_model

COMMON = dict(max_position_embeddings=128, initializer_range=0.5, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, hidden_size=64, intermediate_size=96, num_attention_heads=4)
ARCHS = {
    # one KV head: both ranks keep it (replicated); a vocabulary 2 does not divide; o_proj bias
    "llama": (transformers.LlamaConfig, dict(vocab_size=97, num_hidden_layers=2, num_key_value_heads=1,
                                             attention_bias=True)),
    "qwen3": (transformers.Qwen3Config, dict(vocab_size=96, num_hidden_layers=2, num_key_value_heads=2,
                                             head_dim=16, tie_word_embeddings=False)),
    "gemma3": (transformers.Gemma3TextConfig, dict(vocab_size=96, num_hidden_layers=3, num_key_value_heads=2,
                                                   head_dim=16, query_pre_attn_scalar=16, sliding_window=6,
                                                   sliding_window_pattern=2, final_logit_softcapping=30.0)),
}
PROMPTS = [[1, 5, 9, 13], [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57],
           [1, 7], [1, 60, 61, 62, 63, 64, 65, 66, 67]]
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
# 8-token budget: the longer prompts are chunked; 11 usable blocks of 4 tokens cannot hold all four
# requests as they grow, so some are preempted.
SMALL = dict(device="cpu", block_size=4, max_model_len=32, max_num_seqs=4, max_num_batched_tokens=8,
             num_gpu_blocks=12)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, str]:
    out = {}
    for arch, (config_cls, kwargs) in ARCHS.items():
        path = tmp_path_factory.mktemp(arch)
        random_hf_model(config_cls(**COMMON, **kwargs), seed=11).save_pretrained(path)
        out[arch] = str(path)
    return out


LOGPROBS = SamplingParams(max_tokens=4, logprobs=3, ignore_eos=True)


def _one_rank(path: str, logprobs: list | None = None) -> list[list[int]]:
    """One rank's greedy tokens for PROMPTS; `logprobs`: filled with its LOGPROBS outputs of PROMPTS[0]."""
    one = LLM(path, **SMALL)
    try:
        expected = [o.token_ids for o in one.generate(PROMPTS, PARAMS)]
        assert one.stats()["preemptions"] > 0
        if logprobs is not None:
            logprobs += one.generate(PROMPTS[0], LOGPROBS)[0].logprobs
        return expected
    finally:
        one.close()


def _check_rank_stats(stats: dict) -> None:
    ranks = stats["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["modes"] == ranks[1]["modes"] == stats["modes"]  # every rank ran every step alike
    # the same pool on every rank: num_gpu_blocks for one KV group; with a pool per layer kind
    # (Gemma 3, engine.kv.groups) the same budget split alike, the full group getting at least as many
    assert ranks[0]["kv_blocks_by_group"] == ranks[1]["kv_blocks_by_group"] == stats["kv_blocks_by_group"]
    assert ranks[0]["kv_blocks"] == ranks[1]["kv_blocks"] >= SMALL["num_gpu_blocks"]
    assert len(stats["kv_blocks_by_group"]) > 1 or stats["kv_blocks"] == SMALL["num_gpu_blocks"]
    # ranks on one host take the step header from shared memory, not a gloo broadcast
    assert [r["step_headers"] for r in ranks] == [os.environ.get("INFER_GRAPHS_TP_HEADERS", "shared_memory")] * 2


def test_two_spawned_ranks_generate_the_same_greedy_tokens_as_one_compiled_llama(saved):
    logprobs = []
    expected = _one_rank(saved["llama"], logprobs)
    torch._dynamo.reset()
    # compiled: the all-reduces must stay inside the pieces (the graph splits only at attention)
    llm = LLM(saved["llama"], **SMALL, tensor_parallel_size=2, compile=True, piece_compiler="eager")
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
        # rank 0 samples from the gathered vocabulary: its log-probabilities are one rank's
        got = llm.generate(PROMPTS[0], LOGPROBS)[0].logprobs
        assert [(g.token_id, [t for t, _ in g.top]) for g in got] == [(w.token_id, [t for t, _ in w.top]) for w in logprobs]
        assert [g.logprob for g in got] == pytest.approx([w.logprob for w in logprobs], abs=1e-4)
        stats = llm.stats()
        assert stats["preemptions"] > 0
        _check_rank_stats(stats)
        num_layers = ARCHS["llama"][1]["num_hidden_layers"]
        for rank in stats["ranks"]:
            assert rank["backend"]["graphs_compiled"] == 1
            assert rank["backend"]["splitting_pieces"] == num_layers
            assert rank["backend"]["compute_pieces"] == num_layers + 1
        processes = list(llm.tp.processes)
        compiled = weakref.ref(llm.runtime.backend.graphs[0])
    finally:
        llm.close()
    assert processes and all(not p.is_alive() for p in processes)
    assert not torch.distributed.is_initialized()  # the next engine of this process starts its own group
    # Dynamo keeps what the backend returned for as long as the guards of a tensor-parallel trace
    # live (the process): the compiled graph must not go with it, or its CUDA graphs would outlive
    # the engine, and NCCL's communicator cannot be left while a graph that captured it lives.
    gc.collect()
    assert compiled() is None


def test_step_headers_over_gloo_as_across_hosts_give_the_same_tokens(saved, monkeypatch):
    expected = _one_rank(saved["llama"])
    monkeypatch.setenv("INFER_GRAPHS_TP_HEADERS", "gloo")  # spawned ranks inherit it
    llm = LLM(saved["llama"], **SMALL, tensor_parallel_size=2)
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
        _check_rank_stats(llm.stats())
    finally:
        llm.close()


def test_gemma3_on_two_ranks_matches_and_a_worker_that_dies_makes_the_engine_raise(saved):
    expected = _one_rank(saved["gemma3"])
    llm = LLM(saved["gemma3"], **SMALL, tensor_parallel_size=2)
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
        _check_rank_stats(llm.stats())
        worker = llm.tp.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with code -9"):
            llm.generate([PROMPTS[0]], PARAMS)
        assert time.monotonic() - start < 10
    finally:
        start = time.monotonic()
        llm.close()
        assert time.monotonic() - start < 10


def test_a_worker_that_raises_makes_the_engine_raise_with_its_traceback(saved):
    """Ranks whose graph sizes disagree would run different collectives and hang; the follower
    checks the dispatch rank 0 sent, raises, and rank 0 reports that traceback."""
    from engine.worker.dispatch import Dispatcher
    llm = LLM(saved["llama"], **SMALL, tensor_parallel_size=2)
    try:
        # rank 0 now pads a 3-token step to a piece size of 8; rank 1 still runs it unpadded
        llm.runtime.runner.dispatcher = Dispatcher((), (8,), piecewise_graphs_wanted=True)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"(?s)rank 1 raised:.*rank 1 dispatched a 3-token step"):
            llm.generate([[1, 2, 3]], PARAMS)
        assert time.monotonic() - start < 10
        with pytest.raises(TensorParallelError):  # the engine stays failed, it does not hang
            llm.generate([[1, 2, 3]], PARAMS)
    finally:
        llm.close()


_TORCHRUN_SCRIPT = """
import json, sys
import torch
from engine import LLM, SamplingParams
torch.set_num_threads(1)
path, small, prompts, out = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
llm = LLM(path, tensor_parallel_size=2, **small)  # on rank 1 this serves rank 0 and exits
outputs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
with open(out, "w") as f:
    json.dump({"tokens": [o.token_ids for o in outputs], "stats": llm.stats()}, f)
llm.close()
"""


def test_qwen3_under_torchrun_uses_its_processes_and_matches_one_rank(saved, tmp_path):
    expected = _one_rank(saved["qwen3"])
    script, out = tmp_path / "tp_script.py", tmp_path / "out.json"
    script.write_text(_TORCHRUN_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent),
                                                         os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(port), str(script), saved["qwen3"], json.dumps(SMALL), json.dumps(PROMPTS), str(out)],
        env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["tokens"] == expected
    assert result["stats"]["preemptions"] > 0
    _check_rank_stats(result["stats"])


def _config_only(tmp_path, **overrides) -> str:
    """A model dir with just config.json: the size checks run before any weight is read."""
    config = transformers.LlamaConfig(**{**COMMON, "vocab_size": 96, "num_hidden_layers": 1,
                                         "num_key_value_heads": 2, **overrides})
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    return str(tmp_path)


def test_a_start_up_that_fails_after_the_ranks_started_stops_them(saved):
    import multiprocessing
    start = time.monotonic()
    # two blocks cannot hold one max_model_len request: every rank refuses the pool after sizing it
    with pytest.raises(ConfigError, match="num_gpu_blocks"):
        LLM(saved["llama"], **{**SMALL, "num_gpu_blocks": 2}, tensor_parallel_size=2)
    assert time.monotonic() - start < 60
    assert not [p for p in multiprocessing.active_children() if p.is_alive()]


def test_closing_an_idle_engine_whose_worker_died_releases_everything_without_raising(saved):
    llm = LLM(saved["llama"], **SMALL, tensor_parallel_size=2)
    worker = llm.tp.processes[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    start = time.monotonic()
    llm.close()  # nothing was running: there is nothing to report, only to release
    assert time.monotonic() - start < 10
    assert llm.runtime is None and llm.tp.closed and llm.stats()["steps"] == 0


def test_a_size_that_does_not_divide_the_heads_or_the_intermediate_size_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 does not divide the model's "
                                          r"num_attention_heads \(4\)"):
        LLM(_config_only(tmp_path), device="cpu", tensor_parallel_size=3)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=4 does not divide the model's "
                                          r"intermediate_size \(90\)"):
        LLM(_config_only(tmp_path, intermediate_size=90), device="cpu", tensor_parallel_size=4)


def test_more_ranks_than_visible_gpus_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 exceeds the 1 visible GPU"):
        LLM(_config_only(tmp_path), device="cuda", tensor_parallel_size=2)


def test_a_built_model_cannot_be_split_and_the_size_must_be_positive(saved):
    import models
    model = models.from_pretrained(saved["qwen3"])
    with pytest.raises(ConfigError, match="needs a model path"):
        LLM(model, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="tensor_parallel_size=0"):
        LLM(saved["qwen3"], device="cpu", tensor_parallel_size=0)


def test_tp_bench_times_one_and_two_ranks_on_the_cpu(tmp_path, monkeypatch):
    from bench import tp as tp_bench
    monkeypatch.setenv("INFER_BENCH_CACHE", str(tmp_path))
    report = tp_bench.run("tiny-llama", batches="1", tokens="16", iters=2, context=16, tp_sizes="1,2",
                          all_reduce="both")
    assert [(r["tp"], r["all_reduce"], r["workload"]) for r in report.rows] == [
        (1, "-", "decode bs1 ctx16"), (1, "-", "prefill 16"), (2, "custom", "decode bs1 ctx16"),
        (2, "custom", "prefill 16"), (2, "nccl", "decode bs1 ctx16"), (2, "nccl", "prefill 16")]
    assert all(r["median_ms"] > 0 and r["floor_ms"] is None for r in report.rows)
    assert [r["collectives"] for r in report.rows] == [0, 0, 5, 5, 5, 5]  # 2 layers x 2 + the embedding
    assert report.meta["engine_stats_tp2"]["ranks"][1]["modes"] == report.meta["engine_stats_tp2"]["modes"]
    # on the CPU both engines all-reduce over gloo; the NCCL-only one says it was told to
    assert report.meta["engine_stats_tp2"]["ranks"][0]["all_reduce"] == "gloo: the CPU"
    assert report.meta["engine_stats_tp2_nccl"]["ranks"][0]["all_reduce"] == "nccl: EngineConfig.disable_custom_all_reduce"


def test_each_rank_reads_only_its_shards_and_they_tile_the_full_weights(saved, monkeypatch):
    """Sharded loading without processes (the group is only used in forward): rank r's parameters
    are its slices of the one-rank model's, and the bytes it reads from the file are about 1/N of
    the split tensors (the replicated KV head, norms and biases are read whole)."""
    import models
    from models import loader
    from models.parallel import TensorParallel
    full = dict(models.from_pretrained(saved["llama"]).named_parameters())
    read_elements = []
    original = loader.iter_checkpoint

    class Spy:
        def __init__(self, source):
            self.source = source

        def get_shape(self):
            return self.source.get_shape()

        def __getitem__(self, index):
            tensor = self.source[index]
            read_elements[-1] += tensor.numel()
            return tensor

    monkeypatch.setattr(loader, "iter_checkpoint", lambda d: ((n, Spy(s)) for n, s in original(d)))
    shards = []
    for rank in range(2):
        read_elements.append(0)
        model = models.from_pretrained(saved["llama"], tp=TensorParallel(rank, 2, group=object()))
        shards.append(dict(model.named_parameters()))
    total = sum(p.numel() for p in full.values())
    assert all(0.45 * total < n < 0.65 * total for n in read_elements), (read_elements, total)
    d = 16  # head_dim: 4 heads of 64
    for name, weight in full.items():
        a, b = shards[0][name], shards[1][name]
        if ".qkv_proj." in name:  # q rows (and bias) split by head; the single KV head on both ranks
            q, k, v = weight.split([4 * d, d, d])
            for rank, shard in enumerate((a, b)):
                assert torch.equal(shard, torch.cat([q[rank * 2 * d:(rank + 1) * 2 * d], k, v]))
        elif name.endswith("gate_up_proj.weight"):
            gate, up = weight.chunk(2)
            for rank, shard in enumerate((a, b)):
                assert torch.equal(shard, torch.cat([gate[rank * 48:(rank + 1) * 48], up[rank * 48:(rank + 1) * 48]]))
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat([a, b], dim=1), weight)
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):  # 97 rows: 49 + 48 and a zero row
            assert torch.equal(torch.cat([a, b[:48]]), weight) and not b[48].any()
        else:  # norms and the o_proj bias: replicated
            assert torch.equal(a, weight) and torch.equal(b, weight), name


def test_leaving_by_abort_lets_the_next_engine_of_the_process_make_its_group():
    """The NCCL teardown path (abort, on every group) exercised on gloo with one rank: after each
    leave, the process has no group, and the next start-up's group and control group work."""
    import datetime
    import torch.distributed as dist
    from engine.distributed.rank_loop import leave_process_group
    for _ in range(3):
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
        dist.init_process_group("gloo", rank=0, world_size=1, store=store)
        control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=30))
        t = torch.ones(2)
        dist.broadcast(t, 0, group=control)
        dist.all_reduce(t)
        leave_process_group(abort=True)
        assert not dist.is_initialized()


def test_speculative_decoding_on_two_ranks_matches_one_rank(saved):
    """Proposals are made on rank 0; the verify step (1 + k tokens a chunk, logits at every row)
    reaches the other rank like any staged step, and the tokens are those of one rank."""
    from tests.spec_helpers import replay
    expected = _one_rank(saved["llama"])
    continuations = {tuple(p): list(p) + e for p, e in zip(PROMPTS, expected)}
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM(saved["llama"], **SMALL, tensor_parallel_size=2, speculative_config=spec)
    try:
        replay(llm, continuations, wrong=0.25)
        assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
        stats = llm.stats()
        assert stats["spec_decode"]["accepted_tokens"] > 0
        _check_rank_stats(stats)
    finally:
        llm.close()


def test_a_draft_model_on_two_ranks_matches_one_rank(saved):
    """The draft runs whole on rank 0 (loaded there from its path, outside the ranks' group); only the
    target's verify steps reach the other rank, and the tokens are those of one rank."""
    expected = _one_rank(saved["qwen3"])
    spec = {"model": saved["qwen3"], "num_speculative_tokens": 3}  # the target itself: always accepted
    llm = LLM(saved["qwen3"], **SMALL, tensor_parallel_size=2, speculative_config=spec)
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
        stats = llm.stats()
        assert stats["spec_decode"]["acceptance_rate"] > 0.9 and stats["spec_decode"]["draft_forwards"] > 0
        _check_rank_stats(stats)
    finally:
        llm.close()


def test_rank_0_waiting_for_a_step_raises_naming_a_worker_that_died():
    """Leader.wait_for (how rank 0 waits for its steps on GPUs): a step whose peer died never
    completes, so the wait must end by asking about the workers, not by the step."""
    from engine.config import EngineConfig
    from engine.distributed.tp import Leader

    class DeadWorker:
        name, pid, exitcode = "tp-rank-1", 4321, -9

        def is_alive(self) -> bool:
            return False

    class NeverDone:
        def query(self) -> bool:
            return False

    class DoneAfter:
        def __init__(self, n: int) -> None:
            self.n = n

        def query(self) -> bool:
            self.n -= 1
            return self.n < 0

    leader = Leader(EngineConfig(device="cpu"), processes=[DeadWorker()], errors=None, owns_group=False)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid 4321\) exited with code -9"):
        leader.wait_for(NeverDone(), check_every_s=0.05)
    assert time.monotonic() - start < 5
    healthy = Leader(EngineConfig(device="cpu"), processes=[], errors=None, owns_group=False)
    healthy.wait_for(DoneAfter(1000), check_every_s=0.0)  # a step that completes: no error
