"""The per-step context: what one forward needs beyond its input tensors.

The engine (or `compile_backend.piecewise_context` for other callers) sets it around a
forward; the attention op reads the metadata and the KV cache of its layer, the piecewise runners
read the runtime mode. The KV caches travel here (not in the layer registry) because they belong to
whoever runs the step: two engines over one model each pass their own, and a graph captured under
an engine's context records that engine's tensors. It is the only module-level mutable state, and
it refuses to nest so a stale context can never leak into the next step.
"""
from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

from custom_ops.metadata import AttentionMetadata


class RuntimeMode(enum.Enum):
    NONE = "none"            # compiled pieces, no graph
    PIECEWISE = "piecewise"  # one CUDA graph per piece per token-count bucket, attention eager
    FULL = "full"            # an outer native capture records the whole forward; pieces pass through


@dataclass(frozen=True)
class ForwardContext:
    attn_metadata: AttentionMetadata | None
    runtime_mode: RuntimeMode
    num_tokens: int  # the (padded) token count the forward runs with
    kv_caches: Mapping[str, torch.Tensor] | None = None  # layer name -> its paged KV cache
    # layer name -> the metadata of its KV group, for layers whose group has its own block tables and
    # slot mapping (sliding-window layers with their own pool, engine.kv.groups); others use attn_metadata
    group_metadata: Mapping[str, AttentionMetadata] | None = None


_current: ForwardContext | None = None


def get_forward_context() -> ForwardContext | None:
    return _current


@contextlib.contextmanager
def forward_context(
    attn_metadata: AttentionMetadata | None,
    runtime_mode: RuntimeMode = RuntimeMode.NONE,
    num_tokens: int | None = None,
    kv_caches: Mapping[str, torch.Tensor] | None = None,
    group_metadata: Mapping[str, AttentionMetadata] | None = None,
) -> Iterator[ForwardContext]:
    """`kv_caches` maps each attention layer's name to its cache; needed whenever attn_metadata is.
    `group_metadata`: per-layer metadata overriding attn_metadata (ForwardContext.group_metadata)."""
    global _current
    if _current is not None:
        raise RuntimeError("forward_context is already set: forward contexts do not nest")
    if num_tokens is None:
        if attn_metadata is None:
            raise ValueError("forward_context needs num_tokens when attn_metadata is None")
        num_tokens = int(attn_metadata.slot_mapping.shape[0])
    _current = ForwardContext(attn_metadata, RuntimeMode(runtime_mode), int(num_tokens), kv_caches, group_metadata)
    try:
        yield _current
    finally:
        _current = None
