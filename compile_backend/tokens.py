"""mark_token_dim: make one Dynamo trace serve every token count, 1 included.

Why unbacked and not `mark_dynamic`: Dynamo specializes sizes 0 and 1, so with mark_dynamic a
decode-sized step (1 token) gets its own graph, and a first call at 1 token yields a graph that
recompiles at 2. `backed_size_oblivious` is not enough either: a `view` of a non-contiguous slice
(q/k/v split from one projection) still guards on `size == 1`. An unbacked size has no value to
specialize on, so the trace holds for every count (checked on torch 2.11 and 2.13). The cost:
model code may not branch on the token count (`if T > 1`) — Dynamo raises on such a branch.

Usage, before each call (cheap; only the first call's marks matter, later calls reuse the graph):

    mark_token_dim(input_ids, positions)
    hidden = compiled_model(input_ids, positions)
"""
from __future__ import annotations

import inspect

import torch
from torch._dynamo.decorators import mark_unbacked

# One shape id for every marked tensor: input_ids and positions share one symbol, so the graph
# does not carry an equality assertion per pair of inputs (older torch lacks the argument).
_SHAPE_ID = "infer_graphs_tokens"
_HAS_SHAPE_ID = "shape_id" in inspect.signature(mark_unbacked).parameters


def mark_token_dim(*tensors: torch.Tensor, dim: int = 0) -> None:
    """Mark `dim` (the flat token dimension) of each tensor as the symbolic token count."""
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"mark_token_dim expects tensors, got {type(t).__name__}")
        if _HAS_SHAPE_ID:
            mark_unbacked(t, dim, shape_id=_SHAPE_ID)
        else:
            mark_unbacked(t, dim)
