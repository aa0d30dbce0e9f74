"""OpenAI `logprobs` objects from the engine's per-token TokenLogprobs.

A token's string is the tokenizer's decode of that one id (special tokens shown, no clean-up of
spaces), as vLLM returns it. A byte-level tokenizer can split a character: such a token decodes to
U+FFFD, and its chat `bytes` are then its raw bytes, read from its vocabulary entry (a byte-level BPE
piece, or a SentencePiece byte-fallback `<0xNN>`) and kept only if they decode to the same string;
otherwise (any other vocabulary) the UTF-8 of the decoded string, as vLLM does. A completion's
`text_offset` is where each token's text starts in the completion text: the index of the character
its first byte belongs to, so a character split over two tokens counts once (both tokens start at
it; summing token-string lengths, as vLLM does, would count a U+FFFD per token and shift every later
offset). Exact for valid UTF-8; a byte that never becomes a character is decided by the token after
it only. Without a tokenizer a token is "token_id:N" (vLLM's form).

Everything here runs on the server's tokenizer thread, with that thread's own tokenizer: the cache of
token strings is filled and read there only, and is bounded by the vocabulary.
"""
from __future__ import annotations

import os
import re
from typing import Any

from engine.core.detokenizer import MAX_HELD_TOKENS, PROMPT_CONTEXT_TOKENS
from engine.request import TokenLogprobs

# JSON has no -inf (a logit the model masked) and no NaN; vLLM clamps to the same value
MIN_LOGPROB = -9999.0
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a byte-level BPE piece uses -> its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return {c: b for b, c in chars.items()}


_BYTE_LEVEL = _byte_level_decoder()


def finite(logprob: float) -> float:
    return logprob if logprob > MIN_LOGPROB else MIN_LOGPROB  # NaN fails the comparison too


class TokenText:
    """Each token id's string and bytes, decoded once (tokenizer thread only)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._decode(token_id)
        return hit

    def _decode(self, token_id: int) -> tuple[str, list[int]]:
        if self.tokenizer is None:
            text = f"token_id:{token_id}"
            return text, list(text.encode())
        text = self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if "\ufffd" in text:
            raw = self._raw_bytes(token_id, text)
            if raw is not None:
                return text, list(raw)
        return text, list(text.encode("utf-8"))

    def _raw_bytes(self, token_id: int, text: str) -> bytes | None:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return None
        match = _BYTE_FALLBACK.fullmatch(piece)
        if match:
            raw = bytes([int(match.group(1), 16)])
        elif all(c in _BYTE_LEVEL for c in piece):
            raw = bytes(_BYTE_LEVEL[c] for c in piece)
        else:
            return None
        # the piece was read right only if its bytes are what the tokenizer decoded
        return raw if raw.decode("utf-8", errors="replace") == text else None


class LogprobsFormatter:
    """One request's logprobs objects, chunk by chunk (a stream) or all at once; tokenizer thread only."""

    def __init__(self, token_text: TokenText, chat: bool) -> None:
        self.token_text = token_text
        self.chat = chat
        self._offsets: _TextOffsets | None = None

    def __call__(self, prompt_token_ids: list[int], logprobs: list[TokenLogprobs]) -> dict[str, Any]:
        """The object for these tokens, which follow those of the previous call."""
        return self._chat(logprobs) if self.chat else self._completion(prompt_token_ids, logprobs)

    def _chat(self, logprobs: list[TokenLogprobs]) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text, raw = self.token_text(token_id)
            return {"token": text, "logprob": finite(logprob), "bytes": raw}

        return {"content": [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                            for t in logprobs]}

    def _completion(self, prompt_token_ids: list[int], logprobs: list[TokenLogprobs]) -> dict[str, Any]:
        tokens, token_logprobs, top_logprobs = [], [], []
        for t in logprobs:
            tokens.append(self.token_text(t.token_id)[0])
            token_logprobs.append(finite(t.logprob))
            top: dict[str, float] = {}
            for token_id, logprob in t.top:  # most likely first; two ids with one string keep the likelier
                top.setdefault(self.token_text(token_id)[0], finite(logprob))
            top.setdefault(tokens[-1], token_logprobs[-1])  # the sampled token is always there, as in vLLM
            top_logprobs.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": self._text_offsets(prompt_token_ids, [t.token_id for t in logprobs])}

    def _text_offsets(self, prompt_token_ids: list[int], token_ids: list[int]) -> list[int]:
        tokenizer = self.token_text.tokenizer
        if tokenizer is None:
            return [0] * len(token_ids)  # no tokenizer, no text
        if self._offsets is None:
            self._offsets = _TextOffsets(tokenizer, prompt_token_ids)
        return [self._offsets.next(token_id) for token_id in token_ids]


class _TextOffsets:
    """Each token's character offset in the completion text, one token at a time.

    Decodes as the engine's IncrementalDetokenizer does (a few tokens of context in front, so a
    tokenizer's leading-space rule applies to the context; tokens held while their text ends in U+FFFD,
    an incomplete character), and also counts the characters inside the held text that the new token
    leaves as they were: those end before its first byte. A decode shows an incomplete tail as one
    U+FFFD (the "maximal subpart" rule of Python and Rust alike), so only the last one may still change."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self._context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._context_text = self._decode(self._context)
        self._held: list[int] = []  # tokens after the context whose text ends in an incomplete character
        self._held_text = ""
        self._done = 0              # characters before the held tokens

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)  # as the engine's text

    def next(self, token_id: int) -> int:
        self._held.append(token_id)
        text = self._decode(self._context + self._held)[len(self._context_text):]
        settled = text[:-1] if text.endswith("\ufffd") else text
        offset = self._done + len(os.path.commonprefix([self._held_text, settled]))
        self._held_text = text
        if not self._held_text.endswith("\ufffd") or len(self._held) >= MAX_HELD_TOKENS:
            self._done += len(self._held_text)
            self._context, self._held, self._held_text = self._held, [], ""
            self._context_text = self._decode(self._context)
        return offset
