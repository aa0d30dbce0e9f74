"""compile_backend: the Dynamo backend "infer_graphs" (split at attention, compile the pieces,
capture/replay one CUDA graph per piece per token count, dispatch by the forward context's mode)."""
from compile_backend.backend import InferGraphsBackend
from compile_backend.config import BackendConfig, default_capture_sizes, pad_to_capture_size
from compile_backend.context import piecewise_context
from compile_backend.pool import GraphPool, pool_bytes
from compile_backend.split import SplitSummary
from compile_backend.stats import BackendStats
from compile_backend.tokens import mark_token_dim

__all__ = [
    "InferGraphsBackend", "BackendConfig", "default_capture_sizes", "pad_to_capture_size",
    "piecewise_context", "GraphPool", "pool_bytes", "SplitSummary", "BackendStats", "mark_token_dim",
]
