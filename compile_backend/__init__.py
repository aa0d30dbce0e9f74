"""compile_backend: the Dynamo backend "infer_graphs" (split at attention, compile the pieces,
capture/replay one CUDA graph per piece per token count, dispatch by the forward context's mode).

Exports load on first use: the backend pulls in torch._dynamo and torch.fx (over a second), which a
caller that only needs the capture-size rule (engine/config.py) should not pay for."""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "InferGraphsBackend": "compile_backend.backend",
    "BackendConfig": "compile_backend.config",
    "default_capture_sizes": "compile_backend.config",
    "pad_to_capture_size": "compile_backend.config",
    "piecewise_context": "compile_backend.context",
    "GraphPool": "compile_backend.pool",
    "pool_bytes": "compile_backend.pool",
    "SplitSummary": "compile_backend.split",
    "BackendStats": "compile_backend.stats",
    "mark_token_dim": "compile_backend.tokens",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'compile_backend' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
