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

TEXTS = ["", " the", 'quote " and \\ backslash', "new\nline\ttab\r", "ü ß 漢字 🙂", "\x00\x1f control", "\u2028\u2029"]
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
