"""The front end on its own thread (engine/core/frontend.py) gives the outputs of the synchronous loop.

With async scheduling and a tokenizer, detokenization and stop strings run on the front end's thread,
so a stop string ends its request a step or more after the token that completed it; the tokens
sampled meanwhile must never be reported. The front end is slowed down here so that the lag is
certain, and every output (tokens, text, finish reason) must equal the depth-0 loop's, where the
front end runs inline and a match ends the request at once.
"""
from __future__ import annotations

import threading
import time

import pytest

import engine.core.frontend as frontend
from engine import LLM, SamplingParams
from tests.tiny_tokenizer import save_tiny_llama_with_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
SMALL = dict(device="cpu", block_size=4, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32)
PROMPTS = ["The capital of France is", "Hello world! How", "Café crème, naïve", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama_with_tokenizer(tmp_path_factory.mktemp("tiny_frontend"))


@pytest.fixture
def slow_front_end(monkeypatch):
    """The thread's update waits 20 ms a record: the step thread runs steps ahead of it meanwhile."""
    original = frontend.update_all

    def slow(updates):
        if threading.current_thread().name == "engine-frontend":
            time.sleep(0.02)
        return original(updates)

    monkeypatch.setattr(frontend, "update_all", slow)


def _stop_params(llm_sync):
    """Stop strings cut from the middle of each prompt's greedy text, so each request stops early."""
    free = llm_sync.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    params = []
    for out in free:
        text = out.text
        cut = text[len(text) // 3:len(text) // 3 + 3] if len(text) > 8 else "\u2603never"
        params.append(SamplingParams(max_tokens=24, ignore_eos=True, stop=(cut,)))
    return params


def _view(outputs):
    return [(o.token_ids, o.text, o.finish_reason) for o in outputs]


def test_stop_strings_found_late_by_the_thread_give_the_synchronous_outputs(model_dir, slow_front_end):
    sync = LLM(str(model_dir), **SMALL, async_scheduling=False)
    assert not sync._front.threaded
    params = _stop_params(sync)
    before = sync.stats()["generated_tokens"]
    expected = sync.generate(PROMPTS, params)
    assert sum(o.finish_reason == "stop" for o in expected) >= 2  # the stops really end requests early

    llm = LLM(str(model_dir), **SMALL)
    assert llm._front.threaded
    got = llm.generate(PROMPTS, params)
    assert _view(got) == _view(expected)
    # the engine sampled past some stops before the thread's match reached it: those tokens are hidden
    stats = llm.stats()
    assert stats["generated_tokens"] > sum(len(o.token_ids) for o in got)
    assert sync.stats()["generated_tokens"] - before == sum(len(o.token_ids) for o in expected)
    assert stats["requests_running"] == stats["requests_waiting"] == 0 and not llm._requests
    assert stats["kv_blocks_free"] == llm.runtime.block_pool.num_usable_blocks  # every block back (or cached)
    llm.runtime.block_pool.check_consistency()
    llm.close()
    sync.close()


def test_streamed_requests_with_a_slow_front_end_report_each_token_once_and_end_with_the_stop(model_dir,
                                                                                              slow_front_end):
    sync = LLM(str(model_dir), **SMALL, async_scheduling=False)
    params = _stop_params(sync)
    expected = {o.request_id: o for o in (sync.generate(PROMPTS, params))}
    llm = LLM(str(model_dir), **SMALL)
    ids = [llm.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    seen = {rid: ([], "") for rid in ids}
    final = {}
    for _ in range(200):
        if not llm.has_unfinished_requests():
            break
        for out in llm.step():
            tokens, text = seen[out.request_id]
            assert out.request_id not in final, "an output after the final one"
            seen[out.request_id] = (tokens + out.new_token_ids, text + out.new_text)
            if out.finished:
                final[out.request_id] = out
    else:
        pytest.fail("the stream did not finish in 200 steps")
    by_order = [expected[k] for k in sorted(expected, key=lambda k: int(k.split(".")[1]))]
    for rid, want in zip(ids, by_order):
        assert seen[rid] == (want.token_ids, want.text)
        assert final[rid].finish_reason == want.finish_reason
    llm.close()
    sync.close()


def test_a_failing_tokenizer_on_the_thread_is_raised_on_the_step_thread(model_dir):
    llm = LLM(str(model_dir), **SMALL)

    def broken(sequences, **kwargs):
        raise ValueError("tokenizer exploded")

    llm._decode._batch = broken
    llm._decode._checked = True
    with pytest.raises(RuntimeError, match="front end") as info:
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4))
    assert "tokenizer exploded" in str(info.value.__cause__)
    llm.close()

