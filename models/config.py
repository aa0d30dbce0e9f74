"""ModelConfig: the one validated, frozen description of a model, read from any transformers config.

transformers changed its config format between 4.x and 5.x (rope_theta / rope_scaling /
rope_local_base_freq became rope_parameters, per layer type for Gemma 3; torch_dtype became dtype).
Everything version-specific is read here, once, so the model code sees only plain fields.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from models.errors import UnknownArchitectureError, UnsupportedConfigError

# config.json "architectures" entry -> our class name; model_type is the fallback for configs without it.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
SLIDING, FULL = "sliding_attention", "full_attention"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RopeParams:
    theta: float
    rope_type: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """Per-pair inverse frequencies [head_dim // 2] in float32, rope scaling applied."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (self.theta ** exponents)
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type == "llama3":
            # Llama 3.1: long wavelengths are stretched by `factor`, short ones kept, the band between
            # the two wavelength thresholds blended linearly in 1/wavelength.
            low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
            high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
            blend = ((self.original_max_position_embeddings / wavelen - self.low_freq_factor)
                     / (self.high_freq_factor - self.low_freq_factor))
            blended = (1 - blend) * scaled / self.factor + blend * scaled
            in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            return torch.where(in_band, blended, scaled)
        return inv_freq


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    tie_word_embeddings: bool
    dtype: torch.dtype
    hidden_act: str
    rope: RopeParams                          # full-attention layers (all layers of Llama / Qwen3)
    rope_local: RopeParams | None = None      # sliding layers of Gemma 3 (their own base frequency)
    layer_types: tuple[str, ...] = ()         # SLIDING / FULL per layer
    sliding_window: int | None = None         # key visible iff query_pos - key_pos < window
    attention_bias: bool = False
    mlp_bias: bool = False
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale = this ** -0.5
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    pad_token_id: int | None = None

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_hf(cls, config: Any, dtype: torch.dtype | str | None = None) -> ModelConfig:
        """From a transformers config object or a config.json dict (4.x or 5.x format)."""
        raw = dict(config) if isinstance(config, Mapping) else config.to_dict()
        return _parse(raw, dtype)


def architecture_of(raw: Mapping[str, Any]) -> str:
    names = list(raw.get("architectures") or [])
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    model_type = raw.get("model_type")
    if not names and model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    found = names[0] if names else f"model_type={model_type!r}"
    raise UnknownArchitectureError(
        f"unsupported architecture {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _require(raw: Mapping[str, Any], key: str) -> Any:
    if raw.get(key) is None:
        raise UnsupportedConfigError(f"config has no {key!r}")
    return raw[key]


def parse_dtype(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value not in _DTYPES.values():
            raise UnsupportedConfigError(f"dtype {value} is not one of {', '.join(_DTYPES)}")
        return value
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise UnsupportedConfigError(f"dtype {value!r} is not one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


_ROPE_KEYS = {"linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def _rope_params(spec: Mapping[str, Any] | None, theta: float | None, default_theta: float) -> RopeParams:
    spec = dict(spec or {})
    rope_type = spec.get("rope_type", spec.get("type", "default"))
    theta = spec.get("rope_theta", theta if theta is not None else default_theta)
    if float(spec.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedConfigError("partial_rotary_factor != 1 is not supported (rope over all of head_dim)")
    if rope_type == "default":
        return RopeParams(theta=float(theta))
    missing = [key for key in _ROPE_KEYS.get(rope_type, ()) if spec.get(key) is None]
    if missing:
        raise UnsupportedConfigError(f"rope type {rope_type!r} needs {', '.join(map(repr, missing))} in the "
                                     "config's rope parameters (rope_scaling / rope_parameters)")
    if rope_type == "linear":
        return RopeParams(theta=float(theta), rope_type="linear", factor=float(spec["factor"]))
    if rope_type == "llama3":
        return RopeParams(
            theta=float(theta), rope_type="llama3", factor=float(spec["factor"]),
            low_freq_factor=float(spec["low_freq_factor"]), high_freq_factor=float(spec["high_freq_factor"]),
            original_max_position_embeddings=int(spec["original_max_position_embeddings"]))
    raise UnsupportedConfigError(
        f"rope type {rope_type!r} is not supported; supported: 'default', 'linear', 'llama3'")


def _parse_rope(raw: Mapping[str, Any], is_gemma: bool) -> tuple[RopeParams, RopeParams | None]:
    params = raw.get("rope_parameters")
    if isinstance(params, Mapping) and (FULL in params or SLIDING in params):  # 5.x, per layer type
        full = _rope_params(params.get(FULL), None, 1_000_000.0 if is_gemma else 10_000.0)
        local = _rope_params(params.get(SLIDING), None, 10_000.0) if is_gemma else None
        return full, local
    if isinstance(params, Mapping) and params:                                # 5.x, one for all layers
        return _rope_params(params, raw.get("rope_theta"), 10_000.0), None
    # 4.x: rope_theta + rope_scaling (+ rope_local_base_freq for Gemma 3's sliding layers)
    if is_gemma:
        full = _rope_params(raw.get("rope_scaling"), raw.get("rope_theta"), 1_000_000.0)
        return full, RopeParams(theta=float(raw.get("rope_local_base_freq") or 10_000.0))
    return _rope_params(raw.get("rope_scaling"), raw.get("rope_theta"), 10_000.0), None


def _layer_types(raw: Mapping[str, Any], num_layers: int, is_gemma: bool) -> tuple[str, ...]:
    types = raw.get("layer_types")
    if types is None and is_gemma:
        # Older Gemma 3 configs give the interleave as a period: every pattern-th layer is global.
        pattern = int(raw.get("sliding_window_pattern") or 6)
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if types is None:
        use_sliding = raw.get("use_sliding_window", False) and raw.get("sliding_window")
        types = [SLIDING if use_sliding else FULL] * num_layers
    types = tuple(types)
    if len(types) != num_layers or any(t not in (SLIDING, FULL) for t in types):
        raise UnsupportedConfigError(
            f"layer_types must list {num_layers} entries of {SLIDING!r}/{FULL!r}, got {list(types)}")
    return types


def _parse(raw: dict[str, Any], dtype: torch.dtype | str | None) -> ModelConfig:
    architecture = architecture_of(raw)
    is_gemma = architecture == "Gemma3ForCausalLM"
    num_layers = int(_require(raw, "num_hidden_layers"))
    hidden = int(_require(raw, "hidden_size"))
    num_heads = int(_require(raw, "num_attention_heads"))
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    head_dim = int(raw.get("head_dim") or hidden // num_heads)
    if num_heads % num_kv_heads:
        raise UnsupportedConfigError(
            f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})")
    eos = raw.get("eos_token_id")
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]))
    if dtype is None:
        dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    rope, rope_local = _parse_rope(raw, is_gemma)
    layer_types = _layer_types(raw, num_layers, is_gemma)
    sliding_window = raw.get("sliding_window") if SLIDING in layer_types else None
    if SLIDING in layer_types and not sliding_window:
        raise UnsupportedConfigError("layer_types has sliding_attention layers but sliding_window is not set")
    if raw.get("use_bidirectional_attention"):
        # EmbeddingGemma-style encoders: not a causal LM, and the op only does causal attention.
        raise UnsupportedConfigError("use_bidirectional_attention=True is not supported (causal LMs only)")
    act_key = "hidden_activation" if is_gemma and raw.get("hidden_activation") else "hidden_act"
    hidden_act = raw.get(act_key) or ("gelu_pytorch_tanh" if is_gemma else "silu")
    if hidden_act not in ("silu", "gelu_pytorch_tanh"):
        raise UnsupportedConfigError(
            f"{act_key}={hidden_act!r} is not supported; supported: 'silu', 'gelu_pytorch_tanh'")
    default_tied = is_gemma  # transformers' defaults: Gemma 3 ties, Llama and Qwen3 do not
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(_require(raw, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_require(raw, "intermediate_size")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(_require(raw, "max_position_embeddings")),
        rms_norm_eps=float(raw.get("rms_norm_eps") or 1e-6),
        eos_token_ids=eos_ids,
        bos_token_id=raw.get("bos_token_id"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", default_tied)),
        dtype=parse_dtype(dtype),
        hidden_act=hidden_act,
        rope=rope,
        rope_local=rope_local,
        layer_types=layer_types,
        sliding_window=int(sliding_window) if sliding_window else None,
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or head_dim) if is_gemma else None,
        attn_logit_softcap=(raw.get("attn_logit_softcapping") or None) if is_gemma else None,
        final_logit_softcap=(raw.get("final_logit_softcapping") or None) if is_gemma else None,
        pad_token_id=raw.get("pad_token_id"),
    )
