"""Text of a request as it grows: incremental detokenization, stop strings, and the delta outputs.

The cost of one step is proportional to the tokens it adds, never to the tokens already generated:

- `IncrementalDetokenizer` decodes only a short window of token ids (vLLM's prefix / read offsets):
  the new text is decode(window) minus decode(window up to the last emitted token). A window whose text
  ends in U+FFFD is an incomplete UTF-8 character (a byte-level token split it): it is held back until
  the next token completes it, so no client ever sees half a character.
- `OutputTracker` appends each step's text to a list of pieces that is never rewritten, holds back only
  a suffix that could still become a stop string, and builds each `RequestOutput` from cursors into
  the request's own lists (the cumulative fields are materialized only when read).
- `update_all` advances every request of a step with ONE batched decode (`BatchDecoder`: the fast
  tokenizer's Rust `decode_batch`) instead of two Python-level decodes per request: at batch 64 those
  were most of the ~0.9 ms a step the front end cost the step thread.
"""
from __future__ import annotations

import logging
from typing import Any

from engine.outputs import RequestOutput, TextHistory
from engine.request import FinishReason, Request

logger = logging.getLogger("engine")

# Prompt tokens decoded in front of the first output token, so a tokenizer that drops or adds a
# leading space at the start of a decode does it to the context, not to the output.
PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character has at most 4 bytes; a window that still ends in U+FFFD after this many new tokens
# holds a genuinely invalid byte sequence, and it is emitted (replacement character included).
MAX_HELD_TOKENS = 8


class BatchDecoder:
    """Many token lists decoded at once, exactly as `tokenizer.decode(ids, skip_special_tokens=True)`.

    A fast tokenizer's backend decodes the whole batch in one call (in Rust). Where
    transformers' decode would post-process the text (clean_up_tokenization_spaces), or the backend
    is missing, or the first batch's first text differs from `tokenizer.decode` (a check made once),
    it decodes one list at a time through `tokenizer.decode`, and says so once in the log."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "_tokenizer", None)
        self._batch = getattr(backend, "decode_batch", None)
        if getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._batch = None
        self._checked = self._batch is None

    def __call__(self, sequences: list[list[int]]) -> list[str]:
        if self._batch is not None and sequences:
            texts = self._batch(sequences, skip_special_tokens=True)
            if self._checked:
                return texts
            self._checked = True
            if texts[0] == self._one(sequences[0]):
                return texts
            logger.info("the tokenizer's batched decode differs from its decode(): decoding one text at a time")
            self._batch = None
        return [self._one(ids) for ids in sequences]

    def _one(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], decode: BatchDecoder | None = None) -> None:
        self.decode = decode or BatchDecoder(tokenizer)
        self._window = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._read = len(self._window)  # window[:read] is already emitted (or prompt context)

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """The text the new tokens complete ("" while a character is still incomplete).

        `final`: no more tokens will come, so held-back bytes are emitted as they decode."""
        windows = self.extend(token_ids)
        return "" if windows is None else self.settle(*self.decode(list(windows)), final)

    def extend(self, token_ids: list[int]) -> tuple[list[int], list[int]] | None:
        """Take the new tokens; the two windows to decode (emitted part, whole), or None if no token
        waits. `settle` takes their texts."""
        self._window.extend(token_ids)
        if self._read == len(self._window):
            return None
        return self._window[:self._read], list(self._window)

    def settle(self, prefix: str, full: str, final: bool) -> str:
        """The new text, given the decoded windows of the last `extend`."""
        held = len(self._window) - self._read
        if not final and held < MAX_HELD_TOKENS and (len(full) <= len(prefix) or full.endswith("\ufffd")):
            return ""  # an incomplete character, or only skipped special tokens so far
        # The next window starts at the first token not yet emitted, keeping the emitted ones before
        # it only as context for the next decode.
        del self._window[:self._read]
        self._read = len(self._window)
        return full[len(prefix):]


class OutputTracker:
    """What one request's outputs have said so far; `update` (or `update_all`) after every step that
    gave it tokens."""

    def __init__(self, request: Request, tokenizer: Any, decode: BatchDecoder | None = None) -> None:
        params = request.params
        self.detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, decode) if tokenizer else None
        self.stops = tuple(params.stop)
        self.include_stop = params.include_stop_str_in_output
        self.pieces: list[str] = []   # emitted text, append-only: outputs share it
        self.pending = ""             # decoded text held back because it may start a stop string
        self.num_seen = 0             # output tokens fed to the detokenizer (or skipped)
        self.done = False             # the text is final (finished, or a stop string matched)
        self.num_reported_tokens = 0  # cursors of the previous RequestOutput
        self.num_reported_pieces = 0

    def update(self, request: Request) -> bool:
        """Detokenize the tokens the request got since the last call; True if a stop string matched
        (the caller then finishes the request with FinishReason.STOP)."""
        return bool(update_all([(self, request)]))

    def _begin(self, request: Request) -> tuple[list[int], list[int]] | None:
        """The first half of an update: take the new tokens; the windows to decode (both empty when
        no token waits to be decoded), or None when there is nothing to do (no tokenizer, or the text
        is final)."""
        if self.done:
            return None
        start = request.num_prompt_tokens + self.num_seen
        new = request.token_ids[start:]  # only the tail: O(new tokens)
        self.num_seen += len(new)
        finished = request.is_finished
        if finished and new and not self.include_stop and request.finish_reason in (
                FinishReason.EOS, FinishReason.STOP):
            new = new[:-1]  # the stop / EOS token ended the request: its text is not part of the output
        if self.detokenizer is None:
            self.done = finished
            return None
        return self.detokenizer.extend(new) or ((), ())

    def _end(self, request: Request, texts: tuple[str, str] | None) -> bool:
        """The second half: the windows' texts (None: nothing was decoded); True if a stop string matched."""
        finished = request.is_finished
        new_text = "" if texts is None else self.detokenizer.settle(*texts, final=finished)
        text = self.pending + new_text
        # before min_tokens tokens are out, a stop string does not end the request (vLLM's rule)
        can_stop = request.num_tokens - request.num_prompt_tokens >= request.params.min_tokens
        matched = self._emit(text, finished, can_stop)
        self.done = finished or matched
        return matched

    def _emit(self, text: str, finished: bool, can_stop: bool) -> bool:
        if self.stops and can_stop:
            found = [(i, stop) for stop in self.stops if (i := text.find(stop)) >= 0]
            if found:
                index, stop = min(found, key=lambda f: (f[0], -len(f[1])))
                self._append(text[:index + len(stop)] if self.include_stop else text[:index])
                self.pending = ""
                return True
        keep = 0 if finished else _stop_prefix_len(text, self.stops)
        self._append(text[:len(text) - keep])
        self.pending = text[len(text) - keep:]
        return False

    def _append(self, text: str) -> None:
        if text:
            self.pieces.append(text)

    def output(self, request: Request) -> RequestOutput:
        """The request's state now; the delta fields hold what is new since its previous output."""
        if request.is_finished and not self.done:  # aborted, or finished between updates
            self.update(request)
        num_tokens = request.num_tokens - request.num_prompt_tokens
        start = request.num_prompt_tokens + self.num_reported_tokens
        new_text = "".join(self.pieces[self.num_reported_pieces:])
        times = request.token_times
        logprobs = request.logprobs if request.params.logprobs is not None else None
        out = RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            new_token_ids=request.token_ids[start:],
            new_text=new_text,
            finished=request.is_finished,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            ttft_s=times[0] - request.arrival_time if times else None,
            num_preemptions=request.num_preemptions,
            history=TextHistory(request.token_ids, request.num_prompt_tokens, num_tokens, self.pieces,
                                len(self.pieces), times, logprobs),
            new_logprobs=None if logprobs is None else logprobs[self.num_reported_tokens:num_tokens],
        )
        self.num_reported_tokens = num_tokens
        self.num_reported_pieces = len(self.pieces)
        return out


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        longest = min(len(stop) - 1, len(text))
        # A suffix that starts a stop string starts with its first character: where that character
        # is absent from the text's last `longest` characters (nearly every step), nothing is held.
        at = text.find(stop[0], len(text) - longest) if longest > best else -1
        while at >= 0 and len(text) - at > best:
            if stop.startswith(text[at:]):
                best = len(text) - at
                break
            at = text.find(stop[0], at + 1)
    return best


def update_all(pairs: list[tuple[OutputTracker, Request]]) -> list[Request]:
    """Update every tracker with its request's new tokens, decoding all windows in one batch (the
    trackers of one engine share one BatchDecoder); the requests whose stop string matched."""
    plans = [(tracker, request, tracker._begin(request)) for tracker, request in pairs]
    sequences = [seq for _, _, windows in plans if windows and windows[1] for seq in windows]
    decode = next((t.detokenizer.decode for t, _, windows in plans if windows and windows[1]), None)
    texts = iter(decode(sequences) if sequences else ())
    matched = []
    for tracker, request, windows in plans:
        if windows is None:
            continue
        decoded = (next(texts), next(texts)) if windows[1] else None
        if tracker._end(request, decoded):
            matched.append(request)
    return matched
