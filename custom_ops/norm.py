"""RMSNorm, and `torch.ops.infer.add_rms_norm(h, delta, weight, eps, unit_offset, delta_weight=None)
-> (sum, normed)`: the residual add and the norm after it in one kernel on CUDA (and, with
`delta_weight`, Gemma 3's norm of the branch before the add).

`rms_norm` is the rounding contract every model here follows (transformers' own order, which bf16
parity depends on): normalize in float32; Llama / Qwen3 round to the input dtype and then scale by w
in that dtype, Gemma (`unit_offset`) scales by (1 + w) in float32 and rounds once. The fused op
returns `h + delta` rounded to h's dtype and `rms_norm` of that rounded sum, so fusing changes no bit
of what the unfused code defines; on the CPU it is that code.

The op is opaque to Dynamo and Inductor (a fake implementation gives the shapes): Inductor lowers
the add and the norm to a looping reduction, a normalize and the add again for its other consumer
(three or more launches per norm at decode sizes, each a few microseconds of a latency-bound step),
where the kernel does it in one pass per row.
"""
from __future__ import annotations

from typing import Optional

import torch
from custom_ops.registry import infer_op


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """RMSNorm over the last dim; `weight` broadcasts against x, e.g. one row per head."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (xf * (1.0 + weight.float())).to(x.dtype)
    return weight * xf.to(x.dtype)


def _check(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, delta_weight: torch.Tensor | None,
           tokens: bool = True) -> None:
    """`tokens=False` (the fake implementation) leaves the leading, symbolic, sizes out: comparing them
    is sympy work on every trace and compile, ~0.5 s of a gemma-3-1b start-up."""
    shapes_differ = h.shape != delta.shape if tokens else (h.dim() != delta.dim() or h.shape[-1] != delta.shape[-1])
    if shapes_differ or h.dtype != delta.dtype or h.device != delta.device:
        raise ValueError(f"infer.add_rms_norm: h {tuple(h.shape)} {h.dtype} on {h.device} and delta "
                         f"{tuple(delta.shape)} {delta.dtype} on {delta.device} must match")
    if h.dim() == 0 or weight.shape != h.shape[-1:]:
        raise ValueError(f"infer.add_rms_norm: weight {tuple(weight.shape)} must be [hidden] for h "
                         f"{tuple(h.shape)}")
    if delta_weight is not None and delta_weight.shape != weight.shape:
        raise ValueError(f"infer.add_rms_norm: delta_weight {tuple(delta_weight.shape)} must be [hidden] "
                         f"like weight {tuple(weight.shape)}")


def run_add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                     unit_offset: bool, delta_weight: torch.Tensor | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's implementation, callable directly by eager code (no dispatcher on the host path).
    `delta_weight`: delta is first normalized with it (the same eps and variant), rounded, then added."""
    _check(h, delta, weight, delta_weight)
    if not h.is_cuda:
        if delta_weight is not None:
            delta = rms_norm(delta, delta_weight, eps, unit_offset)
        total = (h + delta).contiguous()  # the layout the fake promises Inductor
        return total, rms_norm(total, weight, eps, unit_offset).contiguous()
    from custom_ops.triton_rms_norm import add_rms_norm_triton  # lazy: Triton only where it runs
    shape = h.shape
    rows = (h if h.stride(-1) == 1 else h.contiguous()).reshape(-1, shape[-1])
    deltas = (delta if delta.stride(-1) == 1 else delta.contiguous()).reshape(-1, shape[-1])
    total, normed = add_rms_norm_triton(rows, deltas, weight, eps, unit_offset, delta_weight)
    return total.view(shape), normed.view(shape)


@infer_op("add_rms_norm")
def add_rms_norm_op(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                    unit_offset: bool, delta_weight: Optional[torch.Tensor] = None,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    return run_add_rms_norm(h, delta, weight, eps, unit_offset, delta_weight)


@add_rms_norm_op.register_fake
def _add_rms_norm_fake(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                       unit_offset: bool, delta_weight: Optional[torch.Tensor] = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    _check(h, delta, weight, delta_weight, tokens=False)
    return torch.empty_like(h, memory_format=torch.contiguous_format), \
        torch.empty_like(h, memory_format=torch.contiguous_format)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 unit_offset: bool, delta_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What a model calls: the op while Dynamo traces, the implementation itself when eager."""
    if torch.compiler.is_compiling():
        return torch.ops.infer.add_rms_norm(h, delta, weight, eps, unit_offset, delta_weight)
    return run_add_rms_norm(h, delta, weight, eps, unit_offset, delta_weight)
