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

from typing import Optional

import torch

from custom_ops.norm import rms_norm


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
                     num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's implementation, callable directly by eager code (no dispatcher on the host path)."""
    head_dim = _check(qkv, cos, sin, q_weight, k_weight, num_heads, num_kv_heads)
    tokens = qkv.shape[0]
    if qkv.is_cuda and qkv.stride(-1) == 1:
        from custom_ops.triton_rope import qk_norm_rope_triton  # lazy: Triton only where it runs
        return qk_norm_rope_triton(qkv, cos.reshape(tokens, -1), sin.reshape(tokens, -1), q_weight, k_weight,
                                   eps, unit_offset, num_heads, num_kv_heads)
    qk = qkv[:, :(num_heads + num_kv_heads) * head_dim].reshape(tokens, num_heads + num_kv_heads, head_dim)
    if q_weight is not None:  # q's weight on q's rows, k's on k's
        weight = torch.cat([q_weight.expand(num_heads, -1), k_weight.expand(num_kv_heads, -1)])
        qk = rms_norm(qk, weight, eps, unit_offset)
    rotated = apply_rotary(qk, cos.reshape(tokens, 1, -1), sin.reshape(tokens, 1, -1))
    q, k = rotated.split([num_heads, num_kv_heads], dim=1)
    # Copies: views of one tensor would alias each other (not allowed of a custom op's outputs), and
    # contiguous is the layout the fake promises Inductor.
    return q.clone(memory_format=torch.contiguous_format), k.clone(memory_format=torch.contiguous_format)


@torch.library.custom_op("infer::qk_norm_rope", mutates_args=())
def qk_norm_rope_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: Optional[torch.Tensor],
                    k_weight: Optional[torch.Tensor], eps: float, unit_offset: bool, num_heads: int,
                    num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    return run_qk_norm_rope(qkv, cos, sin, q_weight, k_weight, eps, unit_offset, num_heads, num_kv_heads)


@qk_norm_rope_op.register_fake
def _qk_norm_rope_fake(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: Optional[torch.Tensor],
                       k_weight: Optional[torch.Tensor], eps: float, unit_offset: bool, num_heads: int,
                       num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    head_dim = _check(qkv, cos, sin, q_weight, k_weight, num_heads, num_kv_heads)
    tokens = qkv.shape[0]
    return (qkv.new_empty((tokens, num_heads, head_dim)), qkv.new_empty((tokens, num_kv_heads, head_dim)))


def qk_norm_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None, eps: float, unit_offset: bool, num_heads: int,
                 num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a model calls: the op while Dynamo traces, the implementation itself when eager."""
    if torch.compiler.is_compiling():
        return torch.ops.infer.qk_norm_rope(qkv, cos, sin, q_weight, k_weight, eps, unit_offset, num_heads,
                                            num_kv_heads)
    return run_qk_norm_rope(qkv, cos, sin, q_weight, k_weight, eps, unit_offset, num_heads, num_kv_heads)
