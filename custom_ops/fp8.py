"""FP8 weights, weight-only: a linear layer's matrix stored as float8_e4m3fn with one float32 scale per
output channel (row), `weight_fp32[n, :] = weight_fp8[n, :] * scale[n]`; activations stay in their dtype.

Batch-1 decode reads every weight once per token, so half the weight bytes is half the floor. The
matmuls (`run_fp8_linear`; which one per shape: custom_ops.gemv_table.fp8_config):
- 1 row on a CUDA GPU with FP8 conversions: the Triton GEMV (custom_ops.triton_gemv, `scale=`), which
  widens the FP8 values in registers, accumulates in float32 and scales each output once;
- 2-64 rows: the Triton skinny GEMM (custom_ops.triton_skinny, `scale=`), the same way;
- more rows: DEQUANT, the weight widened to the activation dtype (float32 product of value and scale,
  rounded once) and cuBLAS; or SCALED_MM, `torch._scaled_mm` on FP8 tensor cores with the activations
  quantized per token (row-wise scales);
- on the CPU, or where the kernels cannot run: DEQUANT with F.linear.
Everything is device work with shapes fixed by the call: no host sync, CUDA-graph capturable.

`fp8_linear_plain` is the same computation in traceable torch for a graph that is compiled for every
token count at once (a model whose linears are not switched to the ops: models.set_decode_gemv off):
DEQUANT or SCALED_MM by the weight's shape alone.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from custom_ops.gemv_table import SCALED_MM, GemvConfig, fp8_config, fp8_large_method

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# A row of zeros gets this amax, so its scale is tiny but finite and its values stay 0.
_MIN_AMAX = 1e-12


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [N, K], float32 scale [N]) of a float weight [N, K], per output channel:
    scale = amax(|row|) / 448, so every row uses the full FP8 range; values round to nearest."""
    if weight.dim() != 2 or not weight.is_floating_point() or weight.dtype == FP8_DTYPE:
        raise ValueError(f"quantize_rows needs a float [N, K] weight, got {weight.dtype} {tuple(weight.shape)}")
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=_MIN_AMAX) / FP8_MAX
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight an FP8 matrix stands for, in `dtype`: value * scale in float32, rounded once."""
    return (weight.float() * scale.float()[:, None]).to(dtype)


def check_fp8_weight(op: str, weight: torch.Tensor, scale: torch.Tensor) -> None:
    if weight.dtype != FP8_DTYPE or weight.dim() != 2 or scale.dtype != torch.float32 \
            or scale.shape != (weight.shape[0],):
        raise ValueError(f"{op}: an FP8 weight is float8_e4m3fn [N, K] with a float32 scale [N], got weight "
                         f"{weight.dtype} {tuple(weight.shape)} and scale {scale.dtype} {tuple(scale.shape)}")


def _scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16) @ (weight * scale)^T on FP8 tensor cores: x quantized per row (token)."""
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp(min=_MIN_AMAX)
    x_scale = amax / FP8_MAX
    xq = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    # weight.t() of a row-major [N, K] is the column-major [K, N] _scaled_mm wants on its right
    return torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=x.dtype)


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, method: str) -> torch.Tensor:
    """x [M, K] @ (weight * scale)^T by a large-rows `method` (DEQUANT or SCALED_MM)."""
    if method == SCALED_MM:
        return _scaled_mm(x, weight, scale)
    return F.linear(x, dequantize(weight, scale, x.dtype))


def fp8_linear_plain(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     weight_scale: torch.Tensor) -> torch.Tensor:
    """x @ (weight * weight_scale)^T (+ bias) in plain, traceable torch for any number of rows (the
    pieces compiled for a symbolic token count): DEQUANT or SCALED_MM by the weight's shape."""
    n, k = weight.shape
    method = fp8_large_method(n, k, x.dtype, x.device.type, x.device.index)
    y = fp8_matmul(x.reshape(-1, k), weight, weight_scale, method).view(*x.shape[:-1], n)
    return y if bias is None else y + bias


def run_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                   out: torch.Tensor | None = None, gate: str | None = None,
                   choice: GemvConfig | str | None = None) -> torch.Tensor:
    """x [..., K] @ (weight * scale)^T (+ bias), by fp8_config's choice for the row count (or `choice`,
    for tests and benchmarks). `out`: a [rows, N] buffer written and returned (2-D x, no bias).
    `gate` ("silu" / "gelu_tanh"): x is [..., 2K] = [gate | up] and the matmul reads act(gate) * up
    (the GEMV computes it in its loads at one row; elsewhere one act-and-mul first)."""
    check_fp8_weight("run_fp8_linear", weight, scale)
    n, k = weight.shape
    width = 2 * k if gate else k
    if x.shape[-1] != width:
        raise ValueError(f"run_fp8_linear: x {tuple(x.shape)} must end in {width} for weight {tuple(weight.shape)}"
                         + (f" with gate {gate!r}" if gate else ""))
    if out is not None and (bias is not None or x.dim() != 2):
        raise ValueError(f"run_fp8_linear: `out` needs a 2-D x and no bias (x {tuple(x.shape)})")
    rows = x.numel() // max(width, 1)
    flat = x.reshape(rows, width)
    if choice is None:
        choice = fp8_config(rows, n, k, x.dtype, x.device.type, x.device.index)
    if isinstance(choice, GemvConfig) and rows >= 1:
        if rows == 1:
            from custom_ops.triton_gemv import gemv  # lazy: Triton is imported only where it runs
            y = gemv(flat, weight, choice, out, gate=gate, scale=scale)
        else:
            from custom_ops.linear import run_act_and_mul
            from custom_ops.triton_skinny import skinny_gemm
            flat = run_act_and_mul(flat, gate) if gate else flat
            y = skinny_gemm(flat, weight, choice, out, scale=scale)
    else:
        if gate:
            from custom_ops.linear import run_act_and_mul
            flat = run_act_and_mul(flat, gate)
        method = choice if isinstance(choice, str) else fp8_large_method(n, k, x.dtype, x.device.type,
                                                                          x.device.index)
        y = fp8_matmul(flat, weight, scale, method)
        if out is not None:
            y = out.copy_(y)
    if bias is not None:
        y = y + bias
    return y if out is not None else y.view(*x.shape[:-1], n)
