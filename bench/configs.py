"""The seeds' benchmark models, as their real published configs (weights are random in benchmarks).

Random weights time exactly like real ones: every kernel and byte is the same. The configs are
written out here because the benchmark machine has no network to fetch them.
"""
from __future__ import annotations

import json
import os

LLAMA_3_2_3B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
    "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": True, "hidden_act": "silu",
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
}

QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
    "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "tie_word_embeddings": True, "hidden_act": "silu",
    "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}

GEMMA_3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
    "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
    "vocab_size": 262144, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None,
    "sliding_window": 512, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
    "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "tie_word_embeddings": True,
    "bos_token_id": 2, "eos_token_id": [1, 106], "torch_dtype": "bfloat16",
}

# A tiny Llama for CPU runs (tests, notebooks in CI): the code paths of the real ones, seconds to run.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 256, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": True, "hidden_act": "silu",
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}

# A tiny Gemma 3: sliding-window layers (their own KV group, engine.kv.groups) next to a full one.
TINY_GEMMA3 = {
    **{k: v for k, v in GEMMA_3_1B.items() if k not in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                        "num_attention_heads", "num_key_value_heads", "head_dim",
                                                        "vocab_size", "sliding_window", "sliding_window_pattern",
                                                        "query_pre_attn_scalar", "max_position_embeddings",
                                                        "eos_token_id", "torch_dtype")},
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "sliding_window": 8,
    "sliding_window_pattern": 3, "query_pre_attn_scalar": 16, "max_position_embeddings": 2048,
    "eos_token_id": 2, "torch_dtype": "float32",
}

BENCH_MODELS = {"llama-3.2-3b": LLAMA_3_2_3B, "qwen3-4b": QWEN3_4B, "gemma-3-1b": GEMMA_3_1B,
                "tiny-llama": TINY_LLAMA, "tiny-gemma3": TINY_GEMMA3}


def load_config(name_or_dir: str) -> dict:
    """A benchmark model's config dict, by seed name or from a model directory's config.json."""
    if name_or_dir in BENCH_MODELS:
        return dict(BENCH_MODELS[name_or_dir])
    path = os.path.join(name_or_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(
            f"--model {name_or_dir!r} is neither one of {sorted(BENCH_MODELS)} nor a directory with config.json")
    with open(path) as f:
        return json.load(f)
