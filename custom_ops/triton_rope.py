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
    v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_v, stride_cb, stride_co, stride_ch, num_store,
    NUM_Q_HEADS: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr, PDL: tl.constexpr,
    STORE: tl.constexpr = False, PAGE_SIZE: tl.constexpr = 1,
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
    if STORE:  # the rotated k and the token's v into the paged cache (a token below num_store, slot >= 0)
        # the scalar tests broadcast over the tile first (the interpreter cannot AND a scalar into a mask)
        slot = tl.zeros([BLOCK_H, BLOCK_HALF], tl.int64) + tl.load(slot_ptr + token).to(tl.int64)
        store_mask = k_mask & (slot >= 0) & ((tl.zeros([BLOCK_H, BLOCK_HALF], tl.int64) + token) < num_store)
        kv_head = heads[:, None] - NUM_Q_HEADS
        dst = (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_co + kv_head * stride_ch
        out_type = k_cache_ptr.dtype.element_ty
        tl.store(k_cache_ptr + dst + offs[None, :], out1.to(out_type), mask=store_mask)
        tl.store(k_cache_ptr + dst + HALF + offs[None, :], out2.to(out_type), mask=store_mask)
        v_rows = v_ptr + token * stride_v + kv_head * HEAD_DIM
        v1 = tl.load(v_rows + offs[None, :], mask=store_mask, other=0.0)
        v2 = tl.load(v_rows + HALF + offs[None, :], mask=store_mask, other=0.0)
        tl.store(v_cache_ptr + dst + offs[None, :], v1.to(out_type), mask=store_mask)
        tl.store(v_cache_ptr + dst + HALF + offs[None, :], v2.to(out_type), mask=store_mask)


def qk_norm_rope_triton(
    q_in: torch.Tensor, k_in: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, unit_offset: bool,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] (new, contiguous) from the raw q_in, k_in of those shapes, each
    token's heads back to back (any token stride), with cos / sin [T, D / 2] rows (any token stride).
    The caller (custom_ops.rope) has checked the shapes.

    `store` (v [T, Hkv, D] with each token's heads back to back, kv_cache [2, blocks, block_size, Hkv, D],
    slot_mapping [>= n], n): the rotated k and v of tokens 0..n-1 also go into the cache at their slots
    (a negative slot: none), as custom_ops.triton_kv_store.store_kv would write them, in this launch: a
    verify step stores every token before any attends, and the store was a kernel of its own a layer."""
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
    if store is None:
        cache_args, page_size = (q, q, q, q, 0, 0, 0, 0, 0), 1
    else:
        v, kv_cache, slot_mapping, num_store = store
        if (v.shape != (tokens, num_kv_heads, head_dim) or v.stride(2) != 1 or v.stride(1) != head_dim
                or kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != (num_kv_heads, head_dim)
                or kv_cache.stride(-1) != 1 or slot_mapping.shape[0] < num_store):
            raise ValueError(f"qk_norm_rope_triton store: v {tuple(v.shape)} (heads back to back) and kv_cache "
                             f"{tuple(kv_cache.shape)} must be [T={tokens}, {num_kv_heads}, {head_dim}] and [2, blocks, "
                             f"block_size, {num_kv_heads}, {head_dim}], slot_mapping {tuple(slot_mapping.shape)} "
                             f"at least {num_store} long")
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        cache_args = (v, k_cache, v_cache, slot_mapping, v.stride(0), k_cache.stride(0), k_cache.stride(1),
                      k_cache.stride(2), num_store)
        page_size = kv_cache.shape[2]
    launch(_qk_norm_rope_kernel, (tokens, cdiv(heads, block_h)), (
        q_in, k_in, cos, sin, q_weight if norm else q_in, k_weight if norm else q_in, q, k,
        q_in.stride(0), k_in.stride(0), cos.stride(0), sin.stride(0), q.stride(0), k.stride(0), eps,
        *cache_args,
    ), dict(
        NUM_Q_HEADS=num_heads, NUM_HEADS=heads, HEAD_DIM=head_dim, HALF=half,
        BLOCK_H=block_h, BLOCK_HALF=next_power_of_2(half),
        NORM=norm, UNIT_OFFSET=unit_offset, PDL=pdl, STORE=store is not None, PAGE_SIZE=page_size,
        num_warps=4, **pdl_launch_options(pdl),
    ))
    return q, k
