"""SpeculativeConfig: what `EngineConfig.speculative_config` (and `--speculative-config JSON`) says, in
vLLM's shape:
- {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}:
  prompt lookup, proposals from the request's own prompt and output (engine.spec.ngram);
- {"model": PATH, "num_speculative_tokens": k} (method "draft_model", implied by "model"): a smaller
  model with the target's vocabulary proposes, run by the engine's own machinery with its own KV cache
  and decode graphs (engine.spec.draft). PATH is anything models.from_pretrained loads; in Python an
  already built models.CausalLM may stand in for it (not under tensor parallelism, where only a path
  reaches the other processes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

# vLLM's defaults where neither bound is given; where one is, the other equals it
DEFAULT_PROMPT_LOOKUP = 5
MAX_SPECULATIVE_TOKENS = 15  # a verify chunk of 1 + k tokens must stay well inside a query tile
METHODS = ("ngram", "draft_model")


class SpeculativeConfigError(ValueError):
    """The speculative config names something the engine cannot run; the message names the key."""


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    method: str = "ngram"
    model: Any = None  # the draft model (method "draft_model"): a path, or a built models.CausalLM

    @classmethod
    def parse(cls, value: Mapping[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise SpeculativeConfigError(f"speculative_config must be a dict (or JSON object), got {type(value).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise SpeculativeConfigError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        model = value.get("model")
        method = value.get("method", "ngram" if model is None else "draft_model")
        if method not in METHODS:
            raise SpeculativeConfigError(f"speculative_config['method']={method!r}: expected one of {', '.join(METHODS)}")
        if method == "draft_model":
            if model is None or (isinstance(model, str) and not model):
                raise SpeculativeConfigError("speculative_config['model']: method 'draft_model' needs the draft "
                                             "model's path")
            if not isinstance(model, (str, torch.nn.Module)):
                raise SpeculativeConfigError(f"speculative_config['model']: expected a path or a built model, got "
                                             f"{type(model).__name__}")
            lookup = sorted({"prompt_lookup_min", "prompt_lookup_max"} & set(value))
            if lookup:
                raise SpeculativeConfigError(f"speculative_config: {lookup} apply to method 'ngram', not to a "
                                             "draft model")
        elif model is not None:
            raise SpeculativeConfigError(f"speculative_config: 'model' is given but method is {method!r}; a draft "
                                         "model's method is 'draft_model'")
        k = value.get("num_speculative_tokens")
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise SpeculativeConfigError(f"speculative_config['num_speculative_tokens']={k!r}: expected an int in "
                                         f"1..{MAX_SPECULATIVE_TOKENS}")
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        low = high if low is None else low
        high = low if high is None else high
        for key, n in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if not _is_int(n) or n < 1:
                raise SpeculativeConfigError(f"speculative_config[{key!r}]={n!r}: expected an int >= 1")
        if low > high:
            raise SpeculativeConfigError(f"speculative_config: prompt_lookup_min ({low}) > prompt_lookup_max ({high})")
        return cls(k, low, high, method, model)

    @property
    def draft_model(self) -> bool:
        return self.method == "draft_model"

    def describe(self) -> dict[str, Any]:
        """The config as a dict in vLLM's shape (a built draft model by its class name)."""
        if self.draft_model:
            model = self.model if isinstance(self.model, str) else f"<{type(self.model).__name__} instance>"
            return {"method": self.method, "model": model, "num_speculative_tokens": self.num_speculative_tokens}
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                "prompt_lookup_min": self.prompt_lookup_min, "prompt_lookup_max": self.prompt_lookup_max}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
