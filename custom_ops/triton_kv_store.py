"""Triton kernel that writes a step's new K/V rows into the paged cache by slot mapping.

One program per real token: it reads the token's ``[Hkv, D]`` keys and values (any token/head
strides, last dim contiguous) and writes them to ``cache[0|1, slot // block_size, slot % block_size]``.
The grid is the caller's ``num_actual_tokens`` (a python int), so padding rows are never read and
never written; a negative slot (the vLLM convention for "no slot") is skipped as well.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops.triton_common import next_power_of_2
from custom_ops.triton_launch import launch


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_co, stride_ch,
    PAGE_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    token64 = token.to(tl.int64)
    k = tl.load(k_ptr + token64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + token64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    dst = page * stride_cb + offset * stride_co + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def store_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, num_tokens: int,
) -> None:
    """Write ``k, v [T, Hkv, D]`` rows ``0..num_tokens-1`` into ``kv_cache [2, NB, BS, Hkv, D]``."""
    if num_tokens <= 0:
        return
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, Hkv, D], got {tuple(kv_cache.shape)}")
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    if k.shape[1:] != (num_kv_heads, head_dim) or v.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match the cache's [Hkv={num_kv_heads}, D={head_dim}]")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache's last dimension must be contiguous")
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    launch(_store_kv_kernel, (num_tokens,), (
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
    ), dict(
        PAGE_SIZE=block_size, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads), BLOCK_D=next_power_of_2(head_dim),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    ))
