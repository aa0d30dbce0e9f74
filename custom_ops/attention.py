"""`torch.ops.infer.attention(q, k, v, out, layer_name) -> None`: the one op every model calls.

It mutates `out` in place and returns nothing, so a graph split at this op hands `out` (allocated by
the piece before) to the piece after at a fixed address. The fake implementation is shape-only; the
real one dispatches to Triton kernels on CUDA and to the plain-torch reference elsewhere.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from custom_ops import reference
from custom_ops.forward_context import get_forward_context
from custom_ops.layers import get_attention_layer

# layer name compiled into a piece -> the layer it computes now (see `attention_layer_renamed`)
_renamed: dict[str, str] = {}


@contextlib.contextmanager
def attention_layer_renamed(renamed: dict[str, str]) -> Iterator[None]:
    """Inside the block, an attention call that names layer A computes layer `renamed[A]`.

    For code compiled once and run for many layers: the compiled code of one decoder layer calls this
    op with that layer's name as a constant, and the same code serves every identical layer (weights
    are its inputs) when the caller renames the layer around each call. The name resolves when the op
    runs, so a graph captured inside the block records the renamed layer's cache and parameters."""
    global _renamed
    previous, _renamed = _renamed, renamed
    try:
        yield
    finally:
        _renamed = previous


def run_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer_name: str) -> None:
    """The op's implementation, callable directly (no dispatcher cost) by graph runners between pieces."""
    if _renamed:
        layer_name = _renamed.get(layer_name, layer_name)
    layer = get_attention_layer(layer_name)
    context = get_forward_context()
    meta = context.attn_metadata if context is not None else None
    if meta is None:
        if q.is_cuda:
            from custom_ops.triton_attention import dense_causal_attention
            dense_causal_attention(q, k, v, out, layer)
        else:
            out.copy_(reference.causal_attention(q, k, v, layer).to(out.dtype))
        return
    if context.group_metadata is not None:  # the layer's KV group has its own block tables (engine.kv_groups)
        meta = context.group_metadata.get(layer_name, meta)
    kv_cache = context.kv_caches.get(layer_name) if context.kv_caches is not None else None
    if kv_cache is None:
        raise RuntimeError(
            f"attention layer {layer_name!r} runs with attention metadata but the forward context has no "
            "KV cache for it (forward_context(..., kv_caches={layer_name: cache}))")
    if q.is_cuda:
        from custom_ops.triton_attention import paged_attention
        paged_attention(q, k, v, out, layer, kv_cache, meta)
    else:
        reference.paged_attention(q, k, v, out, layer, kv_cache, meta)


@torch.library.custom_op("infer::attention", mutates_args=("out",))
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer_name: str) -> None:
    run_attention(q, k, v, out, layer_name)


@attention.register_fake
def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer_name: str) -> None:
    return None
