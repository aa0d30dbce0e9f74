"""Triton kernel for the residual add and the RMSNorm after it, in one pass over each row (with
Gemma 3's norm on the branch before the add, too).

A pre-norm block ends `h = h + delta` and the next block starts `norm(h)`: two reads and two writes
of the row in three or more kernels as Inductor lowers them (a looping reduction, the normalize,
and the add recomputed for its consumers). Here one program owns one row: it adds, rounds the sum
to the activation dtype and stores it (the next residual), and normalizes that rounded sum, so the
output is bit-for-bit what the unfused code computes with the same rounding (custom_ops.norm).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops.pdl import launch_with_pdl, pdl_launch_options
from custom_ops.triton_common import next_power_of_2
from custom_ops.triton_launch import launch


@triton.jit
def scale_normed(normed, weight, UNIT_OFFSET: tl.constexpr, dtype: tl.constexpr):
    """A normalized float32 value scaled by its norm weight in the models' rounding order
    (custom_ops.norm.rms_norm), rounded to dtype; shared with the q/k norm of custom_ops.triton_rope."""
    if UNIT_OFFSET:
        return (normed * (1.0 + weight)).to(dtype)  # Gemma: scaled in float32, rounded once
    return (weight * normed.to(dtype).to(tl.float32)).to(dtype)  # Llama / Qwen3: rounded, then scaled


@triton.jit
def _rms_norm_row(x, weight, hidden, eps, UNIT_OFFSET: tl.constexpr, dtype: tl.constexpr):
    """One row's RMSNorm, rounded to dtype; masked-off lanes hold zeros and add nothing to the sum."""
    return scale_normed(x * tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps), weight, UNIT_OFFSET, dtype)


@triton.jit
def _add_rms_norm_kernel(
    h_ptr, delta_ptr, weight_ptr, delta_weight_ptr, sum_ptr, out_ptr,
    stride_h, stride_delta, stride_sum, stride_out,
    hidden, eps,
    UNIT_OFFSET: tl.constexpr, DELTA_NORM: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    # The weight is this layer's own: loaded before the PDL wait, while the kernel that wrote h or
    # delta may still be finishing.
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if DELTA_NORM:
        delta_weight = tl.load(delta_weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    h = tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
    delta = tl.load(delta_ptr + row * stride_delta + offs, mask=mask, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if DELTA_NORM:  # Gemma's norm on the branch, before the add; rounded as its own output would be
        delta = _rms_norm_row(delta, delta_weight, hidden, eps, UNIT_OFFSET, out_ptr.dtype.element_ty)
        delta = delta.to(tl.float32)
    total = (h + delta).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * stride_sum + offs, total, mask=mask)
    # the norm reads the rounded sum, as the unfused code does
    y = _rms_norm_row(total.to(tl.float32), weight, hidden, eps, UNIT_OFFSET, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + offs, y, mask=mask)


def add_rms_norm_triton(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool,
    delta_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta)) for 2-D h, delta [T, H] with a contiguous last dim; new tensors.
    With `delta_weight`, delta is first normalized with it (same eps and variant). The caller
    (custom_ops.norm) has checked shapes and dtypes."""
    rows, hidden = h.shape
    total = torch.empty((rows, hidden), dtype=h.dtype, device=h.device)
    out = torch.empty_like(total)
    if rows == 0:
        return total, out
    block = next_power_of_2(hidden)
    pdl = launch_with_pdl(h.device)
    launch(_add_rms_norm_kernel, (rows,), (
        h, delta, weight, weight if delta_weight is None else delta_weight, total, out,
        h.stride(0), delta.stride(0), total.stride(0), out.stride(0),
        hidden, eps,
    ), dict(
        UNIT_OFFSET=unit_offset, DELTA_NORM=delta_weight is not None, BLOCK=block, PDL=pdl,
        # One row is a few KB: enough warps to issue its loads at once, few enough that the
        # cross-warp sum stays short.
        num_warps=8 if block >= 4096 else 4, **pdl_launch_options(pdl),
    ))
    return total, out
