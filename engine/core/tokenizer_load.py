"""The engine's tokenizer, loaded while start-up does other work where that is free.

A large vocabulary costs seconds to load: the default model's tokenizer (262,144 tokens, 514,906
merges) spends ~1.2-1.5 s in the tokenizers library's parse and ~1 s importing transformers
(bench/results/cpu-2026-11-28/tokenizer-load/). The parse releases the GIL, so on a GPU engine, whose
host mostly waits for the device while it loads weights, compiles and captures, a thread hides it.
On the CPU device the model's own work uses every core (torch's intra-op threads): there a thread
slowed start-up by more than it saved (7.5-12.3 s against 6.7-7.0 s on a 2-core machine, same
README), so it loads in line, where start-up asks for it.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any

from engine.config import ConfigError

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model",
                   "tekken.json")


def load_tokenizer(name: str, required: bool) -> Any:
    """The tokenizer `name` names; when not required (the model directory's own), None if it has none.
    A required one that does not load is a ConfigError naming EngineConfig.tokenizer."""
    import models
    if not required and os.path.isdir(name) and not any(os.path.exists(os.path.join(name, f))
                                                         for f in TOKENIZER_FILES):
        # a weights-only dir (tests, converted checkpoints): asking transformers costs seconds to fail
        logger.info("no tokenizer files in %s: prompts must be token ids", name)
        return None
    try:
        return models.load_tokenizer(name)
    except Exception as exc:
        if required:
            raise ConfigError(f"EngineConfig.tokenizer={name!r} could not be loaded: {exc}") from exc
        logger.info("no tokenizer for %s (%s): prompts must be token ids", name, exc)
        return None


class PendingTokenizer:
    """A tokenizer on its way: `result()` returns it (None: the model has none) or raises what its
    load raised. With `background`, the load runs on a thread from construction; else in `result()`."""

    def __init__(self, name: str, required: bool, background: bool) -> None:
        self.name, self.required, self.background = name, required, background
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._load, name="infer-graphs-tokenizer", daemon=True)
            self._thread.start()

    def _load(self) -> None:
        try:
            self._value = load_tokenizer(self.name, self.required)
        except BaseException as exc:  # handed to result(), on the thread that started up the engine
            self._error = exc

    def result(self) -> Any:
        if self._thread is None:
            self._load()
        else:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value
