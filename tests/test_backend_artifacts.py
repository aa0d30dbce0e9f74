"""compile_backend/artifacts.py: a compiled graph written by one backend and loaded by another computes
what the compiled one did, in NONE and FULL steps, for each FULL-step compile; a damaged file is an
ArtifactError naming it. CPU; Gemma 3 (sliding and full layers: a layer run under another's name
gives other values)."""
from __future__ import annotations

import pytest
import torch

import models
from compile_backend import BackendConfig, InferGraphsBackend
from compile_backend.artifacts import ArtifactError, ArtifactSink, load_graph
from custom_ops import RuntimeMode, forward_context
from tests.test_backend_helpers import hf_config, random_inputs, run_marked


def _compiled_and_saved(model, config: BackendConfig, directory):
    """(backend, compiled model, the arguments Dynamo passed to the backend's graph at the first call)."""
    backend = InferGraphsBackend(config, artifacts=ArtifactSink(directory))
    calls = []

    def spy(gm, example_inputs):
        handle = backend(gm, example_inputs)

        def call(*args):
            calls.append(args)
            return handle(*args)
        return call

    return backend, torch.compile(model, backend=spy, fullgraph=True), calls


@pytest.mark.parametrize("piece_compiler", ["inductor", "eager"])
def test_a_loaded_graph_computes_what_the_compiled_one_did(tmp_path, piece_compiler):
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = models.from_config(hf_config("gemma3", num_hidden_layers=2), dtype=torch.float32)
    config = BackendConfig(piece_compiler=piece_compiler)
    backend, compiled, calls = _compiled_and_saved(model, config, tmp_path)
    ids, positions = random_inputs(7, 96)
    with torch.no_grad():
        expected = model(ids, positions)
        with forward_context(None, RuntimeMode.FULL, 7):
            full = run_marked(compiled, ids, positions)
        none = compiled(ids, positions)
    assert backend.artifacts.saved == 1 and backend.artifacts.failure is None

    loader = InferGraphsBackend(config, warm_workers=False)
    handle, meta = loader.load(tmp_path / "graph0", model.attention_layer_names)
    assert meta["num_outputs"] == 1 and loader.stats.graphs_loaded == 1 and loader.stats.graphs_compiled == 0
    args = calls[0]
    with torch.no_grad():
        with forward_context(None, RuntimeMode.FULL, 7):
            (loaded_full,) = handle(*args)
        (loaded_none,) = handle(*args)
    for got in (full, none, loaded_full, loaded_none):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(loaded_full, full, rtol=0, atol=0)
    torch.testing.assert_close(loaded_none, none, rtol=0, atol=0)


def test_a_missing_or_damaged_file_is_an_artifact_error_naming_it(tmp_path):
    torch._dynamo.reset()
    model = models.from_config(hf_config("llama", num_hidden_layers=2), dtype=torch.float32)
    _, compiled, _ = _compiled_and_saved(model, BackendConfig(piece_compiler="eager"), tmp_path)
    ids, positions = random_inputs(5, 96)
    with torch.no_grad():
        run_marked(compiled, ids, positions)
    graph = tmp_path / "graph0"
    load_graph(graph)  # intact
    piece = next(graph.glob("a1.*"))
    piece.write_bytes(piece.read_bytes()[:-1])
    with pytest.raises(ArtifactError, match=f"{piece.name}: .* bytes, the manifest says .* \\(truncated"):
        load_graph(graph)
    piece.unlink()
    with pytest.raises(ArtifactError, match=f"{piece.name}: missing"):
        load_graph(graph)
    (graph / "manifest.json").unlink()
    with pytest.raises(ArtifactError, match="manifest.json: unreadable"):
        load_graph(graph)
    with pytest.raises(ArtifactError, match="the graph calls 2 layers, the model has 1"):
        (graph / "manifest.json").write_text("{}")
        load_graph(graph, ["only.one"])
