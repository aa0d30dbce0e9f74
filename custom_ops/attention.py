"""`torch.ops.infer.attention(q, k, v, out, layer_name, raw_q=None, raw_k=None, cos=None, sin=None,
q_weight=None, k_weight=None) -> None`: the one op every model calls.

It mutates `out` in place and returns nothing, so a graph split at this op hands `out` (allocated by
the piece before) to the piece after at a fixed address. The fake implementation is shape-only; the
real one dispatches to Triton kernels on CUDA and to the plain-torch reference elsewhere.

The optional arguments say how q and k were made: raw_q / raw_k as the projection wrote them, then
(with q_weight / k_weight) the per-head RMSNorm, eps and variant from the layer's registry entry,
then the rotary by cos / sin, by `infer.qk_norm_rope(..., defer_to_attention=True)`. Where that op
deferred (custom_ops.rope.rotary_deferred: decode steps outside piecewise replays) q and k were left
unwritten, and this op normalizes and rotates raw_q / raw_k itself: inside the decode attention
kernel (custom_ops.triton_decode), one kernel per layer fewer.
"""
from __future__ import annotations

from typing import Optional

import torch

from custom_ops import reference
from custom_ops.forward_context import get_forward_context
from custom_ops.layers import AttentionLayer, get_attention_layer
from custom_ops.rope import QKRotary, check_rope_tables, rotary_deferred, rotate_qk
from custom_ops.registry import infer_op

def _rotary(layer: AttentionLayer, layer_name: str, raw_q: torch.Tensor | None, raw_k: torch.Tensor | None,
            cos: torch.Tensor | None, sin: torch.Tensor | None, q_weight: torch.Tensor | None,
            k_weight: torch.Tensor | None) -> QKRotary:
    if raw_q is None or raw_k is None or cos is None or sin is None:
        raise ValueError(f"infer.attention (layer {layer_name!r}): raw_q, raw_k, cos and sin are given together, "
                         "and q_weight / k_weight only with them")
    head_dim = check_rope_tables(cos, sin, q_weight, k_weight, op=f"infer.attention (layer {layer_name!r})")
    if head_dim != layer.head_dim:
        raise ValueError(f"infer.attention (layer {layer_name!r}): cos {tuple(cos.shape)} is for head_dim "
                         f"{head_dim}, the layer's is {layer.head_dim}")
    return QKRotary(cos, sin, q_weight, k_weight, layer.qk_norm_eps, layer.qk_norm_unit_offset)


def run_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer_name: str,
                  raw_q: torch.Tensor | None = None, raw_k: torch.Tensor | None = None,
                  cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                  q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None) -> None:
    """The op's implementation, callable directly (no dispatcher cost) by graph runners between pieces."""
    layer = get_attention_layer(layer_name)
    rotary = None
    # Checked and read only where the rotary op deferred: a piecewise prefill runs this op eagerly on
    # every layer, and its q / k are already the rotated ones.
    if (raw_q is not None or cos is not None) and rotary_deferred():
        rotary = _rotary(layer, layer_name, raw_q, raw_k, cos, sin, q_weight, k_weight)
        q, k = raw_q, raw_k  # q and k were left unwritten: this op applies the norm and rotary
    context = get_forward_context()
    meta = context.attn_metadata if context is not None else None
    if meta is None:  # never a deferring step (rotary_deferred needs metadata)
        if q.is_cuda:
            from custom_ops.triton_attention import dense_causal_attention
            dense_causal_attention(q, k, v, out, layer)
        else:
            out.copy_(reference.causal_attention(q, k, v, layer).to(out.dtype))
        return
    if context.group_metadata is not None:  # the layer's KV group has its own block tables (engine.kv.groups)
        meta = context.group_metadata.get(layer_name, meta)
    kv_cache = context.kv_caches.get(layer_name) if context.kv_caches is not None else None
    if kv_cache is None:
        raise RuntimeError(
            f"attention layer {layer_name!r} runs with attention metadata but the forward context has no "
            "KV cache for it (forward_context(..., kv_caches={layer_name: cache}))")
    if q.is_cuda:
        from custom_ops.triton_attention import paged_attention
        paged_attention(q, k, v, out, layer, kv_cache, meta, rotary=rotary)
    else:
        if rotary is not None:
            q, k = rotate_qk(q, k, rotary)
        reference.paged_attention(q, k, v, out, layer, kv_cache, meta)


@infer_op("attention", mutates_args=("out",))
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer_name: str,
              raw_q: Optional[torch.Tensor] = None, raw_k: Optional[torch.Tensor] = None,
              cos: Optional[torch.Tensor] = None, sin: Optional[torch.Tensor] = None,
              q_weight: Optional[torch.Tensor] = None, k_weight: Optional[torch.Tensor] = None) -> None:
    run_attention(q, k, v, out, layer_name, raw_q, raw_k, cos, sin, q_weight, k_weight)


@attention.register_fake
def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer_name: str,
                    raw_q: Optional[torch.Tensor] = None, raw_k: Optional[torch.Tensor] = None,
                    cos: Optional[torch.Tensor] = None, sin: Optional[torch.Tensor] = None,
                    q_weight: Optional[torch.Tensor] = None, k_weight: Optional[torch.Tensor] = None) -> None:
    return None
