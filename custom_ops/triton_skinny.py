"""Triton skinny GEMM for decode batches of 2-64 rows: ``out[M, N] = x[M, K] @ weight[N, K]^T``.

At 2-64 rows a decode matmul still only streams its weight (64 FLOPs per weight byte at 64 rows,
a fifth of what an H100 can feed), yet cuBLAS reaches ~80% of copy bandwidth on llama-3.2-3b's
shapes at batch 64. The GEMV kernel
(custom_ops.triton_gemv) loops over 16-row tiles of x outside its K loop, so above 16 rows it reads
the weight once per tile. Here every weight byte is read once whatever M is:

- The weight tile is the MMA's left operand ``[BLOCK_N, BLOCK_K]`` and x the right one, transposed
  (``[BLOCK_K, BLOCK_M]``, BLOCK_M = M rounded up to a power of two >= 16): a Hopper MMA wants 64
  rows on its left side, which a batch of 16 does not have and a weight tile always does.
- Grid ``(cdiv(N, BLOCK_N), SPLIT_K)``, and a split's partial reduced by the last split to arrive
  (the arrival counter of custom_ops.triton_gemv): a narrow matrix still fills every SM, and the
  reduce costs no launch.
- Under PDL the kernel waits for the one before it before it loads anything; with
  INFER_GRAPHS_SKINNY_PREFETCH=T (a power of two, default 0: off) each program first asks L2 for its
  split's first T weight tiles (`prefetch.global.L2`, no registers), so the weight stream starts while
  the kernel before finishes, and the loop, pipelined by Triton as before, finds them in L2. Loading
  the first tile into registers before the wait instead broke that pipelining where it was tried (the
  decode attention kernel, 5b89729: 34.9 -> 50.7 us on an H100). Off until a GPU A/B says otherwise.
- No activation inside: with act(gate) * up recomputed by every program for all its rows, a gated
  down projection is slower than act-and-mul followed by this kernel (35-100 us on an H100), so a
  gated MLP runs the act-and-mul kernel first above one row (custom_ops.linear).

The grid and every constexpr depend only on shapes, so a launch is CUDA-graph capturable.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from custom_ops.gemv_table import GemvConfig
from custom_ops.pdl import launch_with_pdl, pdl_launch_options
from custom_ops.triton_argmax import argmax_tile_keys
from custom_ops.triton_common import cdiv, next_power_of_2
from custom_ops.triton_gemv import check_operands, output_for, split_workspaces
from custom_ops.triton_launch import launch
from custom_ops.triton_prefill import dot_precision

# From 2 rows: below 16 the MMA's x side is padded to 16 rows (masked loads), and the kernel still
# reads every weight byte once; at one row the GEMV (custom_ops.triton_gemv) serves.
MIN_ROWS = 2
MAX_ROWS = 128
MMA_MIN_ROWS = 16  # x's side of the MMA: fewer rows are padded to this by masked loads
# A weight tile of at least this many rows is the MMA's left operand (a Hopper MMA's 64-row side);
# narrower tiles put x there and transpose the product.
W_LEFT_ROWS = 64
PREFETCH_ENV = "INFER_GRAPHS_SKINNY_PREFETCH"
L2_LINE_BYTES = 128


def prefetch_tiles() -> int:
    """INFER_GRAPHS_SKINNY_PREFETCH: the weight tiles a program prefetches into L2 before the PDL wait
    (0, 1, 2, 4 or 8), read once per process: the launcher runs between graphs on graphless steps."""
    global _prefetch_tiles
    if _prefetch_tiles is None:
        value = os.environ.get(PREFETCH_ENV, "0")
        if value not in ("0", "1", "2", "4", "8"):
            raise ValueError(f"{PREFETCH_ENV}={value!r} must be one of 0, 1, 2, 4, 8 (weight tiles per program)")
        _prefetch_tiles = int(value)
    return _prefetch_tiles


_prefetch_tiles: int | None = None


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte line at each pointer (no register holds the data, nothing waits for it)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)


# M (16..64 rows) is not specialized: Triton would otherwise compile a second variant for the row
# counts that are not multiples of 16 (the decode buckets 24, 40, 56 and most piecewise sizes) at
# start-up, per table entry, for no change in the generated loads (rows are masked either way).
@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr, part_ptr, arrivals_ptr, keys_ptr,
    M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, W_LEFT: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
    KEYS: tl.constexpr, SCALED: tl.constexpr, PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr,
):
    # SCALED: w holds FP8 (float8_e4m3fn) values, widened to x's dtype in registers (exact) for the
    # MMA, and scale_ptr one float32 scale per weight row, applied once to the float32 sum (to each
    # split's partial before it is stored: the scale is per row, the sum over K linear).
    # KEYS (one split): the tile's argmax key per row of x, of the values as stored, into
    # keys[M, tiles] (custom_ops.triton_argmax.argmax_of_keys reads them: the sampler's greedy token
    # without a second pass over the logits).
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    if PREFETCH_LINES > 0:  # the split's first weight tiles toward L2, every LINE elements of each row
        cols = tl.minimum(k_begin + tl.arange(0, PREFETCH_LINES) * LINE, K - 1)
        prefetch_l2(w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn + cols[None, :])
    if PDL:
        tl.extra.cuda.gdc_wait()
    if W_LEFT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:  # a narrow weight tile: x (16 rows or more, padded) on the left, the product transposed once
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(k_begin, k_end, BLOCK_K):
        k = k_start + offs_k
        if EVEN_K:  # K tiles never straddle a split's end: only the rows need masks
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None], other=0.0)
            x = tl.load(x_rows + k[None, :], mask=m_mask[:, None], other=0.0)
        else:
            k_mask = k < k_end
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = w.to(x.dtype)  # a no-op unless SCALED
        if W_LEFT:
            acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if not W_LEFT:
        acc = tl.trans(acc)
    if SCALED:
        acc = acc * tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    nm_mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT_K == 1:
        stored = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], stored, mask=nm_mask)
        if KEYS:
            best = argmax_tile_keys(stored.to(tl.float32), offs_n[:, None] + 0 * offs_m[None, :], nm_mask)
            tl.store(keys_ptr + offs_m.to(tl.int64) * tl.num_programs(0) + pid_n, best, mask=m_mask)
    else:
        # partials are [SPLIT_K, M, N] float32; the last split to arrive sums them in split order
        tl.store(part_ptr + (pid_k * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None], acc, mask=nm_mask)
        tl.debug_barrier()
        counter = arrivals_ptr + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in range(0, SPLIT_K):
                total += tl.load(part_ptr + (s * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None],
                                 mask=nm_mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], total.to(out_ptr.dtype.element_ty),
                     mask=nm_mask)
            tl.atomic_xchg(counter, 0)  # every split has arrived: ready for the next launch


def fits(rows: int) -> bool:
    """Whether the skinny kernel serves an x of `rows` rows."""
    return MIN_ROWS <= rows <= MAX_ROWS


def key_tiles(n: int, config: GemvConfig) -> int | None:
    """How many argmax keys a row of `skinny_gemm(..., keys=)` has for an N-wide weight, or None where
    the config cannot store them (split K: the partials are summed by one program per N tile)."""
    return cdiv(n, config.block_n) if config.split_k == 1 else None


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig,
                out: torch.Tensor | None = None, keys: torch.Tensor | None = None,
                scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K]^T`` -> ``out [M, N]`` in x's dtype (float32 accumulation), for
    2 <= M <= 128. `config`: block_n / block_k >= 16 (MMA tiles), split_k, warps, stages.
    `keys`: a contiguous int64 [M, key_tiles(N, config)] that gets each N tile's argmax key per row
    (custom_ops.triton_argmax.argmax_of_keys). `scale`: weight is float8_e4m3fn and row n of the
    product is multiplied by scale[n] (FP8 weights, weight-only: custom_ops.fp8)."""
    check_operands("skinny_gemm", x, weight, None, scale)
    m = x.shape[0]
    if not fits(m):
        raise ValueError(f"skinny_gemm serves {MIN_ROWS}..{MAX_ROWS} rows of x, got {m}")
    if min(config.block_n, config.block_k) < 16:
        raise ValueError(f"skinny_gemm: block_n and block_k must be >= 16 (MMA tiles), got {config}")
    x = x if x.stride(1) == 1 else x.contiguous()
    n, k = weight.shape
    out = output_for("skinny_gemm", x, n, out)
    if n == 0:
        return out
    if k == 0:
        return out.zero_()
    tiles_n = cdiv(n, config.block_n)
    if keys is not None and (key_tiles(n, config) is None or keys.shape != (m, tiles_n)
                             or keys.dtype != torch.int64 or not keys.is_contiguous()):
        raise ValueError(f"skinny_gemm keys {tuple(keys.shape)} {keys.dtype} must be a contiguous int64 "
                         f"[{m}, {key_tiles(n, config)}] for weight {tuple(weight.shape)} and {config}")
    k_tiles = cdiv(k, config.block_k)
    even_k = k % config.block_k == 0 and k_tiles % config.split_k == 0
    parts, arrivals = split_workspaces(x.device, config.split_k, m, n, tiles_n, out)
    pdl = launch_with_pdl(x.device)
    # the prefetch only pays under PDL, and the interpreter has no inline assembly
    line = max(1, L2_LINE_BYTES // weight.element_size())
    prefetch_lines = prefetch_tiles() * max(1, config.block_k // line) if pdl else 0
    launch(_skinny_kernel, (tiles_n, config.split_k), (
        x, weight, out if scale is None else scale, out, parts, arrivals, out if keys is None else keys, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
    ), dict(
        BLOCK_M=max(MMA_MIN_ROWS, next_power_of_2(m)), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT_K=config.split_k, EVEN_K=even_k, W_LEFT=config.block_n >= W_LEFT_ROWS,
        DOT_PRECISION=dot_precision(x.dtype), PDL=pdl, KEYS=keys is not None, SCALED=scale is not None,
        PREFETCH_LINES=prefetch_lines, LINE=line,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch_options(pdl),
    ))
    return out
