"""The engine's tokenizer load (engine/core/tokenizer_load.py): on a GPU engine it runs on a thread
beside the weights' load and the compile, so start-up waits only for what is left of it; a failure
still reaches the caller as the error it was. CPU only."""
from __future__ import annotations

import threading
import time

import pytest

import models
from engine.config import ConfigError
from engine.core.tokenizer_load import PendingTokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from tests.tiny_tokenizer import save_tiny_tokenizer
    path = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(path)
    (path / "config.json").write_text("{}")  # what a model directory (or a tokenizer's hub repo) holds
    return path


def _slow_loader(monkeypatch, seconds: float, seen: list[str]):
    real = models.load_tokenizer

    def load(name, *args, **kwargs):
        seen.append(threading.current_thread().name)
        time.sleep(seconds)
        return real(name, *args, **kwargs)
    monkeypatch.setattr(models, "load_tokenizer", load)


def test_a_background_load_gives_the_same_tokenizer_as_a_load_in_line(tok_dir):
    in_line = PendingTokenizer(str(tok_dir), required=True, background=False).result()
    beside = PendingTokenizer(str(tok_dir), required=True, background=True).result()
    text = "hello world, the tokenizer loads beside the compile"
    assert beside(text)["input_ids"] == in_line(text)["input_ids"]
    assert beside.decode(in_line(text)["input_ids"]) == in_line.decode(in_line(text)["input_ids"])


def test_a_background_load_runs_while_the_caller_works_and_the_wait_is_only_what_is_left(tok_dir, monkeypatch):
    seen: list[str] = []
    _slow_loader(monkeypatch, 0.6, seen)
    start = time.perf_counter()
    pending = PendingTokenizer(str(tok_dir), required=True, background=True)
    assert time.perf_counter() - start < 0.3  # construction does not wait for the load
    time.sleep(0.8)  # start-up's own work: the weights, the compile, the captures
    waited = time.perf_counter()
    assert pending.result() is not None
    assert time.perf_counter() - waited < 0.3
    assert seen == ["infer-graphs-tokenizer"]


def test_an_in_line_load_happens_on_the_callers_thread_at_result(tok_dir, monkeypatch):
    seen: list[str] = []
    _slow_loader(monkeypatch, 0.0, seen)
    pending = PendingTokenizer(str(tok_dir), required=True, background=False)
    assert seen == []
    assert pending.result() is not None
    assert seen == [threading.current_thread().name]


@pytest.mark.parametrize("background", [False, True])
def test_a_required_tokenizer_that_does_not_load_raises_a_config_error_naming_the_field(tmp_path, background):
    pending = PendingTokenizer(str(tmp_path / "missing"), required=True, background=background)
    with pytest.raises(ConfigError, match="EngineConfig.tokenizer="):
        pending.result()


@pytest.mark.parametrize("background", [False, True])
def test_a_model_directory_without_tokenizer_files_has_none(tmp_path, background):
    assert PendingTokenizer(str(tmp_path), required=False, background=background).result() is None


@pytest.mark.gpu
def test_a_gpu_engine_loads_its_tokenizer_on_a_thread_and_detokenizes_with_it(tok_dir, tmp_path_factory,
                                                                               monkeypatch):
    import torch

    from engine import LLM, SamplingParams
    from tests.test_engine_generate import save_arch_models
    seen: list[str] = []
    _slow_loader(monkeypatch, 0.0, seen)
    torch._dynamo.reset()
    path = save_arch_models(tmp_path_factory, "tokenizer_load")["llama"]
    with LLM(str(path), tokenizer=str(tok_dir), device="cuda", dtype="float32", max_model_len=128, max_num_seqs=4,
             num_gpu_blocks=64, show_progress=False) as llm:
        out = llm.generate([[1, 5, 9, 20, 33]], SamplingParams(max_tokens=12, ignore_eos=True))[0]
        assert seen == ["infer-graphs-tokenizer"]
        assert "tokenizer" in [phase["name"] for phase in llm.stats()["startup"]["phases"]]
        assert len(out.token_ids) == 12
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
