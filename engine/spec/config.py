"""SpeculativeConfig: what `EngineConfig.speculative_config` (and `--speculative-config JSON`) says, in
vLLM's shape: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
"prompt_lookup_max": b}.

Only prompt lookup ("ngram": proposals from the request's own prompt and output) is implemented; a
draft model ({"model": PATH, ...}) is refused with an error that says so, never silently ignored.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

# vLLM's defaults where neither bound is given; where one is, the other equals it
DEFAULT_PROMPT_LOOKUP = 5
MAX_SPECULATIVE_TOKENS = 15  # a verify chunk of 1 + k tokens must stay well inside a query tile


class SpeculativeConfigError(ValueError):
    """The speculative config names something the engine cannot run; the message names the key."""


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    method: str = "ngram"

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
        if value.get("model") is not None:
            raise SpeculativeConfigError(
                "speculative_config['model']: draft-model speculation is not implemented; use "
                "{'method': 'ngram', 'num_speculative_tokens': k} (prompt lookup)")
        method = value.get("method", "ngram")
        if method != "ngram":
            raise SpeculativeConfigError(f"speculative_config['method']={method!r}: only 'ngram' is supported")
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
        return cls(k, low, high, method)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
