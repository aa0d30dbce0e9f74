"""What every causal LM here has in common: the flat-token contract, logits, tied embeddings, names.

`forward(input_ids[T], positions[T]) -> hidden[T, H]` runs the decoder stack (`self.model`, laid out
like transformers' so checkpoint names map one to one, apart from the fused qkv / gate_up matmuls).
`compute_logits(hidden[N, H]) -> [N, V]` is separate because the engine computes logits only for each
sequence's last token, outside the captured graph.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from custom_ops import argmax_key_tiles, gemv_linear, run_linear, unique_prefix
from models.config import ModelConfig, RopeParams
from models.layers import Embedding, Linear, RotaryEmbedding, init_random_
from models.parallel import SINGLE, Part, TensorParallel, vocab_range


class DecoderModel(nn.Module):
    """embed -> decoder layers -> final norm: the stack every model here shares, named like
    transformers' `model.*` so checkpoint names map. Each model gives its layers, its final norm,
    its rope tables (`ropes`, with `layer_rope[i]` the table of layer i) and, for Gemma, the
    embedding scale.
    """

    def __init__(
        self, config: ModelConfig, layers: list[nn.Module], norm: nn.Module,
        ropes: tuple[RopeParams, ...], layer_rope: list[int], embed_scale: float | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, config.dtype, tp)
        # transformers multiplies by the scale rounded to the weight dtype; a buffer (not a Python
        # float) keeps that rounding when the model is cast with .to(dtype).
        self.register_buffer("embed_scale", None if embed_scale is None else torch.tensor(
            embed_scale, dtype=config.dtype), persistent=False)
        self.rotary = nn.ModuleList(
            RotaryEmbedding(params, config.head_dim, config.max_position_embeddings) for params in ropes)
        self.layer_rope = list(layer_rope)
        self.layers = nn.ModuleList(layers)
        self.norm = norm

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            h = h * self.embed_scale.to(h.dtype)
        # Every table is gathered once per step and shared by its layers; which table a layer reads is
        # static, so the choice is resolved at trace time and leaves no branch in the graph.
        tables = [rotary(positions, h.dtype) for rotary in self.rotary]
        # A layer returns the residual stream and its own contribution unadded (and names the norm
        # that contribution still needs, Gemma's post-MLP norm): the next layer's first norm, or the
        # final one, does that norm, the add and its own norm in one kernel.
        delta = delta_norm = None
        for layer, rope in zip(self.layers, self.layer_rope):
            h, delta = layer(h, delta, delta_norm, *tables[rope])
            delta_norm = layer.branch_norm
        return self.norm.add_and_norm(h, delta, delta_norm)[1]


class CausalLM(nn.Module):
    name_stem = "model_"  # layer-name prefix stem; subclasses name their architecture
    decode_gemv = False   # the logits matmul through torch.ops.infer.linear (set_decode_gemv)

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        """`tp`: this rank's place in a tensor-parallel group; the model then holds only its shards."""
        super().__init__()
        self.config = config
        self.tp = tp
        # A fresh prefix per instance: two models in one process never share an attention layer's
        # registry entry (its constants; KV caches belong to engines and travel in the forward context).
        self.layer_prefix = unique_prefix(self.name_stem)
        self.model = self.build_decoder(config)
        start, real, rows = vocab_range(config.vocab_size, tp)  # vocab-parallel, like the embedding
        self.lm_head = None if config.tie_word_embeddings else Linear(
            config.hidden_size, rows, False, config.dtype, parts=(Part(None, real, config.vocab_size, start),))
        if self.lm_head is not None and rows > real:
            self.lm_head.weight.data[real:].zero_()  # padding rows: their logits are cut off after the gather

    def build_decoder(self, config: ModelConfig) -> nn.Module:
        raise NotImplementedError

    def layer_name(self, index: int) -> str:
        return f"{self.layer_prefix}.layers.{index}"

    @property
    def attention_layer_names(self) -> list[str]:
        """One name per attention layer, in layer order; an engine keeps one KV cache per name."""
        return [layer.self_attn.layer_name for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def _logits_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def argmax_key_tiles(self, rows: int) -> int | None:
        """The argmax keys per row `compute_logits(hidden, out=, keys=)` stores for `rows` rows, or None
        where it stores none: the switched-on logits matmul on one rank, without a final softcap (a
        capped logit's argmax is the raw one's only up to ties tanh's rounding makes)."""
        weight = self._logits_weight()
        if (not self.decode_gemv or self.tp.world_size != 1 or weight.shape[0] != self.config.vocab_size
                or self.config.final_logit_softcap):
            return None
        return argmax_key_tiles(rows, weight, weight.dtype, weight.device.type)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None,
                       keys: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [N, V] of hidden [N, H]. `out` (a [N, V] buffer in the logits' dtype): written and
        returned, by the matmul itself on one rank (no copy pass over the vocabulary: the decode
        graphs' static logits), by a copy after the gather under tensor parallelism. `keys` (with
        `out`, where argmax_key_tiles(N) is not None): an int64 [N, tiles] the matmul fills with its
        tiles' argmax keys, from which the sampler's greedy tokens come without re-reading the logits."""
        weight = self._logits_weight()
        cap = self.config.final_logit_softcap
        if keys is not None and (out is None or self.argmax_key_tiles(hidden.shape[0]) is None):
            raise ValueError(f"compute_logits keys {tuple(keys.shape)}: this model stores no argmax keys for "
                             f"{hidden.shape[0]} rows (argmax_key_tiles is None) or `out` is missing")
        if out is not None and self.tp.world_size == 1 and weight.shape[0] == self.config.vocab_size:
            if out.shape != (hidden.shape[0], weight.shape[0]) or out.dtype != hidden.dtype:
                raise ValueError(f"compute_logits out {tuple(out.shape)} {out.dtype} must be "
                                 f"[{hidden.shape[0]}, {weight.shape[0]}] {hidden.dtype}")
            if self.decode_gemv:  # eager here (the decode graphs call this outside torch.compile)
                run_linear(hidden, weight, out=out, keys=keys)
            else:
                torch.mm(hidden, weight.t(), out=out)  # what F.linear runs, into out
            if cap:  # in place, the same ops as below
                out.div_(cap).tanh_().mul_(cap)
            return out
        # Each rank computes its vocabulary shard's logits; the gather gives every rank the whole row
        # (only rank 0 samples) and drops the padding rows of the last shard.
        local = gemv_linear(hidden, weight) if self.decode_gemv else F.linear(hidden, weight)
        logits = self.tp.all_gather_last(local)[:, :self.config.vocab_size]
        if cap:
            logits = torch.tanh(logits / cap) * cap
        if out is not None:
            return out.copy_(logits)
        return logits

    def init_random_(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        init_random_(self, std, generator)


def matmul_weights(model: nn.Module) -> list[torch.Tensor]:
    """The weights of every matmul the model runs through the decode GEMV switch (set_decode_gemv): each
    models.layers.Linear's, then the logits matmul's (the LM head or the tied embedding)."""
    weights = [sub.weight for sub in model.modules() if isinstance(sub, Linear)]
    weights += [sub._logits_weight() for sub in model.modules() if isinstance(sub, CausalLM)]
    return weights


def set_decode_gemv(model: nn.Module, on: bool) -> int:
    """Switch every models.layers.Linear of `model` and its logits matmul (the LM head or the tied
    embedding) to `torch.ops.infer.linear` (the Triton GEMV at one row where measured faster than
    cuBLAS: custom_ops.gemv_table), or back to F.linear. Call it before the model is compiled or
    captured: the switch is read when the forward is traced. Returns how many modules it set (0: the
    model has no layer of ours).
    """
    switched = 0
    for sub in model.modules():
        if isinstance(sub, (Linear, CausalLM)):
            sub.decode_gemv = bool(on)
            switched += 1
    return switched
