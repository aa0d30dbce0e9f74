"""The `infer_graphs` entry point (setup.cfg, group torch_dynamo_backends).

torch discovers the entry point lazily, so `torch.compile(model, backend="infer_graphs")` works in a
fresh process; registering the name again in code would raise. Each traced graph gets its own backend
with the default config; for stats, explicit capture or another config pass an InferGraphsBackend.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch.fx

from compile_backend.backend import InferGraphsBackend


def infer_graphs_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    return InferGraphsBackend()(gm, example_inputs)
