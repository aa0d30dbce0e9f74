"""The backend on the CPU: numerics against eager over many token counts from one trace, runtime
modes, the attention op writing the previous piece's buffer, and `backend="infer_graphs"` by name."""
from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._dynamo.utils import counters

import models
from compile_backend import BackendConfig, InferGraphsBackend, piecewise_context
from custom_ops import RuntimeMode, forward_context, run_attention
from tests.test_backend_helpers import ARCHS, TinyLM, hf_config, random_inputs, run_marked

TOKEN_COUNTS = [1, 2, *random.Random(0).sample(range(3, 600), 20)]  # 22 counts, 1 first


def compare_over_token_counts(model, config, vocab, exact):
    torch._dynamo.reset()
    counters.clear()
    backend = InferGraphsBackend(config)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.no_grad():
        for n in TOKEN_COUNTS:
            ids, positions = random_inputs(n, vocab)
            got = run_marked(compiled, ids, positions)
            expected = model(ids, positions)
            if exact:
                assert torch.equal(got, expected), f"{n} tokens: not bitwise equal"
            else:
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=f"{n} tokens")
    return backend


@pytest.mark.parametrize("arch", ARCHS)
def test_eager_pieces_equal_eager_bitwise_over_many_token_counts_with_one_compile(arch):
    model = models.from_config(hf_config(arch), dtype=torch.float32)
    backend = compare_over_token_counts(model, BackendConfig(piece_compiler="eager"), 96, exact=True)
    assert backend.stats.graphs_compiled == 1
    assert counters["stats"]["unique_graphs"] == 1
    assert backend.stats.graphless_steps == len(TOKEN_COUNTS)


def test_inductor_pieces_match_eager_within_1e5_over_many_token_counts_with_one_compile():
    """Four layers: five compute pieces, of which the three between attention calls are identical in
    structure and compiled once, then run with each layer's own weights."""
    model = models.from_config(hf_config("llama", num_hidden_layers=4), dtype=torch.float32)
    backend = compare_over_token_counts(model, BackendConfig(), 96, exact=False)
    assert backend.stats.graphs_compiled == 1 and counters["stats"]["unique_graphs"] == 1
    assert backend.split_summary().num_compute_pieces == 5
    assert backend.stats.piece_compilations == 3  # first, middle (x3), last


def test_pieces_compiled_from_propagated_fakes_match_the_recorded_ones(monkeypatch):
    """The fallback for a piece without Dynamo's recorded input values (fake propagation through the
    split module) compiles the same distinct pieces and computes the same outputs."""
    import compile_backend.compile_pieces as compile_pieces
    monkeypatch.setattr(compile_pieces, "_recorded_inputs", lambda piece: None)
    model = models.from_config(hf_config("llama", num_hidden_layers=4), dtype=torch.float32)
    backend = compare_over_token_counts(model, BackendConfig(), 96, exact=False)
    assert backend.stats.piece_compilations == 3


_out_ptrs: list[int] = []


@torch.library.custom_op("infer_test::attention_spy", mutates_args=("out",))
def attention_spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer_name: str) -> None:
    _out_ptrs.append(out.data_ptr())
    run_attention(q, k, v, out, layer_name)


@attention_spy.register_fake
def _spy_fake(q, k, v, out, layer_name) -> None:
    return None


class SpyLM(TinyLM):
    def attend(self, q, k, v, out, name) -> None:
        torch.ops.infer_test.attention_spy(q, k, v, out, name)


def test_attention_writes_in_place_into_the_buffer_the_inductor_piece_allocated():
    """The op gets the very `out` the previous (Inductor) piece returned, and the next piece reads it:
    no functionalization copy anywhere (a written copy nobody reads would give garbage here)."""
    torch._dynamo.reset()
    model = SpyLM(layers=1)
    backend = InferGraphsBackend(BackendConfig(splitting_ops=("infer_test::attention_spy",)))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    ids, positions = random_inputs(9, 100)
    with torch.no_grad():
        run_marked(compiled, ids, positions)  # compile
        graph = backend.graphs[0]
        first, last = graph.pieces
        produced, consumed = [], []
        inner_first, inner_last = first.fn, last.fn

        def record_first(*args):
            outs = inner_first(*args)
            produced.extend(t.data_ptr() for t in outs if isinstance(t, torch.Tensor))
            return outs

        def record_last(*args):
            consumed.extend(a.data_ptr() for a in args if isinstance(a, torch.Tensor))
            return inner_last(*args)

        first.fn, last.fn = record_first, record_last
        _out_ptrs.clear()
        got = run_marked(compiled, ids, positions)
        expected = model(ids, positions)
    assert len(_out_ptrs) == 2  # the compiled step, then eager
    assert _out_ptrs[0] in produced and _out_ptrs[0] in consumed
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_inductor_whole_graph_without_splitting_keeps_attention_semantics():
    """splitting_ops=(): the op sits inside one Inductor graph (auto-functionalized); still exact semantics."""
    model = TinyLM(layers=1)
    torch._dynamo.reset()
    backend = InferGraphsBackend(BackendConfig(splitting_ops=()))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.no_grad():
        for n in (1, 6, 13):
            ids, positions = random_inputs(n, 100)
            torch.testing.assert_close(run_marked(compiled, ids, positions), model(ids, positions),
                                       rtol=1e-5, atol=1e-5)
    assert backend.stats.graphs_compiled == 1


def test_every_runtime_mode_runs_on_cpu_and_is_counted():
    torch._dynamo.reset()
    model = TinyLM()
    backend = InferGraphsBackend(BackendConfig(piece_compiler="eager", capture_sizes=(4, 8)))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    ids, positions = random_inputs(8, 100)
    with torch.no_grad():
        expected = model(ids, positions)
        outputs = [run_marked(compiled, ids, positions)]
        for mode in (RuntimeMode.NONE, RuntimeMode.PIECEWISE, RuntimeMode.FULL):
            with forward_context(None, mode, 8):
                outputs.append(run_marked(compiled, ids, positions))
        # A PIECEWISE step at a size with no graph: on the CPU there are no graphs at all, so it is not
        # a fallback (nothing was expected to replay), just a graphless step.
        ids5, positions5 = random_inputs(5, 100)
        with piecewise_context(5):
            run_marked(compiled, ids5, positions5)
    for out in outputs:
        assert torch.equal(out, expected)
    stats = backend.stats
    assert (stats.graphless_steps, stats.full_steps, stats.fallback_steps, stats.replay_steps) == (4, 1, 0, 0)
    assert stats.captured_sizes == [] and stats.graph_pool_bytes == 0


def test_capture_on_cpu_runs_each_size_as_a_warm_up_largest_first():
    torch._dynamo.reset()
    model = TinyLM()
    backend = InferGraphsBackend(BackendConfig(piece_compiler="eager", capture_sizes=(1, 4, 16)))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    seen = []

    def forward(n: int) -> None:
        seen.append(n)
        with torch.no_grad():
            run_marked(compiled, *random_inputs(n, 100))

    assert backend.capture(forward) == {}
    assert seen == [16, 4, 1] and backend.stats.graphs_compiled == 1
    with pytest.raises(ValueError, match="capture_sizes"):
        backend.capture(forward, sizes=[3])


def test_backend_by_name_works_in_a_fresh_process():
    script = textwrap.dedent("""
        import sys
        import torch
        import transformers
        import models  # the model package registers the attention op; nothing imports compile_backend
        from torch._dynamo.decorators import mark_unbacked
        assert "compile_backend" not in sys.modules
        model = models.from_config(transformers.LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8), dtype=torch.float32)
        compiled = torch.compile(model, backend="infer_graphs", fullgraph=True)
        with torch.no_grad():
            for n in (1, 5, 12):
                ids, positions = torch.randint(0, 64, (n,)), torch.arange(n)
                mark_unbacked(ids, 0)
                mark_unbacked(positions, 0)
                torch.testing.assert_close(compiled(ids, positions), model(ids, positions), rtol=1e-5, atol=1e-5)
        assert "compile_backend" in sys.modules
        print("BY-NAME-OK")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert "BY-NAME-OK" in result.stdout, result.stderr[-3000:]


def test_an_eager_process_never_imports_dynamo_or_triton_and_a_compile_marks_the_trace_constants_first():
    """torch._dynamo costs over a second to import, Triton ~0.2 s: the packages a server, the CLIs'
    argument checks and eager engines import leave them out; the compile backend brings Dynamo, and
    marks the ops' configuration functions constant before anything is traced, whichever way it is
    named."""
    script = textwrap.dedent("""
        import sys
        import engine, models, custom_ops
        from engine.entrypoints import cli_args
        assert "torch._dynamo" not in sys.modules, "an eager import pulled in torch._dynamo"
        assert "triton" not in sys.modules, "an eager import pulled in triton"
        import torch
        torch.compile(torch.nn.Linear(2, 2), backend="infer_graphs")  # looks the name up, traces nothing
        from custom_ops.gemv_table import fp8_large_method
        assert getattr(fp8_large_method, "_dynamo_marked_constant", False)
        print("LAZY-DYNAMO-OK")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert "LAZY-DYNAMO-OK" in result.stdout, result.stderr[-3000:]


def test_structural_key_tells_pieces_apart_by_constants_and_input_layout():
    from compile_backend.compile_pieces import structural_key

    def piece(scale: float) -> torch.fx.GraphModule:
        return torch.fx.symbolic_trace(lambda x, w: torch.nn.functional.linear(x * scale, w))

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    assert structural_key(piece(2.0), (x, w)) == structural_key(piece(2.0), (torch.randn(4, 8), torch.randn(8, 8)))
    assert structural_key(piece(2.0), (x, w)) != structural_key(piece(3.0), (x, w))
    assert structural_key(piece(2.0), (x, w)) != structural_key(piece(2.0), (x, w.t()))
    assert structural_key(piece(2.0), (x, w)) != structural_key(piece(2.0), (x.double(), w.double()))
    holder = torch.nn.Linear(8, 8)
    assert structural_key(torch.fx.symbolic_trace(holder), (x,)) is None  # reads module state


@torch.library.custom_op("infer_test::barrier", mutates_args=())
def barrier(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@barrier.register_fake
def _barrier_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _mutate_then_read_twice(x, a, b, c, d):
    """Two compute pieces of one structure: each adds into its first buffer, then reads its second."""
    a.add_(x)
    y, w = b * 2, x + 1
    y = torch.ops.infer_test.barrier(y)
    c.add_(y)
    z, w2 = d * 2, y + 1
    z = torch.ops.infer_test.barrier(z)
    return z + w + w2


def test_pieces_alike_but_for_which_inputs_alias_are_compiled_apart():
    """a and b are views of one storage, c and d are not: the first piece must see its add through b,
    the second must not see its add through d. Code compiled for the aliased pair (a synthetic base)
    and shared with the other pair read d as if it were c."""
    def inputs():
        x, s1, s2 = torch.ones(4), torch.zeros(4), torch.zeros(4)
        return x, s1, s1.view(4), s2, s2.clone()

    torch._dynamo.reset()
    backend = InferGraphsBackend(BackendConfig(splitting_ops=("infer_test::barrier",)))
    compiled = torch.compile(_mutate_then_read_twice, backend=backend, fullgraph=True)
    # Inductor's own caches: off, so the compiles here are this test's (a cached artifact of another
    # aliasing could stand in for either)
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        got = compiled(*inputs())
    expected = _mutate_then_read_twice(*inputs())
    assert torch.equal(got, expected), (got, expected)
    assert backend.stats.compute_pieces == 3 and backend.stats.piece_compilations == 3


def test_a_compute_piece_with_one_output_feeds_the_splitting_op_after_it():
    """Inductor turns the piece it compiles into one returning a 1-tuple; the fake run that compiles
    the pieces in turn passed that tuple to the op (a compile error) instead of the tensor."""
    def f(x):
        return torch.ops.infer_test.barrier(x * 2) + 1

    torch._dynamo.reset()
    backend = InferGraphsBackend(BackendConfig(splitting_ops=("infer_test::barrier",)))
    x = torch.randn(5)
    assert torch.equal(torch.compile(f, backend=backend, fullgraph=True)(x), f(x))
    assert backend.stats.compute_pieces == 2


@pytest.mark.parametrize("debug_checks", [False, True])
def test_inductor_pieces_carry_runtime_asserts_only_under_debug_checks(debug_checks):
    """Each size / stride / alignment assert of Inductor's code costs host time on every step without a
    graph and at every capture; they are compiled in only when BackendConfig.debug_checks asks."""
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    model = models.from_config(hf_config("llama", num_hidden_layers=2), dtype=torch.float32)
    backend = InferGraphsBackend(BackendConfig(debug_checks=debug_checks))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    ids, positions = random_inputs(5, 96)
    with torch.no_grad():
        got, sources = run_and_get_code(run_marked, compiled, ids, positions)
        torch.testing.assert_close(got, model(ids, positions), rtol=1e-5, atol=1e-5)
    assert len(sources) == backend.stats.piece_compilations == 3
    asserting = ["assert_size_stride(" in code for code in sources]
    assert asserting == [debug_checks] * 3
