"""A stream chunk written from its request's prefix (ResponseBuilder.chunk_event) is the same event, byte
for byte, as the chunk object encoded whole, for completions and chat, every kind of text, finish
reason, token ids and logprobs; and a client's JSON parser reads back what was put in."""
from __future__ import annotations

import itertools
import json
import random

import pytest

pytest.importorskip("pydantic")
from engine.entrypoints.server.protocol import ResponseBuilder, sse  # noqa: E402

TEXTS = ["", " the", 'quote " and \\ backslash', "new\nline\ttab\r", "ü ß 漢字 🙂", "\x00\x1f control", "\u2028\u2029",
         "next\x85line"]
REASONS = [None, "eos", "stop", "length", "abort"]
LOGPROBS = [None, {"tokens": [" a"], "token_logprobs": [-0.25], "top_logprobs": [{" a": -0.25, "b": -1.5}],
                   "text_offset": [0]}]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("return_token_ids", [False, True])
def test_chunk_event_is_the_encoded_chunk(chat, return_token_ids):
    rng = random.Random(int(chat) * 2 + int(return_token_ids))
    builder = ResponseBuilder('cmpl-"odd"-id', 'model/"name" ü', chat, return_token_ids)
    for text, reason, logprobs, first, ids in itertools.product(
            TEXTS, REASONS, LOGPROBS, (False, True), (None, [], [rng.randrange(200_000)], [5, 0, 151_643])):
        index = rng.randrange(4)
        expected = sse(builder.chunk(index, text, ids, reason, first=first, logprobs=logprobs))
        event = builder.chunk_event(index, text, ids, reason, first=first, logprobs=logprobs)
        assert event == expected, (text, reason, logprobs, first, ids)
        body = json.loads(event.removeprefix("data: "))
        choice = body["choices"][0]
        assert body["id"] == 'cmpl-"odd"-id' and body["model"] == 'model/"name" ü' and choice["index"] == index
        assert (choice["delta"]["content"] if chat else choice["text"]) == text
        assert ("token_ids" in choice) == (return_token_ids and ids is not None)


def test_every_event_is_one_line_for_clients_that_split_on_unicode_line_breaks():
    """httpx's aiter_lines (str.splitlines) also breaks lines at U+2028, U+2029 and U+0085, which JSON
    may carry raw: every event is still one data line (they go escaped) and parses back to the text.
    Before, a soak's streamed chunk reached the client cut in two (JSONDecodeError: Unterminated string)."""
    httpx = pytest.importorskip("httpx")
    from httpx._decoders import LineDecoder
    for chat in (False, True):
        builder = ResponseBuilder("cmpl-1", "m", chat, True)
        for text in TEXTS:
            for event in (builder.chunk_event(0, text, [1], None), sse(builder.chunk(0, text, [1], None))):
                lines = LineDecoder().decode(event)
                assert lines == [event[:-2], ""] and event[:-2] == event.splitlines()[0], (text, lines)
                choice = json.loads(lines[0].removeprefix("data: "))["choices"][0]
                assert (choice["delta"]["content"] if chat else choice["text"]) == text
    assert httpx is not None
