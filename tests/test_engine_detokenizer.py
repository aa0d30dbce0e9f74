"""Incremental detokenization, stop strings, delta outputs and abort: the engine side of streaming.

The tokenizer is a real byte-level BPE (tests/tiny_tokenizer.py) that splits accented, CJK and emoji
characters across tokens; the reference for every text is the tokenizer's own full decode.
"""
from __future__ import annotations

import time

import pytest
import torch

from engine import LLM, InvalidRequestError, SamplingParams
from engine.core.detokenizer import IncrementalDetokenizer, OutputTracker
from engine.request import FinishReason, Request, RequestStatus
from tests.tiny_tokenizer import CORPUS, save_tiny_llama_with_tokenizer

SMALL = dict(device="cpu", block_size=4, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32)
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama_with_tokenizer(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def llm(model_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(str(model_dir), **SMALL)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.tokenizer


class CountingTokenizer:
    """Counts the token ids each decode call is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, []

    def decode(self, ids, **kwargs):
        self.decoded.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


@pytest.mark.parametrize("text", CORPUS[2:5] + ["a🙂b👍🏽c日本語€"])
def test_incremental_text_equals_the_full_decode_and_never_shows_half_a_character(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # the text really splits characters
    detok = IncrementalDetokenizer(tokenizer, [2])
    deltas = [detok.add([i], final=n == len(ids) - 1) for n, i in enumerate(ids)]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text


def _feed(tokenizer, text, params, finish: FinishReason | None = None):
    """Stream `text`'s tokens one at a time through an OutputTracker; (emitted deltas, stop matched)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    request = Request("r", [2], params)
    tracker = OutputTracker(request, tokenizer)
    deltas, matched = [], False
    for n, token in enumerate(ids):
        request.token_ids.append(token)
        if n == len(ids) - 1 and finish is not None:
            request.status, request.finish_reason = RequestStatus.FINISHED, finish
        matched = tracker.update(request)
        deltas.append(tracker.output(request).new_text)
        if matched:
            break
    return deltas, matched


def test_a_stop_string_across_tokens_ends_the_text_before_it_and_only_a_possible_start_is_held_back(tokenizer):
    text = "Hello world! How are you today?"
    deltas, matched = _feed(tokenizer, text, SamplingParams(stop=("are you",)))
    assert matched and "".join(deltas) == "Hello world! How "
    # until the match, every step emits all but at most len("are you") - 1 characters of the decoded text
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    emitted = ""
    for n, delta in enumerate(deltas[:-1]):
        emitted += delta
        decoded = tokenizer.decode(ids[:n + 1])
        assert decoded.startswith(emitted) and len(decoded) - len(emitted) <= len("are you") - 1
    deltas, matched = _feed(tokenizer, text, SamplingParams(stop=("are you",), include_stop_str_in_output=True))
    assert matched and "".join(deltas) == "Hello world! How are you"
    # a partial match that never completes is emitted when the request finishes
    deltas, matched = _feed(tokenizer, "Hello world! How ar", SamplingParams(stop=("are you",)),
                            finish=FinishReason.LENGTH)
    assert not matched and "".join(deltas) == "Hello world! How ar"


def test_text_that_cannot_start_a_stop_string_is_not_held_back(tokenizer):
    ids = tokenizer("Hello world", add_special_tokens=False)["input_ids"]
    request = Request("r", [2], SamplingParams(stop=("xyz",)))
    tracker = OutputTracker(request, tokenizer)
    for token in ids:
        request.token_ids.append(token)
        tracker.update(request)
    assert tracker.pending == "" and "".join(tracker.pieces) == "Hello world"


def test_per_step_work_does_not_grow_with_the_output_length(tokenizer):
    """The cost of one step at 16 and at 4,096 generated tokens: counted (ids decoded, never more
    than a few per step) and timed (min over repeats, 2x bound)."""
    counting = CountingTokenizer(tokenizer)
    ids = tokenizer(" ".join(CORPUS), add_special_tokens=False)["input_ids"]
    request = Request("r", [2, 5, 6], SamplingParams(max_tokens=10_000, stop=("never seen",)))
    tracker = OutputTracker(request, counting)

    def one_step(token):
        request.token_ids.append(token)
        request.token_times.append(time.perf_counter())
        tracker.update(request)
        return tracker.output(request)

    def block_seconds(start):
        begin = time.perf_counter()
        for i in range(16):
            one_step(ids[(start + i) % len(ids)])
        return time.perf_counter() - begin

    early = min(block_seconds(16 * k) for k in range(4))  # outputs 1..64
    while request.num_tokens - request.num_prompt_tokens < 4096:
        one_step(ids[request.num_tokens % len(ids)])
    late = min(block_seconds(16 * k) for k in range(4))
    assert max(counting.decoded) <= 2 * 8 + 5  # the window: context + held tokens, never the whole output
    assert late < 2 * early + 1e-3, (early, late)
    out = one_step(ids[0])
    assert len(out.new_token_ids) == 1 and len(out.token_ids) == request.num_tokens - 3


def test_delta_outputs_add_up_to_generate_and_cumulative_fields_match(llm):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    [expected] = llm.generate([PROMPT], params)
    assert expected.text == llm.tokenizer.decode(expected.token_ids, skip_special_tokens=True)
    rid = llm.add_request(PROMPT, params)
    tokens, text, last = [], "", None
    while llm.has_unfinished_requests():
        for out in llm.step():
            tokens += out.new_token_ids
            text += out.new_text
            assert out.token_ids == tokens and out.text == text and out.request_id == rid
            last = out
    assert last.finished and tokens == expected.token_ids and text == expected.text
    assert len(last.inter_token_latencies_s) == len(tokens) - 1


def test_stop_strings_and_a_non_special_stop_token_through_generate(llm):
    base = llm.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    stop = base.text[8:11]
    assert stop and base.text.find(stop) >= 0
    out = llm.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,)))[0]
    assert out.finish_reason == "stop" and out.text == base.text[:base.text.find(stop)]
    assert len(out.token_ids) < len(base.token_ids) and out.token_ids == base.token_ids[:len(out.token_ids)]
    token = base.token_ids[3]
    first = base.token_ids.index(token)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(token,)))[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[:first + 1]
    assert out.text == llm.tokenizer.decode(base.token_ids[:first])
    out = llm.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(token,),
                                                include_stop_str_in_output=True))[0]
    assert out.text == llm.tokenizer.decode(base.token_ids[:first + 1])


def test_min_tokens_holds_stop_strings_back_until_that_many_tokens_are_out(llm):
    base = llm.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    stop = base.text[8:11]
    early = llm.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,)))[0]
    assert early.finish_reason == "stop"
    min_tokens = len(early.token_ids) + 2
    later = llm.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,), min_tokens=min_tokens))[0]
    # the first occurrence is passed over; the request ends at a later one, or runs to max_tokens
    assert len(later.token_ids) >= min_tokens and later.token_ids == base.token_ids[:len(later.token_ids)]
    assert later.text.startswith(base.text[:base.text.find(stop) + len(stop)])


def test_stop_strings_without_a_tokenizer_are_refused_by_name(model_dir):
    llm = LLM(str(model_dir), tokenizer=None, **SMALL)
    llm.tokenizer = None  # a weights-only model: token-id prompts, no text
    with pytest.raises(InvalidRequestError, match="SamplingParams.stop needs a tokenizer") as info:
        llm.add_request([2, 5, 6], SamplingParams(stop=("x",)))
    assert info.value.param == "stop" and not llm.has_unfinished_requests()


def test_abort_frees_blocks_at_once_is_idempotent_and_leaves_others_alone(llm):
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    [expected] = llm.generate([PROMPT], params)
    pool = llm.runtime.block_pool
    free_before = pool.num_free_blocks
    keep = llm.add_request(PROMPT, params)
    victim = llm.add_request("Hello world! How are you today?", params)
    for _ in range(3):
        llm.step()
    held = len(pool.block_table(victim))
    assert held > 0
    free = pool.num_free_blocks
    assert llm.abort(victim) is True
    assert pool.num_free_blocks == free + held and pool.block_table(victim) == []
    assert llm.abort(victim) is False and llm.abort("no-such-request") is False
    last = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            last[out.request_id] = out
    assert last[victim].finished and last[victim].finish_reason == "abort"
    assert last[keep].token_ids == expected.token_ids
    assert pool.num_free_blocks == free_before and not llm.has_unfinished_requests()


def test_a_step_decodes_every_request_in_one_batch_with_the_texts_of_one_at_a_time(tokenizer):
    """update_all: the windows of every request go to the tokenizer's batched decode once, and each
    request's text is what updating it alone gives (the reference: the tokenizer's full decode)."""
    from engine.core.detokenizer import BatchDecoder, update_all

    class Counting(BatchDecoder):
        calls = 0

        def __call__(self, sequences):
            Counting.calls += 1
            return super().__call__(sequences)

    texts = CORPUS[:5]
    token_lists = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    decode = Counting(tokenizer)
    assert decode._batch is not None  # a fast tokenizer: the Rust batch path is the one under test
    requests = [Request(str(i), [2], SamplingParams()) for i in range(len(texts))]
    trackers = [OutputTracker(r, tokenizer, decode) for r in requests]
    for n in range(max(map(len, token_lists))):
        live = [(t, r) for t, r, ids in zip(trackers, requests, token_lists) if n < len(ids)]
        for _, r in live:
            r.token_ids.append(token_lists[int(r.request_id)][n])
        before = Counting.calls
        assert update_all(live) == []
        assert Counting.calls == before + 1
    for tracker, request, ids in zip(trackers, requests, token_lists):
        request.status, request.finish_reason = RequestStatus.FINISHED, FinishReason.LENGTH
        tracker.update(request)
        assert tracker.output(request).text == tokenizer.decode(ids, skip_special_tokens=True)


def test_held_back_suffix_is_the_longest_that_could_start_a_stop_string():
    """_stop_prefix_len against its definition, on random texts over a small alphabet (so partial
    matches are frequent), stop strings of several lengths, repeated characters included."""
    import random

    from engine.core.detokenizer import _stop_prefix_len

    def reference(text, stops):
        return max([n for stop in stops for n in range(1, min(len(stop) - 1, len(text)) + 1)
                    if text.endswith(stop[:n])], default=0)

    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("abc") for _ in range(rng.randrange(0, 12)))
        stops = tuple("".join(rng.choice("abc") for _ in range(rng.randrange(1, 7))) for _ in range(rng.randrange(1, 4)))
        assert _stop_prefix_len(text, stops) == reference(text, stops), (text, stops)
