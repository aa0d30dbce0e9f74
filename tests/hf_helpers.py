"""Reference transformers models for parity tests: every weight random, eager attention, float32."""
from __future__ import annotations

import torch
import transformers


def random_hf_model(config: transformers.PretrainedConfig, seed: int,
                    embed_std: float | None = 0.03) -> transformers.PreTrainedModel:
    """transformers inits norms to a constant (Gemma: w = 0, the identity under (1 + w)), which would
    hide a missing "1 +" or a swapped norm: random norms expose both. Embeddings (embed_std) are kept
    much smaller than the other weights: with tied embeddings (and Gemma's sqrt(hidden) scale) a large
    embedding makes every step predict its own input token, so greedy generation would repeat one
    token and compare almost nothing. None keeps transformers' init."""
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.5)
            elif "embed_tokens" in name and embed_std is not None:
                param.normal_(0.0, embed_std)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.03)
    return hf
