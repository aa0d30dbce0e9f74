"""Splitting the traced graph: one piece per attention op between L + 1 compute pieces, and the edge
cases (a torch.Size across a boundary, getitem kept with its producer, consecutive ops merged, no
allocation-only piece)."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx

import compile_backend
import models
from compile_backend import BackendConfig, InferGraphsBackend
from compile_backend.compile_pieces import DirectCalls
from compile_backend.split import split_graph
from custom_ops import AttentionLayer, register_attention_layer, unique_prefix
from tests.test_backend_helpers import ARCHS, TinyLM, hf_config, random_inputs, run_marked

EAGER = BackendConfig(piece_compiler="eager")


@torch.library.custom_op("infer_test::pair", mutates_args=())
def pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * 2, x + 1


@pair.register_fake
def _pair_fake(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("infer_test::sum_into", mutates_args=("out",))
def sum_into(xs: list[torch.Tensor], out: torch.Tensor) -> None:
    out.copy_(sum(xs))


@sum_into.register_fake
def _sum_into_fake(xs: list[torch.Tensor], out: torch.Tensor) -> None:
    return None


def compile_and_run(module: torch.nn.Module, config: BackendConfig, num_tokens: int = 7, vocab: int = 100):
    torch._dynamo.reset()
    backend = InferGraphsBackend(config)
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    ids, positions = random_inputs(num_tokens, vocab)
    with torch.no_grad():
        got = run_marked(compiled, ids, positions)
        expected = module(ids, positions)
    return backend, got, expected


@pytest.mark.parametrize("arch", ARCHS)
def test_each_model_splits_into_layers_plus_one_compute_pieces(arch):
    model = models.from_config(hf_config(arch), dtype=torch.float32)
    backend, got, expected = compile_and_run(model, EAGER, vocab=96)
    summary = backend.split_summary()
    layers = model.config.num_layers
    assert summary.num_compute_pieces == layers + 1
    assert summary.num_splitting_pieces == layers
    assert [p.is_splitting for p in summary.pieces] == [False, True] * layers + [False]
    assert all(p.ops == ("infer.attention",) for p in summary.pieces if p.is_splitting)
    assert backend.stats.pieces == 2 * layers + 1 and backend.stats.compute_pieces == layers + 1
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # The per-head q/k norms (Qwen3, Gemma 3) and the rotary run over q and k together, in one op
    # per layer (custom_ops.rope), and nothing else of the rotary is left to Inductor (its cat)
    assert sum(p.ops.count("infer.qk_norm_rope") for p in summary.pieces) == layers
    assert sum(p.ops.count("cat") for p in summary.pieces) == 0
    # With q/k norms the attention op also gets raw q / k, cos / sin and the norm weights (for decode
    # steps where the rotary op defers to it), still as one direct call of its implementation
    split = backend.graphs[0].split
    calls = [split.module.__dict__[p.name].calls for p in summary.pieces if p.is_splitting]
    assert [[len(template) for _, template, _, _ in c] for c in calls] == [[5 if arch == "llama" else 11]] * layers


def test_summary_is_readable():
    backend, _, _ = compile_and_run(TinyLM(layers=2), EAGER)
    text = str(backend.split_summary())
    assert text.splitlines()[0] == "infer_graphs split: 5 pieces (3 compute, 2 splitting) at infer::attention"
    assert "infer.attention" in text and "linear" in text and "embedding" in text
    assert len(text.splitlines()) == 6


def test_attention_pieces_call_the_implementation_directly():
    backend, got, expected = compile_and_run(TinyLM(layers=2), EAGER)
    graph = backend.graphs[0]
    direct = [graph.split.module.__dict__[p.name] for p in graph.split.summary.pieces if p.is_splitting]
    assert len(direct) == 2 and all(isinstance(d, DirectCalls) for d in direct)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


class _ListArg(torch.nn.Module):
    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        a, b = ids.float().sin()[:, None], positions.float().cos()[:, None]
        out = torch.empty_like(a)
        torch.ops.infer_test.sum_into([a, b], out)
        return out * 2


def test_a_splitting_op_with_a_list_of_tensors_runs_through_the_piece_not_direct_calls():
    backend, got, expected = compile_and_run(_ListArg(), EAGER.replace(splitting_ops=("infer_test::sum_into",)))
    graph = backend.graphs[0]
    runners = [graph.split.module.__dict__[p.name] for p in graph.split.summary.pieces if p.is_splitting]
    assert len(runners) == 1 and not isinstance(runners[0], DirectCalls)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_no_splitting_ops_means_one_piece():
    backend, got, expected = compile_and_run(TinyLM(layers=2), EAGER.replace(splitting_ops=()))
    assert [p.is_splitting for p in backend.split_summary().pieces] == [False]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


class _BackToBack(torch.nn.Module):
    """Two attention calls with only an allocation between them: no empty piece, one merged op piece."""

    def __init__(self) -> None:
        super().__init__()
        prefix = unique_prefix("b2b")
        self.names = [f"{prefix}.{i}" for i in range(2)]
        for name in self.names:
            register_attention_layer(name, AttentionLayer(2, 2, 4, 0.5))
        self.embed = torch.nn.Embedding(100, 24)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, k, v = self.embed(ids).view(-1, 3, 2, 4).unbind(1)
        out1 = torch.empty_like(q)
        torch.ops.infer.attention(q, k, v, out1, self.names[0])
        out2 = torch.empty_like(q)
        torch.ops.infer.attention(out1, k, v, out2, self.names[1])
        return self.proj(out2.reshape(-1, 8)) + positions[:, None]


def test_consecutive_ops_share_one_piece_and_no_piece_only_allocates():
    backend, got, expected = compile_and_run(_BackToBack(), EAGER)
    pieces = backend.split_summary().pieces
    assert [p.is_splitting for p in pieces] == [False, True, False]
    assert pieces[1].ops == ("infer.attention", "infer.attention")
    assert "empty_like" in pieces[0].ops
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def _annotate(gm: torch.fx.GraphModule, *inputs: torch.Tensor) -> None:
    """Record each node's value as Dynamo would (meta['example_value'])."""
    class Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            value = super().run_node(node)
            node.meta["example_value"] = value
            return value
    Recorder(gm).run(*inputs)


class _SizeAcross(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.size()
        a, b = torch.ops.infer_test.pair(x.sin())
        return (a + b).reshape(-1).view(shape) * 3


def test_size_and_getitem_never_cross_a_boundary():
    gm = torch.fx.symbolic_trace(_SizeAcross())
    x = torch.randn(5, 6)
    _annotate(gm, x)
    expected = _SizeAcross()(x)
    split = split_graph(gm, ("infer_test::pair",))
    pieces = split.summary.pieces
    assert [p.is_splitting for p in pieces] == [False, True, False]
    # The tuple is unpacked inside the op's piece: only tensors leave it.
    assert pieces[1].ops == ("infer_test.pair", "getitem", "getitem") and pieces[1].num_outputs == 2

    crossing = []

    class Watch(torch.fx.Interpreter):
        def call_module(self, target, args, kwargs):
            out = super().call_module(target, args, kwargs)
            values = list(args) + (list(out) if isinstance(out, (tuple, list)) else [out])
            crossing.extend(v for v in values if isinstance(v, (torch.Size, tuple)))
            return out

    got = Watch(split.module).run(x)
    assert not crossing, f"values crossing piece boundaries: {crossing}"
    torch.testing.assert_close(got, expected)
    size_users = [n for n in split.piece(pieces[2]).graph.nodes if n.target is torch.Size]
    assert size_users, "the consumer rebuilds the size from its dims"


def test_splitting_op_overload_name_matches_only_that_overload():
    backend, got, expected = compile_and_run(TinyLM(layers=1), EAGER.replace(
        splitting_ops=("infer::attention.default",)))
    assert backend.split_summary().num_splitting_pieces == 1
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_split_matches_packet_and_default_overload_targets():
    graph = torch.fx.Graph()
    q = graph.placeholder("q")
    for target in (torch.ops.infer.attention, torch.ops.infer.attention.default):
        graph.call_function(target, (q, q, q, q, "x"))
    graph.call_function(operator.add, (q, q))
    graph.output(None)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    pieces = split_graph(gm, ("infer::attention",)).summary.pieces
    assert [p.is_splitting for p in pieces] == [True, False]
    assert pieces[0].ops == ("infer.attention", "infer.attention.default")


def test_exports():
    for name in ("InferGraphsBackend", "BackendConfig", "mark_token_dim", "GraphPool",
                 "pad_to_capture_size", "piecewise_context", "SplitSummary", "BackendStats"):
        assert hasattr(compile_backend, name)
