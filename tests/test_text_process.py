"""The front end's process (engine/core/text_process.py): detokenization and stop strings off the step
thread give the outputs the step thread gives inline, stop strings found late included, and a
process that dies is an error on the step thread, never a silent loss.

The tokenizer is a real byte-level BPE (tests/tiny_tokenizer.py); the reference is the inline front
end of the same engine configuration, itself checked against the tokenizer's full decode.
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, ConfigError, EngineConfig, SamplingParams
from engine.core.text_process import InlineText, TextProcess, TextProcessError, spawn_front_end, start_front_end
from tests.tiny_tokenizer import CORPUS, save_tiny_llama_with_tokenizer

SMALL = dict(device="cpu", block_size=4, max_model_len=128, max_num_seqs=6, max_num_batched_tokens=48)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama_with_tokenizer(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _params(tokenizer) -> list[SamplingParams]:
    """Greedy and seeded requests whose stop strings are pieces of what the engine generates (found
    by a first inline run), so several end on a stop string mid-way."""
    return [SamplingParams(max_tokens=40, ignore_eos=True, seed=i, temperature=0.0 if i % 2 else 0.8)
            for i in range(6)]


def _stops_from(texts: list[str]) -> list[list[str]]:
    """For each text, a stop string from its middle (or none for every third)."""
    stops = []
    for i, text in enumerate(texts):
        clean = "".join(c for c in text[len(text) // 3:] if c.isalpha())
        stops.append([clean[:2]] if i % 3 != 2 and len(clean) >= 2 else [])
    return stops


def _run(model_dir, frontend_process: bool, prompts, params, stream: bool):
    with LLM(str(model_dir), frontend_process=frontend_process, **SMALL) as llm:
        assert llm.stats()["frontend_process"] is frontend_process
        if not stream:
            outs = llm.generate(prompts, params)
            return [(o.text, o.token_ids, o.finish_reason) for o in outs], llm.stats()
        ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
        deltas = {i: [] for i in ids}
        finals = {}
        while llm.has_unfinished_requests():
            for out in llm.step():
                deltas[out.request_id].append(out.new_text)
                assert out.request_id not in finals, "an output after the final one"
                if out.finished:
                    finals[out.request_id] = out
        for i in ids:
            assert "".join(deltas[i]) == finals[i].text  # the deltas add up to the text
        return [(finals[i].text, finals[i].token_ids, finals[i].finish_reason) for i in ids], llm.stats()


@pytest.mark.parametrize("stream,late", [(False, False), (False, True), (True, False)],
                         ids=["generate", "generate-replies-at-end", "step"])
def test_the_process_gives_the_inline_outputs_with_stop_strings_found_late(model_dir, stream, late, monkeypatch):
    prompts = CORPUS[:6]
    base = [SamplingParams(max_tokens=40, ignore_eos=True, seed=i, temperature=0.0 if i % 2 else 0.8)
            for i in range(6)]
    plain, _ = _run(model_dir, False, prompts, base, stream=False)
    stops = _stops_from([text for text, _, _ in plain])
    params = [SamplingParams(max_tokens=40, ignore_eos=True, seed=i, temperature=sp.temperature, stop=s or None,
                             include_stop_str_in_output=i == 3)
              for i, (sp, s) in enumerate(zip(base, stops))]
    inline, _ = _run(model_dir, False, prompts, params, stream)
    if late:  # the process's replies are read only when generate() ends: every stop is found many steps late
        monkeypatch.setattr(TextProcess, "poll", lambda self: [])
    remote, stats = _run(model_dir, True, prompts, params, stream)
    assert remote == inline
    if late:  # the tokens sampled after a stop string's token were there, and not reported
        assert stats["frontend_tokens_past_stop"] > 0
    reasons = [reason for _, _, reason in inline]
    assert reasons.count("stop") >= 2 and "length" in reasons  # the stop strings did end requests mid-way
    for (text, ids, reason), p in zip(inline, params):
        if reason == "stop":
            assert len(ids) < 40 and any(s in text for s in p.stop) == p.include_stop_str_in_output
    assert stats["frontend_records"] > 0
    if not stream:  # generate() waits for the process once, at its end; its steps never wait
        assert stats["frontend_flush_waits"] <= 1
    # nothing leaks: every block is free (or cached) again once the late stops were applied
    assert stats["requests_running"] == stats["requests_waiting"] == 0


def test_an_aborted_request_ends_with_its_text_through_the_process(model_dir):
    with LLM(str(model_dir), frontend_process=True, **SMALL) as llm:
        victim = llm.add_request(CORPUS[0], SamplingParams(max_tokens=60, ignore_eos=True))
        keep = llm.add_request(CORPUS[1], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))
        outs = {}
        while llm.has_unfinished_requests():
            for out in llm.step():
                outs.setdefault(out.request_id, []).append(out)
                if out.request_id == victim and len(out.token_ids) >= 5 and not out.finished:
                    assert llm.abort(victim)
        last = outs[victim][-1]
        assert last.finished and last.finish_reason == "abort"
        assert last.text == "".join(o.new_text for o in outs[victim])
        assert outs[keep][-1].finish_reason == "length" and len(outs[keep][-1].token_ids) == 8
        assert llm.tokenizer.decode(outs[keep][-1].token_ids, skip_special_tokens=True) == outs[keep][-1].text


def test_a_process_that_dies_is_an_error_on_the_step_thread_and_close_still_works(model_dir):
    llm = LLM(str(model_dir), frontend_process=True, **SMALL)
    front = llm._front
    assert isinstance(front, TextProcess)
    front._proc.kill()
    front._proc.wait()
    with pytest.raises(TextProcessError, match="front end's process"):
        llm.generate(CORPUS[0], SamplingParams(max_tokens=4, ignore_eos=True))
    llm.close()
    assert front._proc.poll() is not None


def test_close_ends_the_process(model_dir):
    llm = LLM(str(model_dir), frontend_process=True, **SMALL)
    proc = llm._front._proc
    assert llm.generate(CORPUS[0], SamplingParams(max_tokens=3, ignore_eos=True))[0].finished
    llm.close()
    assert proc.poll() == 0  # it read the engine's None and exited on its own


def test_the_choice_of_front_end(model_dir):
    with LLM(str(model_dir), **SMALL) as llm:  # the default: inline
        assert isinstance(llm._front, InlineText) and llm.stats()["frontend_process"] is False
        tokenizer = llm.tokenizer
    assert isinstance(start_front_end(tokenizer, None), InlineText)  # not asked for
    spawned = spawn_front_end(True)
    assert isinstance(start_front_end(None, spawned), InlineText)  # no tokenizer: no text to make
    assert spawned._proc.wait(timeout=60) == 0  # ... and the process it did not need has ended

    class Cleaning:  # transformers post-processes decode(): the Rust batch would differ
        _tokenizer = tokenizer._tokenizer
        clean_up_tokenization_spaces = True

        def __len__(self):
            return len(tokenizer)

        def decode(self, ids, **kwargs):
            return tokenizer.decode(ids, **kwargs)

    assert not TextProcess.can_run(Cleaning())
    spawned = spawn_front_end(True)
    assert isinstance(start_front_end(Cleaning(), spawned), InlineText)
    assert spawned._proc.wait(timeout=60) == 0
    assert TextProcess.can_run(tokenizer)


def test_a_thread_server_copies_the_tokenizer_only_where_the_step_thread_decodes_with_it(model_dir, monkeypatch):
    """The server's tokenizer thread must not share a tokenizer with a step thread that decodes (a fast
    tokenizer is not thread-safe); with the front end in its process nothing else in this process uses
    it, and the copy (seconds for a large vocabulary) is skipped."""
    import engine.entrypoints.server as server
    seen = {}

    def serve(*args, copy_tokenizer: bool, **kwargs) -> int:  # the HTTP side, not started here
        seen["copy"] = copy_tokenizer
        return 0
    monkeypatch.setattr(server, "_serve", serve)
    monkeypatch.setattr(server, "_listen", lambda host, port: None)
    monkeypatch.setattr("engine.entrypoints.server.engine_loop.EngineLoop.__init__", lambda self, llm: None)
    for frontend_process in (False, True):
        seen.clear()
        with LLM(str(model_dir), frontend_process=frontend_process, **SMALL) as llm:
            assert llm.decodes_on_step_thread is (not frontend_process)
            server.serve_llm(llm, "tiny")
        assert seen["copy"] is (not frontend_process)


def test_frontend_process_must_be_a_bool_and_defaults_to_on_with_cuda_only():
    with pytest.raises(ConfigError, match="frontend_process"):
        EngineConfig(frontend_process="yes")
    assert EngineConfig(device="cpu").resolve().frontend_process is False
    assert EngineConfig(device="cpu", frontend_process=True).resolve().frontend_process is True
    if torch.cuda.is_available():
        assert EngineConfig(device="cuda").resolve().frontend_process is True
        assert EngineConfig(device="cuda", frontend_process=False).resolve().frontend_process is False


def test_the_command_line_turns_the_process_on_and_off():
    from engine.entrypoints.cli import build_parser
    fields = lambda argv: {k: v for k, v in vars(build_parser().parse_args(argv)).items()  # noqa: E731
                           if k == "frontend_process"}
    assert fields(["generate", "--prompt", "x"]) == {}  # unset: EngineConfig's default (None)
    assert fields(["generate", "--prompt", "x", "--frontend-process"]) == {"frontend_process": True}
    assert fields(["serve", "--no-frontend-process"]) == {"frontend_process": False}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_engine_detokenizes_in_its_process_which_holds_no_gpu_memory(model_dir):
    """On a GPU with async scheduling the process gives the inline engine's outputs (stop strings
    found late included), and it never creates a CUDA context."""
    import subprocess
    gpu = dict(device="cuda", dtype="float32", block_size=16, max_model_len=128, max_num_seqs=6, num_gpu_blocks=64,
               show_progress=False)
    prompts = CORPUS[:6]
    base = [SamplingParams(max_tokens=40, ignore_eos=True, seed=i, temperature=0.0 if i % 2 else 0.8) for i in range(6)]
    results = {}
    for front in (True, False):
        with LLM(str(model_dir), frontend_process=front, **gpu) as llm:
            if front:
                assert isinstance(llm._front, TextProcess) and llm.stats()["frontend_process"] is True
                child = llm._front._proc.pid
            plain = llm.generate(prompts, base)
            stops = _stops_from([o.text for o in plain])
            params = [SamplingParams(max_tokens=40, ignore_eos=True, seed=i, temperature=p.temperature, stop=s or None)
                      for i, (p, s) in enumerate(zip(base, stops))]
            results[front] = [(o.text, o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)]
            if front:
                apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                                      capture_output=True, text=True).stdout.split()
                assert str(child) not in apps, "the front end's process created a CUDA context"
    assert results[True] == results[False]
    assert [r for _, _, r in results[True]].count("stop") >= 2


def test_speculation_and_prefix_hits_with_the_process_give_the_inline_outputs(model_dir):
    """Where features meet: prompt-lookup speculation (verify steps add several tokens a step, so a
    stop string can complete mid-chunk) and prefix-cache hits (the prompts share a prefix), greedy,
    with stop strings taken from the plain run's text; the process's outputs equal the inline ones."""
    shared = CORPUS[0] + " " + CORPUS[1]
    prompts = [shared + " " + c for c in CORPUS[2:]] + [shared, shared + CORPUS[2][:8]]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    config = dict(SMALL, max_model_len=192, enable_prefix_caching=True, speculative_config=spec)
    plain = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0) for _ in prompts]
    with LLM(str(model_dir), **config) as llm:
        stops = _stops_from([o.text for o in llm.generate(prompts, plain)])
    params = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0, stop=s or None) for s in stops]
    results = {}
    for front in (False, True):
        with LLM(str(model_dir), frontend_process=front, **config) as llm:
            results[front] = [(o.text, o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)]
            stats = llm.stats()
            assert stats["prefix_cache"]["hit_tokens"] > 0 and stats["spec_decode"]["proposed_tokens"] > 0
    assert results[True] == results[False]
    assert [r for _, _, r in results[True]].count("stop") >= 2


def test_a_process_that_hangs_is_an_error_not_a_hang(model_dir, monkeypatch):
    import os
    import signal

    from engine.core import text_process
    llm = LLM(str(model_dir), frontend_process=True, **SMALL)
    proc = llm._front._proc
    assert llm.generate(CORPUS[0], SamplingParams(max_tokens=2, ignore_eos=True))[0].finished  # it answers...
    monkeypatch.setattr(text_process, "REPLY_TIMEOUT_S", 2.0)
    os.kill(proc.pid, signal.SIGSTOP)  # ... then stops answering
    try:
        with pytest.raises(TextProcessError, match="did not answer in 2 s"):
            llm.generate(CORPUS[1], SamplingParams(max_tokens=3, ignore_eos=True))
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        llm.close()
