"""piecewise_context: run a forward in a chosen runtime mode without an engine."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from custom_ops.forward_context import ForwardContext, RuntimeMode, forward_context


@contextlib.contextmanager
def piecewise_context(num_tokens: int, attn_metadata: Any = None, mode: RuntimeMode = RuntimeMode.PIECEWISE,
                      kv_caches: Any = None) -> Iterator[ForwardContext]:
    """A forward context for one forward of exactly `num_tokens` tokens (already padded: use
    `pad_to_capture_size`). With no metadata the attention op treats the tokens as one causal
    sequence, so padding appended at the end leaves the real tokens' outputs unchanged. With metadata,
`kv_caches` maps each attention layer's name to its paged cache."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    with forward_context(attn_metadata, mode, num_tokens, kv_caches) as context:
        yield context
