"""`torch.ops.infer.linear(x, weight, bias) -> x @ weight^T (+ bias)`: a linear layer that runs the
Triton GEMV (custom_ops.triton_gemv) where a measurement says it beats cuBLAS, F.linear elsewhere;
`torch.ops.infer.gated_linear(gate_up, weight, activation)` the same for a gated MLP's down
projection, with act(gate) * up computed inside the GEMV (one launch fewer per layer at batch 1);
`torch.ops.infer.act_and_mul(gate_up, activation)` the activation alone, one Triton launch on CUDA
(where the gated op does not run the GEMV, and in every piece Inductor compiles).

The op is opaque to Dynamo and Inductor (a fake implementation gives the shape), so the choice is
made at run time, per call, from the shapes (custom_ops.gemv_table): on CUDA in bf16 or fp16 with a
measured (N, K), the GEMV at one row and at 2-64 rows the skinny GEMM (custom_ops.triton_skinny) or
cuBLASLt where the table says so; otherwise F.linear. A CUDA graph records the kernel the call chose
at capture, and each decode batch size is captured as its own graph, so the batch-1 decode graph
replays the GEMV and the batch-64 one the choices for 64 rows.

Models trace it only when switched on (models.set_decode_gemv; eager code calls `run_linear`
itself); switched off, their linears are plain F.linear and Inductor keeps its own matmul lowering.
Switched on, the compiled pieces call it too: graph replays pay nothing for it, and a step without a
graph pays ~3.6 us per call more than a plain matmul (the dispatcher and the table lookup;
bench/results/cpu-2026-12-07/graph-only-op-cost).

FP8 weights (custom_ops.fp8): `linear` and `gated_linear` take an optional `weight_scale`, the float32
scale per row of a float8_e4m3fn weight; given, the matmul is custom_ops.fp8.run_fp8_linear (the FP8
GEMV / skinny GEMM up to 64 rows, dequantize + cuBLAS or torch._scaled_mm above); a model not switched
to the ops traces custom_ops.fp8.fp8_linear_plain instead.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from custom_ops.fp8 import fp8_linear_plain, run_fp8_linear
from custom_ops.gemv_table import CUBLASLT, GemvConfig, gemv_config
from custom_ops.registry import infer_op


def table_config(x: torch.Tensor, weight: torch.Tensor, rows: int) -> GemvConfig | str | None:
    """The table's choice for `rows` rows of x against weight [N, K] (custom_ops.gemv_table.gemv_config),
    or None for cuBLAS: only where the kernels can read them (one dtype, a row-major weight)."""
    if x.dtype != weight.dtype or weight.stride(-1) != 1:
        return None
    n, k = weight.shape
    return gemv_config(rows, n, k, x.dtype, x.device.type, x.device.index)


@contextlib.contextmanager
def _blas(library: str) -> Iterator[None]:
    """torch's matmuls through cuBLAS `library` inside the block (a process-wide torch setting, so it
    is restored at once; a graph records the kernel chosen at capture)."""
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def matmul_rows(x: torch.Tensor, weight: torch.Tensor, choice: GemvConfig | str,
                out: torch.Tensor | None = None, keys: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, K] @ weight^T for 2-64 rows, as the table's `choice` says: the Triton skinny GEMM's
    config (`keys`: its argmax keys too, see run_linear), or CUBLASLT."""
    if choice == CUBLASLT:
        with _blas(CUBLASLT):
            return F.linear(x, weight) if out is None else torch.mm(x, weight.t(), out=out)
    from custom_ops.triton_skinny import skinny_gemm  # lazy: Triton is imported only where it runs
    return skinny_gemm(x, weight, choice, out, keys)


def argmax_key_tiles(rows: int, weight: torch.Tensor, dtype: torch.dtype, device_type: str) -> int | None:
    """The argmax keys per row `run_linear(x, weight, out=, keys=)` stores for `rows` rows of x of
    `dtype`: the skinny GEMM's N tiles where the table picks it with one K split (2-64 rows); None where
    the chosen kernel stores none (the GEMV at one row, cuBLAS, split K)."""
    if rows < 2 or dtype != weight.dtype or weight.stride(-1) != 1:
        return None
    n, k = weight.shape
    choice = gemv_config(rows, n, k, dtype, device_type, weight.device.index)
    if not isinstance(choice, GemvConfig):
        return None
    from custom_ops.triton_skinny import key_tiles  # lazy: Triton is imported only where it runs
    return key_tiles(n, choice)


def run_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None, keys: torch.Tensor | None = None,
               weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The op's implementation, callable directly by eager code. `out`: for a 2-D x and no bias, a
    [rows, N] buffer the matmul writes itself and that is returned (the decode graphs' static logits:
    no copy pass over the vocabulary). `keys`: with `out`, an int64 [rows, argmax_key_tiles(...)] the
    matmul fills with its tiles' argmax keys (custom_ops.triton_argmax.argmax_of_keys: the greedy token
    without reading the logits again). `weight_scale`: weight is FP8 with this scale per row
    (custom_ops.fp8; no keys)."""
    if weight_scale is not None:
        if keys is not None:
            raise ValueError("custom_ops.linear: argmax keys are not stored for an FP8 weight")
        return run_fp8_linear(x, weight, weight_scale, bias, out)
    n, k = weight.shape
    if out is not None and (bias is not None or x.dim() != 2):
        raise ValueError(f"custom_ops.linear: `out` needs a 2-D x and no bias (x {tuple(x.shape)}, "
                         f"bias {'given' if bias is not None else 'None'})")
    if keys is not None:
        tiles = None if out is None else argmax_key_tiles(x.shape[0], weight, x.dtype, x.device.type)
        if tiles is None or keys.shape != (x.shape[0], tiles):
            raise ValueError(f"custom_ops.linear: keys {tuple(keys.shape)} need `out` and the skinny GEMM's "
                             f"one-split choice for x {tuple(x.shape)} and weight {tuple(weight.shape)} "
                             f"([rows, {tiles}])")
        return matmul_rows(x, weight, table_config(x, weight, x.shape[0]), out, keys)
    config = table_config(x, weight, x.numel() // max(k, 1)) if x.shape[-1] == k else None
    if config is None:
        if out is None:
            return F.linear(x, weight, bias)
        return torch.mm(x, weight.t(), out=out)  # what F.linear runs, into out
    rows = x.numel() // k
    if rows == 1:
        from custom_ops.triton_gemv import gemv  # lazy: Triton is imported only where a GEMV runs
        y = gemv(x.reshape(1, k), weight, config, out)
    else:
        y = matmul_rows(x.reshape(rows, k), weight, config, out)
    if bias is not None:
        y += bias
    return y if out is not None else y.view(*x.shape[:-1], n)


def gemv_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """What a model calls for a switched-on matmul: the op while Dynamo traces (opaque, so the choice
    is made when the graph runs), the implementation itself when eager (no dispatcher on the host path,
    ~20 us per call). `weight_scale`: an FP8 weight's scale per row."""
    if torch.compiler.is_compiling():
        if weight_scale is None:  # the graph of a bf16 model stays as it was
            return torch.ops.infer.linear(x, weight, bias)
        return torch.ops.infer.linear(x, weight, bias, weight_scale)
    return run_linear(x, weight, bias, weight_scale=weight_scale)


def scaled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  weight_scale: torch.Tensor) -> torch.Tensor:
    """An FP8 linear layer that is not switched to the op (decode_gemv off): traced, the plain form
    (Inductor lowers it with the rest); eager, the implementation (the FP8 GEMV where it runs)."""
    if torch.compiler.is_compiling():
        return fp8_linear_plain(x, weight, bias, weight_scale)
    return run_fp8_linear(x, weight, weight_scale, bias)


GATED_ACTIVATIONS = ("silu", "gelu_tanh")


def _check_activation(op: str, activation: str) -> None:
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(f"custom_ops.{op}: activation {activation!r} is not one of {GATED_ACTIVATIONS}")


def _check_gate_up(op: str, gate_up: torch.Tensor) -> None:
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"custom_ops.{op}: gate_up {tuple(gate_up.shape)} must end in an even size "
                         f"(2 * K = [gate | up])")


def act_and_mul_plain(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up for gate_up [..., 2K] = [gate | up], in torch: the rounding contract (act(gate)
    rounded to the input dtype, then the product rounded), the CPU path and the tests' reference."""
    _check_activation("act_and_mul", activation)
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh") * up


_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # computed in float32 by the kernel


def run_act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """The act-and-mul op's implementation: on CUDA one Triton launch (custom_ops.triton_gemv.act_mul,
    rounded as act_and_mul_plain rounds), elsewhere act_and_mul_plain. Returns [..., K], contiguous."""
    _check_activation("act_and_mul", activation)
    _check_gate_up("act_and_mul", gate_up)
    if not gate_up.is_cuda or gate_up.dtype not in _KERNEL_DTYPES or gate_up.numel() == 0:
        return act_and_mul_plain(gate_up, activation).contiguous()  # the layout the fake promises
    from custom_ops.triton_gemv import act_mul  # lazy: Triton is imported only where it runs
    width = gate_up.shape[-1]
    return act_mul(gate_up.reshape(-1, width), activation).view(*gate_up.shape[:-1], width // 2)


# Opaque to Inductor on purpose: the pieces it compiles for the symbolic token count lower
# act(gate) * up to a pointwise kernel that reaches about half the Triton kernel's bandwidth on an
# H100, and a prefill step runs it once per layer.
@infer_op("act_and_mul")
def act_and_mul_op(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    return run_act_and_mul(gate_up, activation)


@act_and_mul_op.register_fake
def _act_and_mul_fake(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    _check_activation("act_and_mul", activation)
    _check_gate_up("act_and_mul", gate_up)
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


def act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """What a model calls for a gated MLP's act(gate) * up: the op while Dynamo traces, the
    implementation itself when eager (no dispatcher on the host path)."""
    if torch.compiler.is_compiling():
        return torch.ops.infer.act_and_mul(gate_up, activation)
    return run_act_and_mul(gate_up, activation)


def run_gated_linear(gate_up: torch.Tensor, weight: torch.Tensor, activation: str,
                     weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`act(gate) @ weight^T * up` for gate_up [..., 2K], weight [N, K]: the down projection of a gated
    MLP with its activation inside the Triton GEMV where `run_linear` would run the GEMV (one row,
    a measured shape); elsewhere one act-and-multiply launch on CUDA (torch's two on the CPU) and the
    matmul, as before. `weight_scale`: an FP8 weight's scale per row (custom_ops.fp8)."""
    n, k = weight.shape
    _check_activation("gated_linear", activation)
    if gate_up.shape[-1] != 2 * k:
        raise ValueError(f"custom_ops.gated_linear: gate_up {tuple(gate_up.shape)} must end in 2 * K = {2 * k} "
                         f"for weight {tuple(weight.shape)}")
    if weight_scale is not None:
        return run_fp8_linear(gate_up, weight, weight_scale, gate=activation)
    rows = gate_up.numel() // max(2 * k, 1)
    config = table_config(gate_up, weight, rows)
    if config is None and not gate_up.is_cuda:
        return F.linear(act_and_mul_plain(gate_up, activation), weight)
    from custom_ops.triton_gemv import act_mul, gemv  # lazy: Triton is imported only where it runs
    flat = gate_up.reshape(rows, 2 * k)
    if config is not None and rows == 1:
        return gemv(flat, weight, config, gate=activation).view(*gate_up.shape[:-1], n)
    # Above one row the matmul reads act_mul's output: the skinny GEMM recomputing the activation in
    # every program cost more than the extra launch.
    x = act_mul(flat, activation)
    y = F.linear(x, weight) if config is None else matmul_rows(x, weight, config)
    return y.view(*gate_up.shape[:-1], n)


def gated_gemv_linear(gate_up: torch.Tensor, weight: torch.Tensor, activation: str,
                      weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """What a model calls for a switched-on gated down projection: the op while Dynamo traces, the
    implementation itself when eager."""
    if torch.compiler.is_compiling():
        if weight_scale is None:
            return torch.ops.infer.gated_linear(gate_up, weight, activation)
        return torch.ops.infer.gated_linear(gate_up, weight, activation, weight_scale)
    return run_gated_linear(gate_up, weight, activation, weight_scale)


@infer_op("gated_linear")
def gated_linear(gate_up: torch.Tensor, weight: torch.Tensor, activation: str,
                 weight_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    return run_gated_linear(gate_up, weight, activation, weight_scale)


@gated_linear.register_fake
def _gated_linear_fake(gate_up: torch.Tensor, weight: torch.Tensor, activation: str,
                       weight_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    return gate_up.new_empty((*gate_up.shape[:-1], weight.shape[0]))


@infer_op("linear")
def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  weight_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    return run_linear(x, weight, bias, weight_scale=weight_scale)


@decode_linear.register_fake
def _decode_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        weight_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
