"""`torch.ops.infer.attention(q, k, v, out, layer_name) -> None`: the one op every model calls.

It mutates `out` in place and returns nothing, so a graph split at this op hands `out` (allocated by
the piece before) to the piece after at a fixed address. The fake implementation is shape-only; the
real one dispatches to Triton kernels on CUDA and to the plain-torch reference elsewhere.
"""
from __future__ import annotations

import torch

from custom_ops import reference
from custom_ops.forward_context import get_forward_context
from custom_ops.layers import get_attention_layer


def run_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer_name: str) -> None:
    """The op's implementation, callable directly (no dispatcher cost) by graph runners between pieces."""
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
