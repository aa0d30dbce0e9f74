"""`torch.ops.infer.linear_rope(x, weight, bias, cos, sin, num_heads, num_kv_heads) -> (qkv, q, k)`:
a fused q/k/v projection and the rotary embedding of its q and k heads, for layers without q/k
norms (Llama). `qkv` is the whole projection (attention reads its v columns as a view), `q` and `k`
the rotated heads as new contiguous tensors: exactly `linear` followed by `qk_norm_rope`.

At one row on CUDA, where the GEMV table has the projection's shape, this is one Triton launch
(custom_ops.triton_gemv_rope: the rotary in the GEMV's epilogue, one kernel and one launch-to-launch
gap fewer per layer of a batch-1 decode step). Everywhere else it runs the two ops' implementations,
as the model ran them before. Like `infer.linear` the op is opaque to Dynamo: the pieces call it, and
the graphs that record them record the kernel it chose.

`weight_scale`: an FP8 weight's float32 scale per row (custom_ops.fp8); the one-launch kernel reads
the FP8 weight where the FP8 table (custom_ops.gemv_table.fp8_config) picks a GEMV tile that fits.
"""
from __future__ import annotations

from typing import Optional

import torch

from custom_ops.gemv_table import GemvConfig, fp8_config
from custom_ops.linear import run_linear, table_config
from custom_ops.rope import check_rope_tables, run_qk_norm_rope
from custom_ops.registry import infer_op


def _fused_config(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  head_dim: int, weight_scale: torch.Tensor | None = None) -> GemvConfig | None:
    """The GEMV tile the one-launch path runs with, or None for the two ops."""
    if bias is not None or x.shape[0] != 1:
        return None
    if weight_scale is None:
        config = table_config(x, weight, 1)
    else:
        choice = fp8_config(1, *weight.shape, x.dtype, x.device.type, x.device.index)
        config = choice if isinstance(choice, GemvConfig) else None
    if config is None:
        return None
    from custom_ops.triton_gemv_rope import fits  # lazy: Triton only where a GEMV runs
    return config if fits(config, head_dim) else None


def _check(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
           num_kv_heads: int) -> int:
    """The head dim, once the shapes agree."""
    head_dim = check_rope_tables(cos, sin, None, None, op="infer.linear_rope")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"infer.linear_rope: x {tuple(x.shape)} must be [tokens, K] for weight "
                         f"{tuple(weight.shape)} [N, K]")
    if weight.shape[0] < (num_heads + num_kv_heads) * head_dim:
        raise ValueError(f"infer.linear_rope: weight {tuple(weight.shape)} has fewer than (num_heads {num_heads} + "
                         f"num_kv_heads {num_kv_heads}) * head_dim {head_dim} rows")
    return head_dim


def run_linear_rope(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor,
                    sin: torch.Tensor, num_heads: int, num_kv_heads: int, weight_scale: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's implementation, callable directly by eager code."""
    head_dim = _check(x, weight, cos, sin, num_heads, num_kv_heads)
    config = _fused_config(x, weight, bias, head_dim, weight_scale)
    if config is None:
        qkv = run_linear(x, weight, bias, weight_scale=weight_scale)
        q, k = run_qk_norm_rope(qkv, cos, sin, None, None, 0.0, False, num_heads, num_kv_heads)
        return qkv, q, k
    from custom_ops.triton_gemv_rope import gemv_rope
    x = x if x.stride(-1) == 1 else x.contiguous()
    half = head_dim // 2
    return gemv_rope(x, weight, cos.reshape(half), sin.reshape(half), config, num_heads, num_kv_heads, weight_scale)


@infer_op("linear_rope")
def linear_rope_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], cos: torch.Tensor,
                   sin: torch.Tensor, num_heads: int, num_kv_heads: int, weight_scale: Optional[torch.Tensor] = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return run_linear_rope(x, weight, bias, cos, sin, num_heads, num_kv_heads, weight_scale)


@linear_rope_op.register_fake
def _linear_rope_fake(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], cos: torch.Tensor,
                      sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                      weight_scale: Optional[torch.Tensor] = None,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    head_dim = _check(x, weight, cos, sin, num_heads, num_kv_heads)
    tokens = x.shape[0]
    return (x.new_empty((tokens, weight.shape[0])), x.new_empty((tokens, num_heads, head_dim)),
            x.new_empty((tokens, num_kv_heads, head_dim)))


def linear_rope(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, num_heads: int, num_kv_heads: int, weight_scale: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a model calls: the op while Dynamo traces, the implementation itself when eager."""
    if torch.compiler.is_compiling():
        if weight_scale is None:
            return torch.ops.infer.linear_rope(x, weight, bias, cos, sin, num_heads, num_kv_heads)
        return torch.ops.infer.linear_rope(x, weight, bias, cos, sin, num_heads, num_kv_heads, weight_scale)
    return run_linear_rope(x, weight, bias, cos, sin, num_heads, num_kv_heads, weight_scale)
