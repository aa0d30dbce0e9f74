"""The pieces Llama, Qwen3 and Gemma 3 share: linear/embedding, RMSNorm, rotary embedding, gated MLP,
and the attention block that calls `torch.ops.infer.attention`.

Under tensor parallelism (`tp`, models.parallel) each layer holds its rank's shard: `qkv_proj` and
`gate_up_proj` their rank's heads / intermediate columns, `o_proj` and `down_proj` their rank's input
features (summed by one all-reduce), the embedding its vocabulary rows. `parts` records which
checkpoint rows each shard reads, for the loader.

Everything here is graph-capture friendly: no host syncs, no data-dependent control flow, and every
per-step quantity is a tensor op on the inputs (rope reads a precomputed cos/sin table by position).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from custom_ops import (
    FP8_DTYPE, AttentionLayer, act_and_mul, add_rms_norm, gated_gemv_linear, gemv_linear, linear_rope, qk_norm_rope,
    quantize_rows, register_attention_layer, rms_norm, scaled_linear,
)
from models.config import ModelConfig, RopeParams
from models.parallel import SINGLE, HeadSplit, Part, TensorParallel, check_divides, vocab_parallel_embedding, vocab_range


class Linear(nn.Module):
    """nn.Linear without the random init: checkpoints overwrite every weight, and init of a multi-GB
    model costs seconds; `init_random_` fills weights when a model is built from a config only.

    Column-parallel: out_features is this rank's share and `parts` says which checkpoint rows fill
    it. Row-parallel (`input_parallel=True`): in_features is the full size, this rank holds
    in_features / world_size of it, and the partial products are summed across ranks before the
    (replicated) bias is added once.

    `decode_gemv` (set for a whole model by models.set_decode_gemv, before it is compiled): the matmul
    is the Triton GEMV at one row for the shapes measured faster than cuBLAS (custom_ops.gemv_table),
    F.linear otherwise; traced as the opaque `torch.ops.infer.linear`, called directly when eager.

    FP8 (`to_fp8_`, models.quantization): `weight` holds float8_e4m3fn values and `weight_scale` one
    float32 scale per output row (None for a weight in the model dtype); every matmul then goes through
    custom_ops.fp8 with the scale beside the weight, and the fused q/k/v and gate/up rows keep their
    own scales. The bias stays in the model dtype.
    """

    decode_gemv = False

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, *,
                 parts: tuple[Part, ...] | None = None, tp: TensorParallel = SINGLE,
                 input_parallel: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.parts = parts
        self.input_shard: tuple[int, int] | None = None  # (full in_features, first column) when row-parallel
        if input_parallel and tp.world_size > 1:
            check_divides(tp.world_size, in_features, "the input size of a row-parallel projection")
            local = in_features // tp.world_size
            self.input_shard = (in_features, tp.rank * local)
            in_features = local
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.register_parameter("weight_scale", None)  # FP8 only (to_fp8_)

    @property
    def is_fp8(self) -> bool:
        return self.weight_scale is not None

    def to_fp8_(self, quantize: bool = True) -> None:
        """Store this weight as FP8 with a scale per output row: quantized from the current values
        (custom_ops.fp8.quantize_rows), or (quantize=False) left empty for a loader to fill."""
        if self.is_fp8:
            return
        weight = self.weight.data
        if quantize:
            q, scale = quantize_rows(weight)
        else:
            q = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
            scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_shard is None:
            return self._matmul(x, self.bias)
        y = self.tp.all_reduce(self._matmul(x, None))
        return y if self.bias is None else y + self.bias

    def gated(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        """This projection of act(gate) * up, for gate_up [..., 2 * in_features]: with decode_gemv on,
        one op that computes the activation inside the GEMV at one row (custom_ops.linear)."""
        if not self.decode_gemv:
            return self(act_and_mul(gate_up, activation))
        y = gated_gemv_linear(gate_up, self.weight, activation, self.weight_scale)
        if self.input_shard is not None:
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def with_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                  num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(this q/k/v projection of x, its q heads rotated, its k heads rotated) for a layer without
        q/k norms: with decode_gemv on, one op whose GEMV rotates q and k as it writes them at one
        row (custom_ops.qkv_rope); off, the projection and the rotary op."""
        if self.decode_gemv and self.input_shard is None:
            return linear_rope(x, self.weight, self.bias, cos, sin, num_heads, num_kv_heads, self.weight_scale)
        qkv = self(x)
        q, k = qk_norm_rope(qkv, cos, sin, None, None, 0.0, False, num_heads, num_kv_heads)
        return qkv, q, k

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # A Python bool read at trace time: switched off, the traced graph holds F.linear exactly as
        # before (Inductor lowers it itself); on, the op that picks the GEMV at one row.
        if self.decode_gemv:
            return gemv_linear(x, self.weight, bias, self.weight_scale)
        if self.weight_scale is not None:
            return scaled_linear(x, self.weight, bias, self.weight_scale)
        return F.linear(x, self.weight, bias)


class Embedding(nn.Module):
    """A vocab-parallel embedding: this rank holds token rows [vocab_start, vocab_start + real rows)
    (all of them with one rank); rows allocated past the vocabulary stay zero."""

    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_start, real, rows = vocab_range(num_embeddings, tp)
        self.parts = (Part(None, real, num_embeddings, self.vocab_start),)
        self.weight = nn.Parameter(torch.empty(rows, dim, dtype=dtype))
        if rows > real:
            self.weight.data[real:].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embedding(ids, self.weight, self.vocab_start, self.tp)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (custom_ops.norm.rms_norm says in which order it rounds: Llama's
    round-then-scale, or with `unit_offset=True` Gemma's (1 + w), its checkpoints storing w around 0).
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.unit_offset)

    def add_and_norm(self, h: torch.Tensor, delta: torch.Tensor | None, delta_norm: RMSNorm | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, norm(h + delta)), the sum rounded to h's dtype first, in one kernel on CUDA (the
        residual stream's add and the next block's norm); with no delta, (h, norm(h)). `delta_norm`:
        a norm the branch still needs before the add (Gemma 3's post-attention / post-MLP norms),
        done in the same kernel."""
        if delta is None:
            return h, self(h)
        delta_weight = None
        if delta_norm is not None:
            if (delta_norm.eps, delta_norm.unit_offset) == (self.eps, self.unit_offset):
                delta_weight = delta_norm.weight
            else:  # the kernel takes one eps and variant for both norms
                delta = delta_norm(delta)
        return add_rms_norm(h, delta, self.weight, self.eps, self.unit_offset, delta_weight)


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_positions, head_dim // 2] computed once; a step only gathers rows by position.

    The tables stay float32 (a buffer, not a parameter: not in the state dict); the gathered rows are
    rounded to the activation dtype once per step, the same rounding transformers applies per layer.
    """

    def __init__(self, params: RopeParams, head_dim: int, max_positions: int) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), params.inv_freq(head_dim))
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim // 2] for q/k of shape [T, heads, head_dim]."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul (`gate_up_proj`)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        full = config.intermediate_size
        check_divides(tp.world_size, full, "intermediate_size")
        local = full // tp.world_size
        start = tp.rank * local
        self.gate_up_proj = Linear(
            config.hidden_size, 2 * local, config.mlp_bias, config.dtype, tp=tp,
            parts=(Part("gate_proj", local, full, start), Part("up_proj", local, full, start)))
        self.down_proj = Linear(full, config.hidden_size, config.mlp_bias, config.dtype, tp=tp, input_parallel=True)
        self.activation = "gelu_tanh" if config.hidden_act == "gelu_pytorch_tanh" else "silu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.gated(self.gate_up_proj(x), self.activation)


class Attention(nn.Module):
    """q/k/v projection (fused `qkv_proj`), optional per-head q/k norms, rope, the attention op, o_proj.

    The per-layer constants go into the custom-op registry under `layer_name`, so the op call carries
    only tensors and a name: Dynamo sees one node per layer and the graph bakes in no Python floats.
    """

    def __init__(
        self, config: ModelConfig, layer_name: str, *, sliding_window: int | None,
        qk_norm: bool, unit_offset_norm: bool = False, tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.layer_name = layer_name
        split = HeadSplit.of(config.num_heads, config.num_kv_heads, tp)
        self.num_heads, self.num_kv_heads, self.head_dim = split.num_heads, split.num_kv_heads, config.head_dim
        d = config.head_dim
        self.q_size = split.num_heads * d
        self.kv_size = split.num_kv_heads * d
        q_full, kv_full = config.num_heads * d, config.num_kv_heads * d
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, config.attention_bias, config.dtype, tp=tp,
            parts=(Part("q_proj", self.q_size, q_full, split.q_start * d),
                   Part("k_proj", self.kv_size, kv_full, split.kv_start * d),
                   Part("v_proj", self.kv_size, kv_full, split.kv_start * d)))
        self.o_proj = Linear(q_full, config.hidden_size, config.attention_bias, config.dtype, tp=tp,
                             input_parallel=True)
        if qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.dtype, unit_offset_norm)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.dtype, unit_offset_norm)
        else:
            self.q_norm = self.k_norm = None
        register_attention_layer(layer_name, AttentionLayer(
            num_heads=split.num_heads, num_kv_heads=split.num_kv_heads, head_dim=config.head_dim,
            scale=config.attention_scale, sliding_window=sliding_window,
            logit_softcap=config.attn_logit_softcap, qk_norm_eps=config.rms_norm_eps,
            qk_norm_unit_offset=unit_offset_norm), owner=self)  # the entry goes with this module

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        qk_size = self.q_size + self.kv_size
        # With per-head q/k norms (Qwen3, Gemma 3) one kernel normalizes and rotates q and k together
        # (custom_ops.rope), and the attention op also gets the raw q / k with the tables and weights:
        # in decode steps outside piecewise replays the rotary op defers (writes nothing) and the
        # decode attention kernel does the work on the rows it reads, one kernel per layer fewer.
        # Without norms (Llama) the rotary rides in the projection's own GEMV at one row
        # (Linear.with_rope), else in that same kernel.
        if self.q_norm is not None:
            qkv = self.qkv_proj(x)
            q, k = qk_norm_rope(qkv, cos, sin, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                self.q_norm.unit_offset, self.num_heads, self.num_kv_heads,
                                defer_to_attention=True)
            raw_q = qkv[:, :self.q_size].view(num_tokens, self.num_heads, self.head_dim)
            raw_k = qkv[:, self.q_size:qk_size].view(num_tokens, self.num_kv_heads, self.head_dim)
            rotary = (raw_q, raw_k, cos, sin, self.q_norm.weight, self.k_norm.weight)
        else:
            qkv, q, k = self.qkv_proj.with_rope(x, cos, sin, self.num_heads, self.num_kv_heads)
            rotary = ()
        # v stays a strided view of the fused projection (row stride q_size + 2 * kv_size): every
        # attention path (the Triton store, decode and prefill kernels, the reference) honours token
        # and head strides, and a .contiguous() here was one copy kernel per layer per step.
        v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        # Allocated right before the op so a graph split at the op hands this buffer, at a fixed
        # address, from the piece before (which allocates it) to the piece after (which reads it).
        out = torch.empty_like(q)
        torch.ops.infer.attention(q, k, v, out, self.layer_name, *rotary)
        return self.o_proj(out.view(num_tokens, self.q_size))


def init_random_(module: nn.Module, std: float = 0.02, generator: torch.Generator | None = None) -> None:
    """Random weights for a model built from a config alone (tests, benchmarks): normal(0, std)
    matrices, zero biases, and norms at identity (w = 1, or w = 0 for the (1 + w) variant)."""
    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, Linear) and sub.is_fp8:
                raise ValueError("init_random_: draw the weights before the model is made FP8")
            if isinstance(sub, (Linear, Embedding)):
                sub.weight.normal_(0.0, std, generator=generator)
                if isinstance(sub, Linear) and sub.bias is not None:
                    sub.bias.zero_()
            elif isinstance(sub, RMSNorm):
                sub.weight.fill_(0.0 if sub.unit_offset else 1.0)
