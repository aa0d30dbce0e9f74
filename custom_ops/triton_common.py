"""Pieces shared by the Triton kernels: key/value tile loads and the score transform, grid sizing.

Scores live in the log2 domain inside the kernels (``exp2`` is one instruction, ``exp`` is two), so
``scale`` is multiplied by log2(e) once; with a logit softcap the tanh is applied to the natural-
scale scores first and the result is converted to log2 units afterwards.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

def cdiv(a: int, b: int) -> int:
    """ceil(a / b) on the host. `triton.cdiv` / `triton.next_power_of_2` are constexpr functions in
    recent Triton, ~4 us per call from Python; a launch wrapper calls them several times per layer."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 0


_sm_counts: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors (cached: the property query is slow), which sizes the
    kernels' grids."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sm_counts[index]


def interpreting() -> bool:
    """True when kernels run in Triton's CPU interpreter (tests on machines without CUDA)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def load_kv_tile(
    k_ptr, v_ptr, block_table_ptr, n, n_mask, kv_head,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
    offs_d, d_mask,
    PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
):
    """Keys and values of positions ``n [BLOCK_N]`` for one kv head, as ``[BLOCK_N, BLOCK_D]`` tiles.

    Paged: position n lives at page ``block_table[n // PAGE_SIZE]``, row ``n % PAGE_SIZE`` (the
    row strides are the cache's block and in-block strides). Dense: ``stride_*o`` is the token stride.
    """
    if PAGED:
        if MASKED:
            page = tl.load(block_table_ptr + n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        else:
            page = tl.load(block_table_ptr + n // PAGE_SIZE).to(tl.int64)
        in_page = n % PAGE_SIZE
        k_rows = page * stride_kb + in_page * stride_ko
        v_rows = page * stride_vb + in_page * stride_vo
    else:
        k_rows = n.to(tl.int64) * stride_ko
        v_rows = n.to(tl.int64) * stride_vo
    k_off = k_rows[:, None] + kv_head * stride_kh + offs_d[None, :]
    v_off = v_rows[:, None] + kv_head * stride_vh + offs_d[None, :]
    # EVEN_D (head_dim a power of two) drops the column mask so loads stay 16-byte vectors.
    if MASKED:
        if EVEN_D:
            mask = n_mask[:, None]
        else:
            mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + k_off, mask=mask, other=0.0)
        v = tl.load(v_ptr + v_off, mask=mask, other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptr + k_off)
        v = tl.load(v_ptr + v_off)
    else:
        k = tl.load(k_ptr + k_off, mask=d_mask[None, :], other=0.0)
        v = tl.load(v_ptr + v_off, mask=d_mask[None, :], other=0.0)
    return k, v


@triton.jit
def log2_scores(raw, scale, softcap, SOFTCAP: tl.constexpr):
    """``raw = q . k`` (fp32) -> scores in log2 units, with the optional ``c * tanh(s / c)`` cap."""
    if SOFTCAP:
        x = raw * (scale / softcap)
        # tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits at +-inf, no libdevice (runs in the interpreter).
        t = 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)
        return t * (softcap * 1.4426950408889634)
    else:
        return raw * (scale * 1.4426950408889634)
