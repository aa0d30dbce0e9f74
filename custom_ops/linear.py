"""`torch.ops.infer.linear(x, weight, bias) -> x @ weight^T (+ bias)`: a linear layer that runs the
Triton GEMV (custom_ops.triton_gemv) where a measurement says it beats cuBLAS, F.linear elsewhere.

The op is opaque to Dynamo and Inductor (a fake implementation gives the shape), so the choice is
made at run time, per call, from the shapes (custom_ops.gemv_table): at one row on CUDA in bf16 or
fp16 with a measured (N, K), the GEMV; otherwise F.linear. A CUDA graph records the kernel the call
chose at capture, and each decode batch size is captured as its own graph, so the batch-1 decode
graph replays the GEMV and every larger one cuBLAS.

Models trace it only when switched on (models.set_decode_gemv; eager code calls `run_linear`
itself); switched off, their linears are plain F.linear and Inductor keeps its own matmul lowering.
A step that ran the op without a graph would call it through the dispatcher, ~20 us of host time
per linear (shared/TOOLCHAIN.md; 4 per layer), where Inductor's own matmul costs a few; so the
backend rewrites it into aten.linear in the pieces when FULL steps have their own code for the decode
graphs (compile_backend.compile_pieces.lower_graph_only_ops), and graph replays pay nothing.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from custom_ops.gemv_table import gemv_config


def run_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The op's implementation, callable directly by eager code. `out`: for a 2-D x and no bias, a
    [rows, N] buffer the matmul writes itself and that is returned (the decode graphs' static logits:
    no copy pass over the vocabulary)."""
    n, k = weight.shape
    if out is not None and (bias is not None or x.dim() != 2):
        raise ValueError(f"custom_ops.linear: `out` needs a 2-D x and no bias (x {tuple(x.shape)}, "
                         f"bias {'given' if bias is not None else 'None'})")
    config = None
    if x.dtype == weight.dtype and weight.stride(-1) == 1 and x.shape[-1] == k:  # what the GEMV takes
        config = gemv_config(x.numel() // max(k, 1), n, k, x.dtype, x.device.type)
    if config is None:
        if out is None:
            return F.linear(x, weight, bias)
        return torch.mm(x, weight.t(), out=out)  # what F.linear runs, into out
    from custom_ops.triton_gemv import gemv  # lazy: Triton is imported only where a GEMV runs
    y = gemv(x.reshape(1, k), weight, config, out)
    if bias is not None:
        y += bias
    return y if out is not None else y.view(*x.shape[:-1], n)


def gemv_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What a model calls for a switched-on matmul: the op while Dynamo traces (opaque, so the choice
    is made when the graph runs), the implementation itself when eager (no dispatcher on the host path,
    ~20 us per call)."""
    if torch.compiler.is_compiling():
        return torch.ops.infer.linear(x, weight, bias)
    return run_linear(x, weight, bias)


@torch.library.custom_op("infer::linear", mutates_args=())
def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return run_linear(x, weight, bias)


@decode_linear.register_fake
def _decode_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
