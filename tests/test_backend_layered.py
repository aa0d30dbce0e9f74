"""full_graph_compile="layered": FULL steps run one Inductor graph per decoder layer, the attention op
inside, identical layers compiled once and run under their own layer's name.

The reference is the model itself, eager. Gemma 3 (sliding and full layers alternating, 7 tokens
against a window of 4) fails if a shared compile ran a layer under another layer's name: the window
is the named layer's, looked up when the op runs."""
from __future__ import annotations

import importlib

import pytest
import torch

import models
from compile_backend import BackendConfig, InferGraphsBackend
from compile_backend.layered import RenamedLayer
from custom_ops import RuntimeMode, attention_layer_renamed, forward_context
from custom_ops.attention import run_attention
from tests.test_backend_helpers import ARCHS, hf_config, random_inputs, run_marked

LAYERS = 5


@pytest.mark.parametrize("arch", ARCHS)
def test_layered_full_steps_equal_the_model_with_one_compile_per_distinct_layer(arch):
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = models.from_config(hf_config(arch, num_hidden_layers=LAYERS), dtype=torch.float32)
    backend = InferGraphsBackend(BackendConfig(full_graph_compile="layered"))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    ids, positions = random_inputs(7, 96)
    with torch.no_grad():
        expected = model(ids, positions)
        with forward_context(None, RuntimeMode.FULL, 7):
            full = run_marked(compiled, ids, positions)
        pieces = compiled(ids, positions)  # NONE: the split pieces, from the same trace
    torch.testing.assert_close(full, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pieces, expected, rtol=1e-4, atol=1e-4)
    stats = backend.stats
    assert stats.graphs_compiled == 1 and stats.full_steps == 1
    assert stats.full_graph_pieces == LAYERS + 1  # a graph per attention layer, then the tail
    # the head (embedding + layer 0), one middle layer, the tail
    assert stats.full_graph_compilations == 3


def test_the_renamed_name_resolves_when_the_op_runs_and_blocks_nest():
    q = torch.randn(3, 2, 4)

    def attend(name: str) -> None:
        run_attention(q, q[:, :1], q[:, :1], torch.empty_like(q), name)

    with attention_layer_renamed({"x.attn": "no.such.layer"}):
        with pytest.raises(KeyError, match="no.such.layer"):
            attend("x.attn")
        with attention_layer_renamed({"x.attn": "other.missing"}):
            with pytest.raises(KeyError, match="other.missing"):
                attend("x.attn")
        with pytest.raises(KeyError, match="no.such.layer"):  # the outer mapping is back
            attend("x.attn")
    with pytest.raises(KeyError, match="x.attn"):
        attend("x.attn")


def test_a_renamed_layer_calls_its_compiled_code_inside_the_renaming():
    attention_module = importlib.import_module("custom_ops.attention")  # the package exports the op by this name
    seen = []
    layer = RenamedLayer(lambda *args: seen.append((args, dict(attention_module._renamed))), {"a": "b"})
    layer(1, 2)
    assert seen == [((1, 2), {"a": "b"})] and not attention_module._renamed


def test_a_second_model_instance_finds_every_full_step_graph_in_inductors_cache(tmp_path, monkeypatch):
    """The compiled layers name canonical layers, not the instance's prefix (llama_0, llama_1, ...):
    a second engine in the same process compiles nothing again."""
    from torch._dynamo.utils import counters
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    misses = []
    for _ in range(2):
        torch._dynamo.reset()
        counters.clear()
        model = models.from_config(hf_config("llama", num_hidden_layers=4), dtype=torch.float32)
        compiled = torch.compile(model, backend=InferGraphsBackend(BackendConfig(full_graph_compile="layered")),
                                 fullgraph=True)
        ids, positions = random_inputs(7, 96)
        with torch.no_grad(), forward_context(None, RuntimeMode.FULL, 7):
            run_marked(compiled, ids, positions)
        misses.append(counters["inductor"]["fxgraph_cache_miss"])
    assert misses[0] > 0 and misses[1] == 0
