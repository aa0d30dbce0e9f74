"""Torch custom ops (attention, in place; linear, the decode GEMV where measured; the q/k/v projection
with its rotary; the residual add with its RMSNorm; q/k norm and rotary; each with a fake
implementation; FP8 weights with a scale per row, custom_ops.fp8) and their kernels."""
from custom_ops import all_reduce as _all_reduce  # registers infer::all_reduce (models.parallel calls it)
from custom_ops.attention import attention, run_attention
from custom_ops.forward_context import ForwardContext, RuntimeMode, forward_context, get_forward_context
from custom_ops.gemv_table import GEMV_CONFIGS, GemvConfig, gemv_config
from custom_ops.layers import (
    AttentionLayer, check_kv_cache, get_attention_layer, is_registered, register_attention_layer, unique_prefix,
)
from custom_ops.fp8 import FP8_DTYPE, dequantize, fp8_linear_plain, quantize_rows, run_fp8_linear
from custom_ops.linear import (
    act_and_mul, act_and_mul_plain, argmax_key_tiles, decode_linear, gated_gemv_linear,
    gemv_linear, run_gated_linear, run_linear, scaled_linear,
)
from custom_ops.qkv_rope import linear_rope, run_linear_rope
from custom_ops.norm import add_rms_norm, rms_norm, run_add_rms_norm
from custom_ops.rope import apply_rotary, qk_norm_rope, run_qk_norm_rope
from custom_ops.metadata import SCRATCH_BLOCK, AttentionMetadata, allocate_kv_cache

__all__ = [
    "attention", "run_attention", "ForwardContext", "RuntimeMode", "forward_context",
    "get_forward_context", "AttentionLayer", "check_kv_cache", "get_attention_layer", "is_registered",
    "register_attention_layer", "unique_prefix", "SCRATCH_BLOCK", "AttentionMetadata",
    "allocate_kv_cache", "GEMV_CONFIGS", "GemvConfig", "gemv_config", "argmax_key_tiles", "decode_linear",
    "gemv_linear", "run_linear",
    "act_and_mul", "act_and_mul_plain", "gated_gemv_linear", "run_gated_linear",
    "linear_rope", "run_linear_rope", "FP8_DTYPE", "dequantize", "fp8_linear_plain",
    "quantize_rows", "run_fp8_linear", "scaled_linear",
    "add_rms_norm", "rms_norm", "run_add_rms_norm", "apply_rotary", "qk_norm_rope", "run_qk_norm_rope",
]
