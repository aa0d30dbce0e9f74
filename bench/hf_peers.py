"""The transformers peers: the same architecture from the same config, random weights, on the same GPU.

- eager decode with its DynamicCache filled to the context (what `generate` does by default);
- `generate(cache_implementation="static")`, which compiles its decode step with
  torch.compile(mode="reduce-overhead") (transformers' documented fast path);
- eager prefill (one forward over the prompt, logits of the last token only).
"""
from __future__ import annotations

from typing import Callable

import torch


def hf_config(config: dict):
    import transformers
    fields = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "torch_dtype")}
    return transformers.AutoConfig.for_model(config["model_type"], **fields)


def hf_model(config: dict, dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
             attn_implementation: str = "sdpa"):
    """A random-init transformers causal LM for `config` (a config.json dict)."""
    import transformers
    cfg = hf_config(config)
    cfg._attn_implementation = attn_implementation
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # transformers' init puts norms at constants (Gemma: zeros); random values cost the same
            # and never feed a kernel all-zero data
            if "norm" in name:
                p.normal_(0.0, 0.1)
    return model


def _kv_shape(model, batch_size: int, context_len: int) -> tuple[int, int, int, int]:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return batch_size, cfg.num_key_value_heads, context_len, head_dim


def filled_dynamic_cache(model, batch_size: int, context_len: int):
    """A DynamicCache holding `context_len` random tokens per sequence in every layer."""
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    shape = _kv_shape(model, batch_size, context_len)
    p = next(model.parameters())
    for layer in range(model.config.num_hidden_layers):
        k = torch.randn(shape, dtype=p.dtype, device=p.device)
        cache.update(k, torch.randn_like(k), layer)
    return cache


def decode_eager_step(model, batch_size: int, context_len: int) -> Callable[[], object]:
    """One decode step of transformers eager at `context_len` cached tokens. The cache grows by one
    token per call (as in generation); over a timing run that is well under 1% of the context."""
    cache = filled_dynamic_cache(model, batch_size, context_len)
    p = next(model.parameters())
    ids = torch.randint(0, model.config.vocab_size, (batch_size, 1), device=p.device)

    def step():
        n = cache.get_seq_length()
        pos = torch.full((batch_size, 1), n, device=p.device, dtype=torch.long)
        return model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True).logits

    return step


def decode_static_generate_ms(model, batch_size: int, context_len: int, short: int = 8, long: int = 40,
                              repeats: int = 3) -> float:
    """Per-step decode ms of transformers' own fast path: `generate(cache_implementation="static")`,
    which compiles the decoding step with torch.compile(mode="reduce-overhead") itself.

    Per step = (time of `long` new tokens - time of `short`) / (long - short): the prefill and the
    set-up cancel. The first call compiles (not timed)."""
    import statistics
    import time
    p = next(model.parameters())
    ids = torch.randint(3, model.config.vocab_size, (batch_size, context_len), device=p.device)
    mask = torch.ones_like(ids)

    def generate(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       cache_implementation="static", pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    generate(short)
    generate(long)  # compiles and records the graphs
    t_short = statistics.median(generate(short) for _ in range(repeats))
    t_long = statistics.median(generate(long) for _ in range(repeats))
    return (t_long - t_short) / (long - short) * 1e3


def prefill_eager_step(model, num_tokens: int) -> Callable[[], object]:
    p = next(model.parameters())
    ids = torch.randint(0, model.config.vocab_size, (1, num_tokens), device=p.device)

    def step():
        return model(input_ids=ids, use_cache=False, logits_to_keep=1).logits

    return step
