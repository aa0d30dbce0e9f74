"""Triton kernel for the per-head q/k RMSNorm (Qwen3, Gemma 3) and the rotary embedding of q and k,
read from the fused qkv projection and written as q and k, in one launch.

Inductor lowers these as separate kernels (the norm's reduction and normalize, then one rotary
kernel for q and one for k, as two outputs of different shapes): two to four launches per layer in a
decode step where each is a few microseconds of latency. Here a program owns BLOCK_H heads of one
token (q's heads, then k's: two inputs, usually views of the fused projection): each row is read
once, normalized (rounded to the activation dtype, as the unfused code rounds the norm's output),
rotated in float32 and rounded once (custom_ops.rope).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops.pdl import launch_with_pdl, pdl_launch_options
from custom_ops.triton_common import cdiv, next_power_of_2
from custom_ops.triton_launch import launch
from custom_ops.triton_rms_norm import scale_normed


@triton.jit
def _qk_norm_rope_kernel(
    q_in_ptr, k_in_ptr, cos_ptr, sin_ptr, q_weight_ptr, k_weight_ptr, q_ptr, k_ptr,
    stride_q_in, stride_k_in, stride_cos, stride_sin, stride_q, stride_k, eps,
    NUM_Q_HEADS: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr, PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    d_mask = offs < HALF
    mask = (heads < NUM_HEADS)[:, None] & d_mask[None, :]
    is_q = (heads < NUM_Q_HEADS)[:, None]
    q_mask = mask & is_q
    k_mask = mask & (heads >= NUM_Q_HEADS)[:, None]
    dtype = q_ptr.dtype.element_ty
    if NORM:  # the layer's own weights: loaded before the PDL wait
        w1 = tl.where(is_q, tl.load(q_weight_ptr + offs, mask=d_mask, other=0.0)[None, :],
                      tl.load(k_weight_ptr + offs, mask=d_mask, other=0.0)[None, :]).to(tl.float32)
        w2 = tl.where(is_q, tl.load(q_weight_ptr + HALF + offs, mask=d_mask, other=0.0)[None, :],
                      tl.load(k_weight_ptr + HALF + offs, mask=d_mask, other=0.0)[None, :]).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    q_in = q_in_ptr + token * stride_q_in + heads[:, None] * HEAD_DIM
    k_in = k_in_ptr + token * stride_k_in + (heads[:, None] - NUM_Q_HEADS) * HEAD_DIM
    x1 = (tl.load(q_in + offs[None, :], mask=q_mask, other=0.0).to(tl.float32)
          + tl.load(k_in + offs[None, :], mask=k_mask, other=0.0).to(tl.float32))
    x2 = (tl.load(q_in + HALF + offs[None, :], mask=q_mask, other=0.0).to(tl.float32)
          + tl.load(k_in + HALF + offs[None, :], mask=k_mask, other=0.0).to(tl.float32))
    cos = tl.load(cos_ptr + token * stride_cos + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + token * stride_sin + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if NORM:
        inv_rms = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)[:, None]
        x1 = scale_normed(x1 * inv_rms, w1, UNIT_OFFSET, dtype).to(tl.float32)
        x2 = scale_normed(x2 * inv_rms, w2, UNIT_OFFSET, dtype).to(tl.float32)
    out1 = (x1 * cos - x2 * sin).to(dtype)
    out2 = (x2 * cos + x1 * sin).to(dtype)
    q_rows = q_ptr + token * stride_q + heads[:, None] * HEAD_DIM
    k_rows = k_ptr + token * stride_k + (heads[:, None] - NUM_Q_HEADS) * HEAD_DIM
    tl.store(q_rows + offs[None, :], out1, mask=q_mask)
    tl.store(q_rows + HALF + offs[None, :], out2, mask=q_mask)
    tl.store(k_rows + offs[None, :], out1, mask=k_mask)
    tl.store(k_rows + HALF + offs[None, :], out2, mask=k_mask)


def qk_norm_rope_triton(
    q_in: torch.Tensor, k_in: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, unit_offset: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] (new, contiguous) from the raw q_in, k_in of those shapes, each
    token's heads back to back (any token stride), with cos / sin [T, D / 2] rows (any token stride).
    The caller (custom_ops.rope) has checked the shapes."""
    tokens, num_heads, head_dim = q_in.shape
    num_kv_heads = k_in.shape[1]
    half = head_dim // 2
    q = torch.empty((tokens, num_heads, head_dim), dtype=q_in.dtype, device=q_in.device)
    k = torch.empty((tokens, num_kv_heads, head_dim), dtype=q_in.dtype, device=q_in.device)
    if tokens == 0:
        return q, k
    heads = num_heads + num_kv_heads
    block_h = min(next_power_of_2(heads), max(1, 512 // head_dim))  # ~512 elements a program
    norm = q_weight is not None
    pdl = launch_with_pdl(q_in.device)
    launch(_qk_norm_rope_kernel, (tokens, cdiv(heads, block_h)), (
        q_in, k_in, cos, sin, q_weight if norm else q_in, k_weight if norm else q_in, q, k,
        q_in.stride(0), k_in.stride(0), cos.stride(0), sin.stride(0), q.stride(0), k.stride(0), eps,
    ), dict(
        NUM_Q_HEADS=num_heads, NUM_HEADS=heads, HEAD_DIM=head_dim, HALF=half,
        BLOCK_H=block_h, BLOCK_HALF=next_power_of_2(half),
        NORM=norm, UNIT_OFFSET=unit_offset, PDL=pdl,
        num_warps=4, **pdl_launch_options(pdl),
    ))
    return q, k
