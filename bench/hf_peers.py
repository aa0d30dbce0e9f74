"""The transformers peers: the same architecture from the same config, random weights, on the same GPU.

- eager decode: `generate()` with its default DynamicCache, greedy, per-step time from two generation
  lengths (what its users get per token);
- `generate(cache_implementation="static")`, which compiles its decode step with
  torch.compile(mode="reduce-overhead") (transformers' documented fast path), timed the same way;
- eager prefill: one forward over the prompt, logits of the last token only. This is the lower bound
  of what `generate()` spends before its first token (generate adds its set-up and the sampling of
  that token: for a 28-layer tiny Llama on the CPU, `generate(max_new_tokens=1)` of 512 tokens took
  78 ms where the forward took 68 ms), so the row never flatters us.
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate_step_ms(model, batch_size: int, context_len: int, short: int = 8, long: int = 40,
                     repeats: int = 3, **generate_kwargs) -> float:
    """Per-step decode ms of `model.generate()` with greedy decoding at about `context_len` cached tokens,
    as transformers' users run it (its own cache, masks, logits processing and stopping checks).

    Per step = (time of `long` new tokens - time of `short`) / (long - short), min_new_tokens =
    max_new_tokens so both lengths are exact: the prompt's prefill and the set-up cancel. One call of
    each length first, not timed (warm-up; with a compiling cache implementation, the compile)."""
    import statistics
    import time
    if not 0 < short < long:
        raise ValueError(f"need 0 < short < long new tokens, got short={short}, long={long}")
    p = next(model.parameters())
    ids = torch.randint(3, model.config.vocab_size, (batch_size, context_len), device=p.device)
    mask = torch.ones_like(ids)

    def generate(n: int) -> float:
        _sync(p.device)
        start = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=0, **generate_kwargs)
        _sync(p.device)
        return time.perf_counter() - start

    generate(short)
    generate(long)
    t_short = statistics.median(generate(short) for _ in range(repeats))
    t_long = statistics.median(generate(long) for _ in range(repeats))
    return (t_long - t_short) / (long - short) * 1e3


def decode_eager_generate_ms(model, batch_size: int, context_len: int, **kwargs) -> float:
    """transformers eager decode as its users get it: `generate()` with its default DynamicCache.

    (Timing one forward over a pre-filled DynamicCache instead gave 85-104 ms per step for
    llama-3.2-3b at batch 1 on an H100, where generate() itself takes 33.5 ms per step.)"""
    return generate_step_ms(model, batch_size, context_len, **kwargs)


def decode_static_generate_ms(model, batch_size: int, context_len: int, **kwargs) -> float:
    """transformers' fast path: `generate(cache_implementation="static")`, which compiles its decoding
    step with torch.compile(mode="reduce-overhead") itself (the first, untimed call compiles)."""
    return generate_step_ms(model, batch_size, context_len, cache_implementation="static", **kwargs)


def prefill_eager_step(model, num_tokens: int) -> Callable[[], object]:
    p = next(model.parameters())
    ids = torch.randint(0, model.config.vocab_size, (1, num_tokens), device=p.device)

    def step():
        return model(input_ids=ids, use_cache=False, logits_to_keep=1).logits

    return step
