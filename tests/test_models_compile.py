"""Every model traces with torch.compile(fullgraph=True) as one graph with one attention op per layer."""
from __future__ import annotations

import pytest
import torch
import transformers

import models

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
CONFIGS = {
    "llama": transformers.LlamaConfig(**TINY),
    "qwen3": transformers.Qwen3Config(**TINY),
    "gemma3": transformers.Gemma3TextConfig(**TINY, sliding_window=4, sliding_window_pattern=2,
                                            final_logit_softcapping=10.0),
}
_ATTENTION_TARGETS = (torch.ops.infer.attention, torch.ops.infer.attention.default)


class CountingBackend:
    """Records each graph Dynamo hands over and runs it as is."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def attention_calls(self) -> list[torch.fx.Node]:
        return [n for g in self.graphs for n in g.graph.nodes
                if n.op == "call_function" and n.target in _ATTENTION_TARGETS]


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_fullgraph_compile_has_one_attention_op_per_layer(arch):
    torch._dynamo.reset()
    model = models.from_config(CONFIGS[arch], dtype=torch.float32)
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    ids = torch.randint(0, 96, (11,))
    positions = torch.arange(11)
    with torch.no_grad():
        got = compiled(ids, positions)
        expected = model(ids, positions)
    assert len(backend.graphs) == 1, "the forward must trace as a single graph"
    calls = backend.attention_calls()
    assert len(calls) == model.config.num_layers
    # In layer order, each with its own layer's name: the backend splits at these nodes and the op
    # looks up per-layer constants (window, softcap, KV cache) by this name.
    assert [n.args[4] for n in calls] == model.attention_layer_names
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_every_residual_add_meets_its_norm_in_one_fused_op(arch):
    """Two residual adds per layer, each fused with the norm after it (the next block's, or the final
    norm), except none before the first layer: 2 * layers ops, and the compiled model equals eager."""
    torch._dynamo.reset()
    model = models.from_config(CONFIGS[arch], dtype=torch.float32)
    backend = CountingBackend()
    ids, positions = torch.randint(0, 96, (9,)), torch.arange(9)
    with torch.no_grad():
        got = torch.compile(model, backend=backend, fullgraph=True)(ids, positions)
        expected = model(ids, positions)
    fused = [n for g in backend.graphs for n in g.graph.nodes
             if n.op == "call_function" and "add_rms_norm" in str(n.target)]
    assert len(fused) == 2 * model.config.num_layers
    # and no norm is left to Inductor but the first layer's input norm (Gemma's branch norms too)
    rsqrts = [n for g in backend.graphs for n in g.graph.nodes
              if n.op == "call_function" and "rsqrt" in str(n.target)]
    assert len(rsqrts) == 1
    assert torch.equal(got, expected)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_one_trace_serves_every_token_count(arch):
    """With the token dimension marked dynamic, 11 and 5 tokens reuse one graph: the model has no
    shape-dependent Python branch (rope gathers by position, no .item(), no host sync)."""
    torch._dynamo.reset()
    model = models.from_config(CONFIGS[arch], dtype=torch.float32)
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.no_grad():
        for num_tokens in (11, 5):
            ids = torch.randint(0, 96, (num_tokens,))
            positions = torch.arange(num_tokens)
            torch._dynamo.mark_dynamic(ids, 0)
            torch._dynamo.mark_dynamic(positions, 0)
            torch.testing.assert_close(compiled(ids, positions), model(ids, positions))
    assert len(backend.graphs) == 1


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_unbacked_token_count_covers_decode_of_one_token(arch):
    """Dynamo specializes a size of 1; with the token dimension unbacked, one graph serves decode
    (T = 1) and prefill alike, so the engine's single trace covers every batch."""
    torch._dynamo.reset()
    model = models.from_config(CONFIGS[arch], dtype=torch.float32)
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.no_grad():
        for num_tokens in (1, 6):
            ids = torch.randint(0, 96, (num_tokens,))
            positions = torch.arange(num_tokens)
            torch._dynamo.decorators.mark_unbacked(ids, 0)
            torch._dynamo.decorators.mark_unbacked(positions, 0)
            torch.testing.assert_close(compiled(ids, positions), model(ids, positions))
    assert len(backend.graphs) == 1
