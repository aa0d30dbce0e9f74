"""compile_model: the model under torch.compile with the infer_graphs backend, configured from the engine.

The backend's capture sizes are the engine's prefill graph sizes, so the dispatcher's PIECEWISE table
and the graphs the pieces hold are the same list. With prefill graphs off the backend never captures
(cudagraphs=False): NONE steps run the compiled pieces, FULL steps pass through to the decode graphs.

`unsplit=True` compiles the variant the decode graphs record under EngineConfig.full_graph_compile
"unsplit": no splitting ops, so the whole forward (attention op included) is one Inductor graph whose
fusions cross layer boundaries; it never captures graphs of its own (the decode capture records it).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from engine.config import EngineConfig


def compile_model(model: torch.nn.Module, config: EngineConfig, pool: Any = None, unsplit: bool = False,
                  ) -> tuple[Callable[..., torch.Tensor], Callable[..., None], Any]:
    """(compiled forward, token-dim marker to call before each forward, the backend for its stats).

    `pool`: the graph pool handle the backend captures into (the engine's, shared with its decode
    graphs); None means compile_backend.graph_pool().
    """
    from compile_backend import BackendConfig, InferGraphsBackend, mark_token_dim

    backend = InferGraphsBackend(BackendConfig(
        splitting_ops=() if unsplit else ("infer::attention",),
        piece_compiler=config.piece_compiler,
        capture_sizes=tuple(config.prefill_graph_sizes),
        cudagraphs=bool(config.prefill_graphs) and not unsplit,
    ), pool=pool)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    return compiled, mark_token_dim, backend
