"""Llama 3.x, Qwen3 and Gemma 3 (text) on flat tokens, every attention call through
`torch.ops.infer.attention`; config and weight loading from HF-format dirs, hub ids and GGUF files."""
from __future__ import annotations

from models.base import CausalLM, matmul_weights, set_decode_gemv
from models.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeParams
from models.errors import (
    MissingWeightError, ModelLoadError, ModelPathError, UnexpectedWeightError, UnknownArchitectureError,
    UnsupportedConfigError, WeightShapeError,
)
from models.gemma3 import Gemma3ForCausalLM
from models.llama import LlamaForCausalLM
from models.loader import MODEL_CLASSES, from_config, from_pretrained, load_weights
from models.quantization import QUANTIZATIONS, quantize_fp8
from models.paths import DEFAULT_MODEL, cache_root, load_tokenizer, resolve_model_path
from models.qwen3 import Qwen3ForCausalLM

__all__ = [
    "CausalLM", "SUPPORTED_ARCHITECTURES", "ModelConfig", "RopeParams", "MissingWeightError",
    "ModelLoadError", "ModelPathError", "UnexpectedWeightError", "UnknownArchitectureError",
    "UnsupportedConfigError", "WeightShapeError", "Gemma3ForCausalLM", "LlamaForCausalLM",
    "MODEL_CLASSES", "from_config", "from_pretrained", "load_weights", "DEFAULT_MODEL",
    "load_tokenizer", "resolve_model_path", "cache_root", "Qwen3ForCausalLM", "set_decode_gemv", "matmul_weights",
    "QUANTIZATIONS", "quantize_fp8",
]
