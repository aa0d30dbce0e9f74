"""The rotary embedding, and `torch.ops.infer.qk_norm_rope(qkv, cos, sin, q_weight, k_weight, eps,
unit_offset, num_heads, num_kv_heads) -> (q, k)`: the optional per-head q/k RMSNorm and the rotary
embedding of q and k, read from the fused qkv projection, in one kernel on CUDA.

`apply_rotary` is the half-split ("rotate_half") layout of HF checkpoints. The op's CPU
implementation is exactly the unfused model code (norm, round, rotate in the activation dtype); the
kernel rotates in float32 and rounds once, within one rounding of it.

The op is opaque to Dynamo and Inductor (a fake implementation gives the shapes): Inductor lowers
the norm and the rotary of q and of k as two to four kernels per layer (q and k are two outputs of
different shapes), each a few microseconds of a latency-bound decode step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from custom_ops.forward_context import RuntimeMode, get_forward_context
from custom_ops.norm import rms_norm
from custom_ops.registry import infer_op


@dataclass(frozen=True)
class QKRotary:
    """The per-head q/k RMSNorm (optional) and rotary that the attention op applies to raw q and k.

    Passed to `torch.ops.infer.attention` (cos, sin and the weights as tensors, eps and the norm
    variant from the layer's registry entry), so a decode step's attention kernel can normalize and
    rotate the one query row and key row it reads instead of a separate kernel writing them first."""
    cos: torch.Tensor  # [T, D / 2] or [T, 1, D / 2]: the step's rows
    sin: torch.Tensor
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    eps: float
    unit_offset: bool

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin as [T, D / 2] (views where the layout allows)."""
        return self.cos.reshape(self.cos.shape[0], -1), self.sin.reshape(self.sin.shape[0], -1)


def rotary_deferred() -> bool:
    """Whether this step leaves the q/k norm + rotary of ops called with ``defer_to_attention`` to the
    attention op: a uniform decode step that is not a piecewise replay (an eager step, or a FULL decode
    graph), where the decode attention kernel normalizes and rotates the rows it reads anyway.

    Piecewise replays keep the separate kernel: there it is recorded in the compute piece, while the
    attention op runs eagerly between pieces and another launch would be host time on every layer
    (~4.6 ms a 128-token gemma-3-1b step, measured). The rotary op and the attention op ask this of the
    same forward context, so they always agree on who does the work."""
    context = get_forward_context()
    if context is None or context.attn_metadata is None:
        return False
    return context.attn_metadata.is_uniform_decode and context.runtime_mode is not RuntimeMode.PIECEWISE


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by position, with cos / sin [T, 1, D / 2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def check_rope_tables(cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None,
                      k_weight: torch.Tensor | None, op: str = "infer.qk_norm_rope") -> int:
    """The head dim, once cos / sin and the optional norm weights agree (`op` names the caller)."""
    head_dim = 2 * cos.shape[-1]
    # Only static sizes are compared here: under Dynamo the token count is a symbol (unbacked for a
    # decode of one token), and the fake implementation runs this too.
    if cos.shape != sin.shape or cos.dim() not in (2, 3) or (cos.dim() == 3 and cos.shape[1] != 1):
        raise ValueError(f"{op}: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must both be "
                         "[tokens, head_dim / 2] or [tokens, 1, head_dim / 2]")
    if (q_weight is None) != (k_weight is None):
        raise ValueError(f"{op}: q_weight and k_weight are given together or not at all")
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        if weight is not None and weight.shape != (head_dim,):
            raise ValueError(f"{op}: {name} {tuple(weight.shape)} must be [head_dim {head_dim}]")
    return head_dim


def _check(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None,
           k_weight: torch.Tensor | None, num_heads: int, num_kv_heads: int) -> int:
    """The head dim, once the shapes agree."""
    head_dim = check_rope_tables(cos, sin, q_weight, k_weight)
    if qkv.dim() != 2 or qkv.shape[1] < (num_heads + num_kv_heads) * head_dim:
        raise ValueError(f"infer.qk_norm_rope: qkv {tuple(qkv.shape)} must be [tokens, >= (num_heads "
                         f"{num_heads} + num_kv_heads {num_kv_heads}) * head_dim {head_dim}]")
    return head_dim


def run_qk_norm_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None,
                     k_weight: torch.Tensor | None, eps: float, unit_offset: bool, num_heads: int,
                     num_kv_heads: int, defer_to_attention: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's implementation, callable directly by eager code (no dispatcher on the host path).

    ``defer_to_attention``: the caller also hands the raw q / k and these tables to the attention op
    (`torch.ops.infer.attention`'s raw_q ...); where `rotary_deferred()` the outputs are left unwritten
    (no kernel runs) and the attention op does the work."""
    head_dim = _check(qkv, cos, sin, q_weight, k_weight, num_heads, num_kv_heads)
    tokens = qkv.shape[0]
    if defer_to_attention and rotary_deferred():
        return (qkv.new_empty((tokens, num_heads, head_dim)), qkv.new_empty((tokens, num_kv_heads, head_dim)))
    q_size = num_heads * head_dim
    q = qkv[:, :q_size].view(tokens, num_heads, head_dim)
    k = qkv[:, q_size:q_size + num_kv_heads * head_dim].view(tokens, num_kv_heads, head_dim)
    return rotate_qk(q, k, QKRotary(cos, sin, q_weight, k_weight, eps, unit_offset))


def rotate_qk(q: torch.Tensor, k: torch.Tensor, rotary: QKRotary,
              store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw q [T, Hq, D] and k [T, Hkv, D] (any layout) -> normed and rotated, as new contiguous tensors.
    `store` (v, kv_cache, slot_mapping, n): also the rotated k and v of tokens 0..n-1 into the paged
    cache (custom_ops.triton_kv_store.store_kv), on CUDA in the rotary's own launch."""
    cos, sin = rotary.rows()
    if q.is_cuda:
        from custom_ops.triton_rope import qk_norm_rope_triton  # lazy: Triton only where it runs
        if store is not None:
            store = (_rows_of_heads(store[0]), *store[1:])
        return qk_norm_rope_triton(_rows_of_heads(q), _rows_of_heads(k), cos, sin, rotary.q_weight,
                                   rotary.k_weight, rotary.eps, rotary.unit_offset, store)
    q, k = _rotate_qk_torch(q, k, rotary, cos, sin)
    if store is not None:
        from custom_ops.triton_kv_store import store_kv  # the interpreter's tests of the Triton attention
        v, kv_cache, slot_mapping, num_store = store
        store_kv(k, v, kv_cache, slot_mapping, num_store)
    return q, k


def _rotate_qk_torch(q: torch.Tensor, k: torch.Tensor, rotary: QKRotary, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = q.shape[0]
    num_heads = q.shape[1]
    qk = torch.cat([q, k], dim=1)
    if rotary.q_weight is not None:  # q's weight on q's rows, k's on k's
        weight = torch.cat([rotary.q_weight.expand(num_heads, -1), rotary.k_weight.expand(k.shape[1], -1)])
        qk = rms_norm(qk, weight, rotary.eps, rotary.unit_offset)
    rotated = apply_rotary(qk, cos.reshape(tokens, 1, -1), sin.reshape(tokens, 1, -1))
    q, k = rotated.split([num_heads, k.shape[1]], dim=1)
    # Copies: views of one tensor would alias each other (not allowed of a custom op's outputs), and
    # contiguous is the layout the fake promises Inductor.
    return q.clone(memory_format=torch.contiguous_format), k.clone(memory_format=torch.contiguous_format)


def _rows_of_heads(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with each token's heads back to back (views of the fused projection are)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


@infer_op("qk_norm_rope")
def qk_norm_rope_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: Optional[torch.Tensor],
                    k_weight: Optional[torch.Tensor], eps: float, unit_offset: bool, num_heads: int,
                    num_kv_heads: int, defer_to_attention: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return run_qk_norm_rope(qkv, cos, sin, q_weight, k_weight, eps, unit_offset, num_heads, num_kv_heads,
                            defer_to_attention)


@qk_norm_rope_op.register_fake
def _qk_norm_rope_fake(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: Optional[torch.Tensor],
                       k_weight: Optional[torch.Tensor], eps: float, unit_offset: bool, num_heads: int,
                       num_kv_heads: int, defer_to_attention: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    head_dim = _check(qkv, cos, sin, q_weight, k_weight, num_heads, num_kv_heads)
    tokens = qkv.shape[0]
    return (qkv.new_empty((tokens, num_heads, head_dim)), qkv.new_empty((tokens, num_kv_heads, head_dim)))


def qk_norm_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None, eps: float, unit_offset: bool, num_heads: int,
                 num_kv_heads: int, defer_to_attention: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """What a model calls: the op while Dynamo traces, the implementation itself when eager."""
    if torch.compiler.is_compiling():
        return torch.ops.infer.qk_norm_rope(qkv, cos, sin, q_weight, k_weight, eps, unit_offset, num_heads,
                                            num_kv_heads, defer_to_attention)
    return run_qk_norm_rope(qkv, cos, sin, q_weight, k_weight, eps, unit_offset, num_heads, num_kv_heads,
                            defer_to_attention)
