"""Triton GEMV / split-K GEMM for decode-sized matmuls: ``out[M, N] = x[M, K] @ weight[N, K]^T``.

At decode (M = batch, 1..16) a linear layer is a pass over its weight: the kernel is bound by how
fast it streams ``weight`` from memory, and cuBLAS reaches 56-92% of read bandwidth on Llama's
shapes on an H100, with a separate split-K reduce kernel after some of them. Here:

- Grid ``(cdiv(N, BLOCK_N), SPLIT_K)``: a program owns BLOCK_N weight rows and one of SPLIT_K equal
  runs of K, so a narrow matrix (N = 1152..3072) still spreads over every SM.
- M < 16: CUDA cores. Each weight tile is loaded once and reused for every row of x (the x rows
  are a few KiB, served from L1/L2); no shared-memory round trip for an MMA operand. At M = 1 the
  products accumulate per element and are reduced across K once per program.
  M >= 16: ``tl.dot`` on BLOCK_M-row tiles of x.
- SPLIT_K > 1: each split writes its float32 partial; the split that arrives last (an arrival
  counter per N tile, as the decode attention kernel does) sums the partials in split order and
  writes ``out``, then resets its counter. One launch, no reduce kernel, and the sum's order is
  fixed, so results do not depend on which split finishes first.

The grid and every constexpr depend only on shapes, so a launch is CUDA-graph capturable; the
scratch is one bounded workspace per device (custom_ops.workspace).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops.gemv_table import GemvConfig
from custom_ops.pdl import launch_with_pdl, pdl_launch_options
from custom_ops.triton_common import cdiv, next_power_of_2
from custom_ops.triton_launch import launch
from custom_ops.triton_prefill import dot_precision
from custom_ops.workspace import Workspace


GATES = {None: 0, "silu": 1, "gelu_tanh": 2}  # the activations a gated GEMV applies to its x


@triton.jit
def gate_activation(g, GATE: tl.constexpr):
    """SiLU (GATE 1) or tanh-approximated GELU (GATE 2) of float32 g (tanh through exp: the
    interpreter has no tanh)."""
    if GATE == 1:
        return g / (1.0 + tl.exp(-g))
    inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi) * (g + 0.044715 g^3)
    return 0.5 * g * (2.0 / (1.0 + tl.exp(-2.0 * inner)))  # 0.5 g (1 + tanh(inner))


@triton.jit
def load_x(ptrs, mask, K, GATE: tl.constexpr):
    """x's elements at ptrs; gated (GATE > 0), the row holds [gate K | up K] and x = act(gate) * up,
    each product rounded to x's dtype as the unfused model code rounds act(gate) and the product."""
    if GATE == 0:
        return tl.load(ptrs, mask=mask, other=0.0)
    gate = tl.load(ptrs, mask=mask, other=0.0)
    up = tl.load(ptrs + K, mask=mask, other=0.0)
    act = gate_activation(gate.to(tl.float32), GATE).to(gate.dtype)
    return (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr, part_ptr, arrivals_ptr,
    M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr, GATE: tl.constexpr,
    SCALED: tl.constexpr,
):
    # SCALED: w holds FP8 (float8_e4m3fn) values and scale_ptr one float32 scale per weight row; the
    # products accumulate from the FP8 values widened in registers, and the sum is scaled once (a
    # split's partial is scaled before it is stored: the scale is per row, the sum over K linear).
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)

    if BLOCK_M == 1:
        # One row (M == 1, decode at batch 1). The first weight tile is this layer's own data, so it
        # is loaded before the PDL wait, while the kernel that writes x may still be running; products
        # accumulate element-wise and are reduced across K once, at the end.
        offs_m = tl.arange(0, 1)
        m_mask = offs_m < M
        k = k_begin + offs_k
        k_mask = k < k_end
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
        x_0 = load_x(x_ptr + k, k_mask, K, GATE).to(tl.float32)
        acc_k = w.to(tl.float32) * x_0[None, :]
        for k_start in range(k_begin + BLOCK_K, k_end, BLOCK_K):
            k = k_start + offs_k
            k_mask = k < k_end
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x_0 = load_x(x_ptr + k, k_mask, K, GATE).to(tl.float32)
            acc_k += w.to(tl.float32) * x_0[None, :]
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()  # every load is issued: the next kernel may be scheduled
        acc = tl.sum(acc_k, 1)[None, :]
        if SCALED:
            acc = acc * tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
        mn_mask = m_mask[:, None] & n_mask[None, :]
        if SPLIT_K == 1:
            tl.store(out_ptr + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mn_mask)
        else:
            # partials are [SPLIT_K, M, N] float32
            tl.store(part_ptr + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :], acc, mask=mn_mask)
    else:
        if PDL:
            tl.extra.cuda.gdc_wait()
        for m_start in range(0, M, BLOCK_M):
            offs_m = m_start + tl.arange(0, BLOCK_M)
            m_mask = offs_m < M
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k_start in range(k_begin, k_end, BLOCK_K):
                k = k_start + offs_k
                k_mask = k < k_end
                w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                if USE_DOT:
                    x = load_x(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                               m_mask[:, None] & k_mask[None, :], K, GATE)
                    # FP8 values are exact in x's dtype: the MMA reads both operands in it
                    acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)
                else:
                    w32 = w.to(tl.float32)
                    for i in tl.static_range(BLOCK_M):
                        row_valid = (offs_k * 0 + m_start + i) < M  # a vector: the interpreter refuses scalar masks
                        x_i = load_x(x_ptr + (m_start + i) * stride_xm + k, k_mask & row_valid, K,
                                     GATE).to(tl.float32)
                        row = tl.sum(w32 * x_i[None, :], 1)
                        acc += tl.where(tl.arange(0, BLOCK_M)[:, None] == i, row[None, :], 0.0)
            if SCALED:
                acc = acc * tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
            mn_mask = m_mask[:, None] & n_mask[None, :]
            out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
            if SPLIT_K == 1:
                tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mn_mask)
            else:
                tl.store(part_ptr + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :], acc,
                         mask=mn_mask)

    if SPLIT_K > 1:
        # All of this program's partial stores complete before its one arrival (acq_rel: released to
        # the last arriver, whose loads then see them; .cg reads L2, never a stale L1 line).
        tl.debug_barrier()
        counter = arrivals_ptr + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            for m_start in range(0, M, BLOCK_M):
                offs_m = m_start + tl.arange(0, BLOCK_M)
                mn_mask = (offs_m < M)[:, None] & n_mask[None, :]
                total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for s in range(0, SPLIT_K):
                    total += tl.load(part_ptr + (s * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :],
                                     mask=mn_mask, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
                         total.to(out_ptr.dtype.element_ty), mask=mn_mask)
            tl.atomic_xchg(counter, 0)  # every split has arrived: ready for the next launch


@triton.jit
def _act_mul_kernel(x_ptr, out_ptr, K, stride_xm, stride_om, BLOCK: tl.constexpr, GATE: tl.constexpr,
                    PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = k < K
    if PDL:
        tl.extra.cuda.gdc_wait()
    x = load_x(x_ptr + row * stride_xm + k, mask, K, GATE)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + row * stride_om + k, x, mask=mask)


def act_mul(x: torch.Tensor, gate: str) -> torch.Tensor:
    """act(gate) * up for x [M, 2K] = [gate | up] -> [M, K], rounded as `gemv(..., gate=)` reads it: the
    gated GEMV's input where a matmul of more rows runs cuBLAS, one launch as Inductor's own."""
    if gate not in GATES or gate is None:
        raise ValueError(f"act_mul: gate {gate!r} is not one of {sorted(g for g in GATES if g)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape[0], x.shape[1] // 2
    out = torch.empty((m, k), dtype=x.dtype, device=x.device)
    if m == 0 or k == 0:
        return out
    block = min(1024, next_power_of_2(k))
    pdl = launch_with_pdl(x.device)
    # Through the launch cache: in a prefill step without a graph it runs once per layer (the op
    # custom_ops.linear.act_and_mul), and only K and the strides enter its key.
    launch(_act_mul_kernel, (m, cdiv(k, block)), (x, out, k, x.stride(0), out.stride(0)),
           dict(BLOCK=block, GATE=GATES[gate], PDL=pdl, num_warps=4, **pdl_launch_options(pdl)))
    return out


_partials: dict[torch.device, Workspace] = {}
_arrivals: dict[torch.device, Workspace] = {}
# First-use sizes on CUDA (grown when a launch needs more): 4 MiB of partials holds split 8 of
# 8 rows of a 16k-wide matrix; 16k counters, N tiles of a 262k vocabulary at BLOCK_N 16.
_PARTIAL_BOUND_FLOATS = 1 << 20
_ARRIVAL_BOUND = 1 << 14


FP8_WEIGHT_DTYPE = torch.float8_e4m3fn


def check_operands(op: str, x: torch.Tensor, weight: torch.Tensor, gate: str | None,
                   scale: torch.Tensor | None = None) -> None:
    """A named error for operands the matmul kernels cannot read: x [M, K] (or [M, 2K] = [gate | up]
    with `gate`) and a row-major weight [N, K] of x's dtype, or with `scale` a float8_e4m3fn weight
    and its float32 scale per row [N]."""
    if gate not in GATES:
        raise ValueError(f"{op}: gate {gate!r} is not one of {sorted(g for g in GATES if g)} or None")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] * (2 if gate else 1):
        raise ValueError(f"{op} needs x [M, {'2K' if gate else 'K'}] and weight [N, K], got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if scale is not None:
        if weight.dtype != FP8_WEIGHT_DTYPE or scale.dtype != torch.float32 or scale.shape != (weight.shape[0],) \
                or scale.stride(0) != 1:
            raise ValueError(f"{op}: a scaled weight must be float8_e4m3fn [N, K] with a contiguous float32 scale "
                             f"[N], got weight {weight.dtype} {tuple(weight.shape)}, scale {scale.dtype} "
                             f"{tuple(scale.shape)}")
    elif x.dtype != weight.dtype:
        raise ValueError(f"{op}: x is {x.dtype} and weight {weight.dtype}; they must match")
    if weight.stride(1) != 1:
        raise ValueError(f"{op}: weight needs a contiguous last dimension (a [N, K] row-major matrix)")


def output_for(op: str, x: torch.Tensor, n: int, out: torch.Tensor | None) -> torch.Tensor:
    """`out` once it is the [M, N] buffer of x's dtype the kernels write (a new one for None)."""
    m = x.shape[0]
    if out is None:
        return torch.empty((m, n), dtype=x.dtype, device=x.device)
    if out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"{op} out {tuple(out.shape)} {out.dtype} must be [{m}, {n}] {x.dtype}, last dim contiguous")
    return out


def split_workspaces(device: torch.device, split_k: int, m: int, n: int, tiles_n: int,
                     unused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 partials [split_k * m * n], zeroed int32 arrival counters [tiles_n]) for a split-K
    launch, views of the device's workspaces; `unused` twice when split_k == 1 (the kernel never
    reads them)."""
    if split_k == 1:
        return unused, unused
    cuda = device.type == "cuda"
    parts = _partials.setdefault(device, Workspace()).take(split_k * m * n, _PARTIAL_BOUND_FLOATS if cuda else 0,
                                                           device)
    arrivals = _arrivals.setdefault(device, Workspace(torch.int32, zeroed=True)).take(
        tiles_n, _ARRIVAL_BOUND if cuda else 0, device)
    return parts, arrivals


def gemv(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None,
         out: torch.Tensor | None = None, gate: str | None = None,
         scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K]^T`` -> ``out [M, N]`` in x's dtype (float32 accumulation).
    `gate` ("silu", "gelu_tanh"): x is [M, 2K], a gate and an up half, and the matmul reads
    act(gate) * up (a gated MLP's down projection, its activation in the same kernel).
    `scale`: weight is float8_e4m3fn and row n of the product is multiplied by scale[n] (FP8 weights,
    weight-only: x stays in its dtype, custom_ops.fp8)."""
    check_operands("gemv", x, weight, gate, scale)
    cfg = config or GemvConfig()
    x = x if x.stride(1) == 1 else x.contiguous()
    m = x.shape[0]
    n, k = weight.shape
    out = output_for("gemv", x, n, out)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    block_m = 16 if m >= 16 else next_power_of_2(m)
    if block_m >= 16 and min(cfg.block_n, cfg.block_k) < 16:
        raise ValueError(f"gemv at M={m} uses tl.dot, which needs block_n and block_k >= 16 ({cfg})")
    tiles_n = cdiv(n, cfg.block_n)
    parts, arrivals = split_workspaces(x.device, cfg.split_k, m, n, tiles_n, out)
    pdl = launch_with_pdl(x.device)
    launch(_gemv_kernel, (tiles_n, cfg.split_k), (
        x, weight, out if scale is None else scale, out, parts, arrivals, m, n, k, x.stride(0), weight.stride(0),
        out.stride(0),
    ), dict(
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        USE_DOT=block_m >= 16, DOT_PRECISION=dot_precision(x.dtype), PDL=pdl, GATE=GATES[gate],
        SCALED=scale is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch_options(pdl),
    ))
    return out
