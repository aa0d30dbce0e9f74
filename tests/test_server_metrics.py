"""The server's per-token histogram against prometheus_client's own Histogram: the same exposition for
the same values (bucket edges included), and ServerMetrics.observe feeding it each new inter-token gap."""
from __future__ import annotations

import random

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry, Histogram, generate_latest  # noqa: E402

from engine.entrypoints.server.metrics import _LATENCY_BUCKETS_S, ServerMetrics, TokenHistogram  # noqa: E402
from engine.outputs import RequestOutput, TextHistory  # noqa: E402


def _exposition(registry: CollectorRegistry) -> list[str]:
    """The text format's sample lines (not the _created sample, which only prometheus_client's has)."""
    return [line for line in generate_latest(registry).decode().splitlines()
            if not line.startswith("#") and "_created" not in line]


def test_token_histogram_exposes_what_prometheus_clients_histogram_does():
    rng = random.Random(0)
    values = [rng.expovariate(1 / 0.02) for _ in range(5000)]
    values += list(_LATENCY_BUCKETS_S) + [0.0, 1e-9, 31.0, 1000.0]  # on every edge, below and above them all
    reference_registry, fast_registry = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("x_seconds", "doc", buckets=_LATENCY_BUCKETS_S, registry=reference_registry)
    fast = TokenHistogram("x_seconds", "doc", _LATENCY_BUCKETS_S, fast_registry)
    for value in values:
        reference.observe(value)
    fast.observe_many(iter(values[:100]))
    fast.observe_many(values[100:])
    ours, theirs = _exposition(fast_registry), _exposition(reference_registry)
    assert [line.rsplit(" ", 1)[0] for line in ours] == [line.rsplit(" ", 1)[0] for line in theirs]
    for line, expected in zip(ours, theirs):  # counts exactly; the sum up to float summation order
        assert float(line.rsplit(" ", 1)[1]) == pytest.approx(float(expected.rsplit(" ", 1)[1]), rel=1e-12), line


def test_observe_adds_each_new_gap_between_tokens_once():
    metrics = ServerMetrics()
    times = [10.0, 10.004, 10.010, 10.030, 10.0305]
    history = TextHistory([1, 2, 3, 4, 5, 6, 7], 2, 3, [], 0, times)
    out = RequestOutput("r", [1, 2], [5], "", False, None, 0.5, history=history)
    assert metrics.observe(out, 0) == 3  # three tokens: two gaps (0.004, 0.006)
    history = history._replace(num_output_tokens=5)
    out = RequestOutput("r", [1, 2], [6, 7], "", True, "length", 0.5, history=history)
    assert metrics.observe(out, 3) == 5  # two more: gaps 0.020, 0.0005
    assert metrics.itl.counts[0] == 1 and sum(metrics.itl.counts) == 4  # 0.0005 in the first bucket (le=0.001)
    assert metrics.itl.sum == pytest.approx(0.0305)
    assert metrics.generation_tokens._value.get() == 5


def test_with_the_engine_in_its_own_process_the_cuda_gauges_are_the_engine_processes(monkeypatch):
    """serve --engine-process: the server's process holds no CUDA context, so its allocator would read 0;
    the engine's process sends its own figures in the snapshot and /metrics shows those."""
    import torch
    import transformers

    import models
    from engine import LLM
    from engine.core.stats import collect_stats
    from engine.entrypoints.server import engine_process

    def refuse(*args, **kwargs):
        raise AssertionError("the server's own allocator was read")
    net = models.from_config(transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                                      num_hidden_layers=1, num_attention_heads=2,
                                                      num_key_value_heads=1, max_position_embeddings=64),
                             dtype=torch.float32, device="cpu", seed=0)
    with LLM(net, device="cpu", max_model_len=32, block_size=4, num_gpu_blocks=16, show_progress=False) as llm:
        stats = collect_stats(llm, gather_ranks=False)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 123 * 2**20)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 456 * 2**20)
    sent = engine_process._memory("cuda:0")  # what the engine's process adds to each snapshot
    assert sent["cuda_memory_allocated_bytes"] == 123 * 2**20 and sent["cuda_memory_reserved_bytes"] == 456 * 2**20
    assert sent["engine_process_rss_bytes"] > 0
    monkeypatch.setattr(torch.cuda, "memory_allocated", refuse)
    monkeypatch.setattr(torch.cuda, "memory_reserved", refuse)
    text = ServerMetrics("cuda").render({**stats, **sent, "requests_waiting": 0, "requests_admitting": 0}).decode()
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}
    assert values["infer_graphs_cuda_memory_allocated_bytes"] == 123 * 2**20
    assert values["infer_graphs_cuda_memory_reserved_bytes"] == 456 * 2**20
    assert values["infer_graphs_engine_process_resident_memory_bytes"] == sent["engine_process_rss_bytes"]
