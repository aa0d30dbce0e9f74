"""Where the default model's tokenizer load goes: run from the repository root, after the default
model has been converted once (`python -m engine generate --model default --prompt hi`).

    PYTHONPATH=. python bench/results/cpu-2026-11-28/tokenizer-load/tokenizer_probe.py

Prints wall and CPU seconds (the minimum of REPEATS) for: importing what the load imports, the whole
load (models.paths.converted_tokenizer), tokenizers' own parse of tokenizer.json, the same parse
without its merges / with them in the legacy "a b" spelling, and transformers' AutoTokenizer.
"""
from __future__ import annotations

import importlib
import json
import time

REPEATS = 3


def timed(fn, repeats: int = REPEATS) -> str:
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return f"wall {min(walls):5.2f} s   cpu {min(cpus):5.2f} s"


def main() -> None:
    import models
    from models.paths import cache_root, converted_tokenizer

    path = cache_root() / "gemma-3-270m"
    file = path / "tokenizer.json"
    start = time.perf_counter()
    importlib.import_module("transformers.tokenization_utils_tokenizers")  # what converted_tokenizer imports
    print(f"import transformers' PreTrainedTokenizerFast (torch and models imported): "
          f"{time.perf_counter() - start:5.2f} s")
    import tokenizers
    from transformers import AutoTokenizer

    assert models.paths.converted_tokenizer(path) is not None, f"no converted default model at {path}"
    print(f"converted_tokenizer (the engine's load)   {timed(lambda: converted_tokenizer(path))}")
    print(f"tokenizers.Tokenizer.from_file            {timed(lambda: tokenizers.Tokenizer.from_file(str(file)))}")
    spec = json.loads(file.read_text())
    model = spec["model"]
    print(f"  {len(model['vocab'])} tokens, {len(model['merges'])} merges, {len(spec['added_tokens'])} added tokens")
    variants = {
        "the same, from a string": spec,
        "without merges": {**spec, "model": {**model, "merges": []}},
        "merges as legacy 'a b' strings": {**spec, "model": {**model, "merges": [" ".join(m) for m in model["merges"]]}},
        "without merges and added tokens": {**spec, "added_tokens": [], "model": {**model, "merges": []}},
    }
    for name, variant in variants.items():
        text = json.dumps(variant, ensure_ascii=False)
        print(f"  {name:38s}  {timed(lambda: tokenizers.Tokenizer.from_str(text))}")
    print(f"AutoTokenizer.from_pretrained             {timed(lambda: AutoTokenizer.from_pretrained(str(path)), 2)}")


if __name__ == "__main__":
    main()
