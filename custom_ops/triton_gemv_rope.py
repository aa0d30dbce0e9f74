"""Triton GEMV for a fused q/k/v projection at one row with the rotary embedding of q and k in its
epilogue: ``qkv = x @ weight^T``, and q, k = rope(qkv's q and k heads), in one launch.

At batch 1 a decode layer without q/k norms (Llama) ran the projection's GEMV and then the rotary
kernel (custom_ops.triton_rope), a few microseconds of launch-to-launch latency per layer for a
kernel that moves a few KiB. Here a program owns HALF_N columns of one head's first half and the
HALF_N columns HEAD_DIM / 2 further on: exactly the pairs the half-split ("rotate_half") rotary
mixes. It streams those 2 * HALF_N weight rows as the plain GEMV streams BLOCK_N rows, rounds the
two sums to the activation dtype (as the GEMV's stored output is), and rotates them in float32 with
one rounding (as the rotary kernel reads and rounds them): the same values as the two kernels.
Programs past the q and k heads own 2 * HALF_N consecutive v rows and store them unrotated.

Outputs: the whole projection ``qkv`` (its v columns are what attention reads; q and k unrotated,
as F.linear gives them) and the rotated ``q``, ``k`` as new contiguous tensors, what the two-kernel
path returns. One split of K only; the caller (custom_ops.qkv_rope) falls back to the two kernels
for a table entry with split_k > 1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops.gemv_table import GemvConfig
from custom_ops.pdl import launch_with_pdl, pdl_launch_options
from custom_ops.triton_common import cdiv
from custom_ops.triton_launch import launch


@triton.jit
def _gemv_rope_kernel(
    x_ptr, w_ptr, scale_ptr, cos_ptr, sin_ptr, qkv_ptr, q_ptr, k_ptr, N, K, stride_wn,
    NUM_Q_HEADS: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    HALF_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, SCALED: tl.constexpr,
):
    # SCALED: FP8 weights (custom_ops.fp8), widened in registers, each row's sum times its scale
    pid = tl.program_id(0)
    tiles_per_head: tl.constexpr = HALF // HALF_N
    rotated = pid < NUM_HEADS * tiles_per_head
    head = pid // tiles_per_head
    r = tl.arange(0, HALF_N)
    col = (pid % tiles_per_head) * HALF_N + r  # within the head's first half
    v_first = NUM_HEADS * HEAD_DIM + (pid - NUM_HEADS * tiles_per_head) * (2 * HALF_N)
    rows1 = tl.where(rotated, head * HEAD_DIM + col, v_first + r)
    rows2 = tl.where(rotated, head * HEAD_DIM + HALF + col, v_first + HALF_N + r)
    mask1 = rows1 < N
    mask2 = rows2 < N
    w1_rows = w_ptr + rows1.to(tl.int64)[:, None] * stride_wn
    w2_rows = w_ptr + rows2.to(tl.int64)[:, None] * stride_wn

    # The first weight tiles are this layer's own data: loaded before the PDL wait, while the kernel
    # that writes x may still be running.
    k = tl.arange(0, BLOCK_K)
    k_mask = k < K
    w1 = tl.load(w1_rows + k[None, :], mask=mask1[:, None] & k_mask[None, :], other=0.0)
    w2 = tl.load(w2_rows + k[None, :], mask=mask2[:, None] & k_mask[None, :], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
    acc1 = w1.to(tl.float32) * x[None, :]
    acc2 = w2.to(tl.float32) * x[None, :]
    for k_start in range(BLOCK_K, K, BLOCK_K):
        k = k_start + tl.arange(0, BLOCK_K)
        k_mask = k < K
        w1 = tl.load(w1_rows + k[None, :], mask=mask1[:, None] & k_mask[None, :], other=0.0)
        w2 = tl.load(w2_rows + k[None, :], mask=mask2[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        acc1 += w1.to(tl.float32) * x[None, :]
        acc2 += w2.to(tl.float32) * x[None, :]
    cos = tl.load(cos_ptr + col).to(tl.float32)  # col < HALF on every program (HALF_N tiles HALF)
    sin = tl.load(sin_ptr + col).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()  # every load is issued: the next kernel may be scheduled
    dtype = qkv_ptr.dtype.element_ty
    sum1 = tl.sum(acc1, 1)
    sum2 = tl.sum(acc2, 1)
    if SCALED:
        sum1 = sum1 * tl.load(scale_ptr + rows1, mask=mask1, other=0.0)
        sum2 = sum2 * tl.load(scale_ptr + rows2, mask=mask2, other=0.0)
    y1 = sum1.to(dtype)
    y2 = sum2.to(dtype)
    tl.store(qkv_ptr + rows1, y1, mask=mask1)
    tl.store(qkv_ptr + rows2, y2, mask=mask2)
    if rotated:
        x1 = y1.to(tl.float32)
        x2 = y2.to(tl.float32)
        out1 = (x1 * cos - x2 * sin).to(dtype)
        out2 = (x2 * cos + x1 * sin).to(dtype)
        head_v = head + r * 0  # as a vector: the interpreter takes no scalar in a mask
        is_q = head_v < NUM_Q_HEADS
        is_k = head_v >= NUM_Q_HEADS
        q_row = q_ptr + head * HEAD_DIM
        k_row = k_ptr + (head - NUM_Q_HEADS) * HEAD_DIM
        tl.store(q_row + col, out1, mask=is_q)
        tl.store(q_row + HALF + col, out2, mask=is_q)
        tl.store(k_row + col, out1, mask=is_k)
        tl.store(k_row + HALF + col, out2, mask=is_k)


def fits(config: GemvConfig, head_dim: int) -> bool:
    """Whether `config`'s tile can run this kernel: one split, and its BLOCK_N rows cut into two
    halves that tile a head's half exactly."""
    half_n = config.block_n // 2
    return config.split_k == 1 and half_n >= 1 and (head_dim // 2) % half_n == 0


def gemv_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, config: GemvConfig,
              num_heads: int, num_kv_heads: int, scale: torch.Tensor | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qkv [1, N], q [1, num_heads, D], k [1, num_kv_heads, D]) for one row x [1, K] (last dim
    contiguous), weight [N, K] (row-major), and cos / sin [D / 2] for that row's position. The caller
    has checked the shapes and that the config `fits`. `scale`: weight is float8_e4m3fn with this
    float32 scale per row (custom_ops.fp8)."""
    n, k_dim = weight.shape
    head_dim = 2 * cos.shape[-1]
    heads = num_heads + num_kv_heads
    half_n = config.block_n // 2
    qkv = torch.empty((1, n), dtype=x.dtype, device=x.device)
    q = torch.empty((1, num_heads, head_dim), dtype=x.dtype, device=x.device)
    k = torch.empty((1, num_kv_heads, head_dim), dtype=x.dtype, device=x.device)
    rotated_programs = heads * (head_dim // 2) // half_n
    grid = (rotated_programs + cdiv(n - heads * head_dim, config.block_n),)
    pdl = launch_with_pdl(x.device)
    launch(_gemv_rope_kernel, grid, (
        x, weight, qkv if scale is None else scale, cos, sin, qkv, q, k, n, k_dim, weight.stride(0),
    ), dict(
        NUM_Q_HEADS=num_heads, NUM_HEADS=heads, HEAD_DIM=head_dim, HALF=head_dim // 2, HALF_N=half_n,
        BLOCK_K=config.block_k, PDL=pdl, SCALED=scale is not None, num_warps=config.num_warps, num_stages=config.num_stages,
        **pdl_launch_options(pdl),
    ))
    return qkv, q, k
