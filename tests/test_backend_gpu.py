"""The backend on a CUDA device: piecewise replay against eager for every captured size, a long run of
replays with changing inputs, the shared pool's size, the debug address check, FULL pass-through."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

import models
from compile_backend import (
    BackendConfig, InferGraphsBackend, pad_to_capture_size, piecewise_context, pool_bytes,
)
from custom_ops import RuntimeMode, forward_context
from tests.test_backend_helpers import ARCHS, TinyLM, hf_config, random_inputs, run_marked

pytestmark = pytest.mark.gpu
CUDA = "cuda"
VOCAB = 96
HEAD_DIM = 16  # the Triton attention kernels need a head dim of at least 16 (tl.dot's K)


def report(name: str, **values: object) -> None:
    """Measurements worth quoting go to $BACKEND_GPU_REPORT (one JSON line each) when it is set."""
    path = os.environ.get("BACKEND_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": name, **values}) + "\n")


def compile_model(model: torch.nn.Module, config: BackendConfig, pool=None):
    backend = InferGraphsBackend(config, pool=pool)
    return backend, torch.compile(model, backend=backend, fullgraph=True)


def capture_all(backend: InferGraphsBackend, compiled, vocab: int = VOCAB, sizes=None) -> None:
    def forward(n: int) -> None:
        run_marked(compiled, *random_inputs(n, vocab, CUDA))
    with torch.no_grad():
        backend.capture(forward, sizes)


def piecewise_step(compiled, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    with piecewise_context(ids.shape[0]):
        return run_marked(compiled, ids, positions).clone()  # the output is a graph buffer: copy it


@pytest.mark.parametrize("arch", ARCHS)
def test_replay_matches_eager_for_every_captured_size(arch):
    model = models.from_config(hf_config(arch, head_dim=HEAD_DIM), dtype=torch.float32, device=CUDA)
    config = BackendConfig(piece_compiler="eager")
    backend, compiled = compile_model(model, config)
    capture_all(backend, compiled)
    stats = backend.stats
    assert stats.captured_sizes == list(config.capture_sizes)
    assert stats.piece_captures == len(config.capture_sizes) * (model.config.num_layers + 1)
    with torch.no_grad():
        for n in config.capture_sizes:
            ids, positions = random_inputs(n, VOCAB, CUDA)
            got = piecewise_step(compiled, ids, positions)
            torch.testing.assert_close(got, model(ids, positions), msg=f"{arch}, {n} tokens")
    assert stats.replay_steps == len(config.capture_sizes)
    assert stats.fallback_steps == 0 and stats.graphs_compiled == 1
    report("replay_every_size", arch=arch, sizes=len(config.capture_sizes),
           capture_seconds=round(sum(stats.capture_seconds.values()), 3), pool_bytes=stats.graph_pool_bytes)


def _counting_runner(warm_every_size: bool, sync_on_first_call: frozenset[int] = frozenset()):
    """A PieceRunner over x * 2 + 1 that records every call's token count; on its first call at a
    size in `sync_on_first_call` it synchronizes (first-call work a capture cannot hold)."""
    from compile_backend.piecewise import PieceRunner, StepAction, StepPlan
    from compile_backend.pool import GraphPool
    from compile_backend.stats import BackendStats

    calls: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if n in sync_on_first_call and n not in calls:
            torch.cuda.synchronize()
        calls.append(n)
        return x * 2 + 1

    plan, pool = StepPlan(StepAction.CAPTURE), GraphPool()
    runner = PieceRunner("piece", 0, fn, plan, ("x",), pool.handle, BackendStats(), False, warm_every_size)
    return runner, plan, calls, pool


@pytest.mark.parametrize("every_size", [False, True])
def test_a_piece_warms_up_before_its_first_capture_and_each_new_specialization_class(every_size):
    """Warm-ups cost as much host time as captures: a piece runs outside a capture before its first one
    and before a size of a new (n mod 16, n == 1) class only, or before every size when asked."""
    from compile_backend.piecewise import StepAction
    runner, plan, calls, _pool = _counting_runner(every_size)
    buffer = torch.randn(64, 8, device=CUDA)
    sizes = (64, 32, 16, 12, 28, 1)
    for n in sizes:
        plan.num_tokens = n
        torch.testing.assert_close(runner(buffer[:n]), buffer[:n] * 2 + 1)
    if every_size:
        assert calls == [n for n in sizes for _ in range(2)]
    else:  # 32 and 16 share 64's class, 28 shares 12's: captured without a warm-up
        assert calls == [64, 64, 32, 16, 12, 12, 28, 1, 1]
    assert runner.stats.piece_captures == len(sizes)
    assert runner.stats.piece_warm_ups == (len(sizes) if every_size else 3)
    plan.action = StepAction.REPLAY
    buffer.copy_(torch.randn_like(buffer))
    before = len(calls)
    for n in sizes:
        plan.num_tokens = n
        torch.testing.assert_close(runner(buffer[:n]).clone(), buffer[:n] * 2 + 1, msg=f"{n} tokens")
    assert len(calls) == before  # replays run no Python of the piece


def test_a_capture_that_needed_a_warm_up_fails_naming_the_setting_and_succeeds_with_it():
    """A first call at 16 tokens that synchronizes cannot be captured without a warm-up at 16: the
    error names BackendConfig.warm_up_every_size (in a child: torch cannot resume capturing in a
    process whose capture failed), and with that setting the same piece captures and replays."""
    import subprocess
    import sys
    script = (
        "import torch\n"
        "from tests.test_backend_gpu import _counting_runner\n"
        "runner, plan, calls, pool = _counting_runner(False, frozenset({16}))\n"
        "x = torch.randn(32, 8, device='cuda')\n"
        "for n in (32, 16):\n"
        "    plan.num_tokens = n\n"
        "    runner(x[:n])\n"
    )
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert child.returncode != 0
    assert "capturing piece piece for 16 tokens failed" in child.stderr
    assert "BackendConfig.warm_up_every_size=True" in child.stderr
    runner, plan, calls, _pool = _counting_runner(True, frozenset({16}))
    x = torch.randn(32, 8, device=CUDA)
    for n in (32, 16):
        plan.num_tokens = n
        torch.testing.assert_close(runner(x[:n]), x[:n] * 2 + 1)
    assert calls == [32, 32, 16, 16]


@pytest.fixture(scope="module")
def inductor_llama():
    """Llama with Inductor pieces, every default size captured (one compile for the tests below)."""
    torch._dynamo.reset()
    model = models.from_config(hf_config("llama", head_dim=HEAD_DIM), dtype=torch.float32, device=CUDA)
    backend, compiled = compile_model(model, BackendConfig())
    capture_all(backend, compiled)
    return model, backend, compiled


def test_inductor_replay_matches_eager_and_the_same_pieces_without_graphs(inductor_llama):
    model, backend, compiled = inductor_llama
    with torch.no_grad():
        for n in (1, 2, 4, 8, 24, 144, 256, 512):  # capture sizes of the default rule
            ids, positions = random_inputs(n, VOCAB, CUDA)
            got = piecewise_step(compiled, ids, positions)
            torch.testing.assert_close(got, model(ids, positions), rtol=1e-4, atol=1e-4)
            with forward_context(None, RuntimeMode.NONE, n):
                ungraphed = run_marked(compiled, ids, positions)
            torch.testing.assert_close(got, ungraphed, rtol=1e-5, atol=1e-5)
    assert backend.stats.graphs_compiled == 1 and backend.stats.fallback_steps == 0


def test_thousand_consecutive_replays_with_changing_inputs_and_token_counts_agree_with_eager(inductor_llama):
    model, backend, compiled = inductor_llama
    config = backend.config
    rng = random.Random(0)
    before = backend.stats.replay_steps
    worst = 0.0
    with torch.no_grad():
        for step in range(1000):
            real = rng.randint(1, config.max_capture_size)
            padded = pad_to_capture_size(real, config)
            ids = torch.zeros(padded, dtype=torch.long, device=CUDA)
            ids[:real] = torch.randint(0, VOCAB, (real,), device=CUDA)
            positions = torch.arange(padded, device=CUDA)
            # Padding comes after the real tokens of one causal sequence, so it cannot change them.
            with piecewise_context(padded):
                got = run_marked(compiled, ids, positions)[:real]
            expected = model(ids[:real], positions[:real])
            err = (got - expected).abs().max().item()
            worst = max(worst, err)
            assert err < 1e-4, f"step {step}: {real} tokens (padded {padded}) differ by {err}"
    assert backend.stats.replay_steps - before == 1000 and backend.stats.fallback_steps == 0
    report("thousand_replays", worst_abs_err=worst)


def test_graph_pool_for_all_default_sizes_is_at_most_1_3x_the_largest_size_alone():
    cfg = hf_config("llama", hidden_size=1024, intermediate_size=4096, num_hidden_layers=2,
                    num_attention_heads=16, num_key_value_heads=4, head_dim=64)
    # bf16, as served. In float32 the pool for all sizes is 64 MiB whatever the code (segment rounding
    # of the 16 MiB gate_up buffers), so the ratio moved with the largest size's own temporaries: 58 MiB
    # alone with torch's act-and-mul, 38 MiB with the act-and-mul op (H100, 2026-11-27).
    model = models.from_config(cfg, dtype=torch.bfloat16, device=CUDA)
    config = BackendConfig(piece_compiler="eager")
    measured = {}
    for label, sizes in (("largest", [config.max_capture_size]), ("all", None)):
        torch._dynamo.reset()
        pool = torch.cuda.graph_pool_handle()
        backend, compiled = compile_model(model, config, pool=pool)
        capture_all(backend, compiled, sizes=sizes)
        torch.cuda.synchronize()
        measured[label] = (pool_bytes(pool), backend.stats.graph_pool_bytes)
    (largest, largest_growth), (everything, everything_growth) = measured["largest"], measured["all"]
    report("pool", largest_alone_bytes=largest, all_sizes_bytes=everything,
           largest_growth=largest_growth, all_growth=everything_growth)
    assert largest > 0 and largest_growth > 0
    assert everything <= 1.3 * largest, f"pool for all sizes {everything} vs largest alone {largest}"
    assert everything_growth <= 1.3 * largest_growth
    from compile_backend.pool import reserved_bytes  # what the growth is counted with, cheaply
    assert reserved_bytes() == torch.cuda.memory_reserved() > 0


def test_debug_check_raises_when_an_input_is_reallocated():
    torch._dynamo.reset()
    model = TinyLM(hidden=64, head_dim=HEAD_DIM).to(CUDA)
    backend, compiled = compile_model(model, BackendConfig(piece_compiler="eager", capture_sizes=(8,),
                                                           debug_checks=True))
    ids, positions = random_inputs(8, 100, CUDA)
    with torch.no_grad():
        piecewise_step(compiled, ids, positions)     # capture
        piecewise_step(compiled, ids, positions)     # replay: addresses as captured
        model.o[1].weight.data = model.o[1].weight.data.clone()   # e.g. weights reloaded after capture
        with pytest.raises(RuntimeError, match=r"piece submod_\d+ \(#\d+\) input '\w*o_modules_1_parameters_weight\w*'"):
            piecewise_step(compiled, ids, positions)
    assert backend.stats.graphs_compiled == 1


def test_uncaptured_size_falls_back_counted_and_mismatched_token_count_raises():
    torch._dynamo.reset()
    model = TinyLM(hidden=64, head_dim=HEAD_DIM).to(CUDA)
    backend, compiled = compile_model(model, BackendConfig(piece_compiler="eager", capture_sizes=(8, 16)))
    with torch.no_grad():
        ids, positions = random_inputs(12, 100, CUDA)
        got = piecewise_step(compiled, ids, positions)       # 12 is not a capture size
        torch.testing.assert_close(got, model(ids, positions))
        assert backend.stats.fallback_steps == 1 and backend.stats.captured_sizes == []
        ids, positions = random_inputs(8, 100, CUDA)
        got = piecewise_step(compiled, ids, positions)       # captured on first use
        assert backend.stats.captured_sizes == [8]
        torch.testing.assert_close(got, model(ids, positions))
        with piecewise_context(16), pytest.raises(ValueError, match="num_tokens"):
            run_marked(compiled, ids, positions)
    assert backend.stats.graphs_compiled == 1


def test_full_mode_passes_through_to_an_outer_capture():
    torch._dynamo.reset()
    model = TinyLM(hidden=64, head_dim=HEAD_DIM).to(CUDA)
    backend, compiled = compile_model(model, BackendConfig(piece_compiler="eager"))
    ids, positions = random_inputs(16, 100, CUDA)
    with torch.no_grad():
        with forward_context(None, RuntimeMode.FULL, 16):
            run_marked(compiled, ids, positions)          # compile and warm up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=backend.pool), forward_context(None, RuntimeMode.FULL, 16):
            out = run_marked(compiled, ids, positions)
        ids.copy_(torch.randint(0, 100, (16,), device=CUDA))
        graph.replay()
        torch.testing.assert_close(out, model(ids, positions))
    assert backend.stats.full_steps == 2 and backend.stats.piece_captures == 0
