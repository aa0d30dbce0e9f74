"""serve's engine process and the tokenizer: where the server knows the tokenizer's source (a model
directory, or --tokenizer) it loads its own copy while the child starts, instead of receiving the
child's pickled one; the two are checked against each other, and a mismatch stops the child and raises."""
from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest

from engine.entrypoints.server import build_llm, tokenizer_source
from engine.entrypoints.server.engine_process import EngineProcess, tokenizer_fingerprint
from tests.tiny_tokenizer import save_tiny_llama_with_tokenizer, save_tiny_tokenizer

FIELDS = {"device": "cpu", "max_model_len": 64, "max_num_seqs": 2, "show_progress": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_llama_with_tokenizer(tmp_path_factory.mktemp("tiny-process-tokenizer"))


def test_the_source_is_the_tokenizer_option_else_a_model_directory_else_none(tmp_path):
    assert tokenizer_source(str(tmp_path), {"tokenizer": "/some/tok"}) == ("/some/tok", True)
    assert tokenizer_source(str(tmp_path), {}) == (str(tmp_path), False)
    assert tokenizer_source("default", {}) is None  # the engine converts it first
    assert tokenizer_source(str(tmp_path / "model.gguf"), {}) is None


def test_the_server_loads_its_own_tokenizer_and_encodes_as_the_engine_does(model_dir):
    build = functools.partial(build_llm, str(model_dir), FIELDS)
    engine = EngineProcess(build, tokenizer_source=tokenizer_source(str(model_dir), FIELDS))
    engine.start()
    try:
        here = EngineProcess(build)  # the child's own tokenizer, pickled over the pipe
        here.start()
        try:
            ours, theirs = engine.llm.tokenizer, here.llm.tokenizer
            assert ours is not None and tokenizer_fingerprint(ours) == tokenizer_fingerprint(theirs)
            text = "the capital of France is"
            assert engine.llm.encode(text) == here.llm.encode(text) and len(engine.llm.encode(text)) > 1
        finally:
            here.stop()
    finally:
        engine.stop()
    assert engine._proc.exitcode == 0


def test_a_server_tokenizer_unlike_the_engines_stops_the_child_and_says_both(model_dir, tmp_path):
    other = tmp_path / "other-tokenizer"
    save_tiny_tokenizer(other, vocab_size=300)  # the same class, a smaller vocabulary than the model's
    shutil.copy(model_dir / "config.json", other)  # the loader reads a model directory's tokenizer
    build = functools.partial(build_llm, str(model_dir), FIELDS)
    with pytest.raises(RuntimeError, match="other-tokenizer.*engine process holds"):
        EngineProcess(build, tokenizer_source=(str(other), True))
