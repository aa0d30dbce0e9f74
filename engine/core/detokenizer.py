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


class TextState:
    """The text of one request's output as its tokens arrive: the detokenizer, the stop strings and
    the text held back because it could still start one. It sees token ids and counts only, never the
    Request, so the front end's process (engine.core.text_process) runs it from the records it gets."""

    __slots__ = ("detokenizer", "stops", "include_stop", "min_tokens", "pending", "num_seen", "done",
                 "stopped_at")

    def __init__(self, decode: BatchDecoder | Any, prompt_context: list[int], stops: tuple[str, ...],
                 include_stop: bool, min_tokens: int) -> None:
        self.detokenizer = IncrementalDetokenizer(None, prompt_context, decode)
        self.stops, self.include_stop, self.min_tokens = stops, include_stop, min_tokens
        self.pending = ""             # decoded text held back because it may start a stop string
        self.num_seen = 0             # output tokens taken (their text emitted, held, or dropped)
        self.done = False             # the text is final (finished, or a stop string matched)
        self.stopped_at: int | None = None  # output tokens up to the one that completed a stop string

    def begin(self, new: list[int], end: int) -> tuple[list[int], list[int]] | tuple[()] | None:
        """Take the tokens the request got since the last call (`end`: one of the END_ codes); the
        windows to decode (() when none waits), or None when the text is already final."""
        if self.done:
            return None
        self.num_seen += len(new)
        if end == END_BY_TOKEN and new and not self.include_stop:
            new = new[:-1]  # the stop / EOS token ended the request: its text is not part of the output
        return self.detokenizer.extend(new) or ()

    def end(self, texts: tuple[str, str] | None, num_output_tokens: int, end: int) -> tuple[str, bool]:
        """The second half, given the windows' texts (None: nothing was decoded): (the text now
        emitted, whether a stop string matched)."""
        finished = end != END_RUNNING
        new_text = "" if texts is None else self.detokenizer.settle(*texts, final=finished)
        text = self.pending + new_text
        # before min_tokens tokens are out, a stop string does not end the request (vLLM's rule)
        matched, emitted = self._emit(text, finished, num_output_tokens >= self.min_tokens)
        if matched:
            self.stopped_at = self.num_seen
        self.done = finished or matched
        return emitted, matched

    def _emit(self, text: str, finished: bool, can_stop: bool) -> tuple[bool, str]:
        if self.stops and can_stop:
            found = [(i, stop) for stop in self.stops if (i := text.find(stop)) >= 0]
            if found:
                index, stop = min(found, key=lambda f: (f[0], -len(f[1])))
                self.pending = ""
                return True, text[:index + len(stop)] if self.include_stop else text[:index]
        keep = 0 if finished else _stop_prefix_len(text, self.stops)
        self.pending = text[len(text) - keep:]
        return False, text[:len(text) - keep]


# How a request stood after the step a record describes (TextState.begin / end)
END_RUNNING, END_OTHER, END_BY_TOKEN = 0, 1, 2  # END_BY_TOKEN: its last token (EOS / stop token) ended it


def end_code(request: Request) -> int:
    if not request.is_finished:
        return END_RUNNING
    return END_BY_TOKEN if request.finish_reason in (FinishReason.EOS, FinishReason.STOP) else END_OTHER


def text_state(request: Request, decode: BatchDecoder | Any) -> TextState:
    params = request.params
    return TextState(decode, request.prompt_token_ids[-PROMPT_CONTEXT_TOKENS:], tuple(params.stop),
                     params.include_stop_str_in_output, params.min_tokens)


def advance_all(updates: list[tuple[TextState, list[int], int, int]]) -> list[tuple[str, bool] | None]:
    """Advance each (state, new tokens, output tokens so far, end code), decoding every window in one
    batch (the states of one engine share one decoder); per update (the text emitted, whether a stop
    string matched), or None where the text was already final."""
    plans = [state.begin(new, end) for state, new, _, end in updates]
    sequences = [seq for windows in plans if windows for seq in windows]
    texts = iter(updates[0][0].detokenizer.decode(sequences) if sequences else ())
    return [None if windows is None else
            state.end((next(texts), next(texts)) if windows else None, num_out, end)
            for (state, _, num_out, end), windows in zip(updates, plans)]


class OutputTracker:
    """What one request's outputs have said so far: its text pieces and the cursors of its previous
    output. The text comes from a TextState here (`update` / `update_all`, after every step that gave
    the request tokens) or, with the front end's process, from that process's replies
    (engine.core.text_process), which fill `pieces`, `done` and `stopped_at` the same way."""

    def __init__(self, request: Request, tokenizer: Any, decode: BatchDecoder | None = None,
                 local: bool = True) -> None:
        self.text = text_state(request, decode or BatchDecoder(tokenizer)) if tokenizer and local else None
        self.pieces: list[str] = []   # emitted text, append-only: outputs share it
        self.num_sent = 0             # output tokens handed to the text (here or to the process)
        self.done = False             # the text is final (finished, or a stop string matched)
        # Output tokens up to the one whose text completed a stop string. The request is finished
        # when the match is applied, which with the front end's process is a step or two later: the
        # tokens sampled meanwhile are never reported.
        self.stopped_at: int | None = None
        self.key: int | None = None   # the front end process's name for it
        self.num_reported_tokens = 0  # cursors of the previous RequestOutput
        self.num_reported_pieces = 0

    @property
    def pending(self) -> str:
        return self.text.pending if self.text is not None else ""

    def update(self, request: Request) -> bool:
        """Detokenize the tokens the request got since the last call; True if a stop string matched
        (the caller then finishes the request with FinishReason.STOP)."""
        return bool(update_all([(self, request)]))

    def take_new(self, request: Request) -> tuple[list[int], int]:
        """The output tokens not yet handed to the text (only the tail: O(new tokens)), and how many
        output tokens the request has."""
        ids = request.token_ids
        num_out = len(ids) - len(request.prompt_token_ids)
        new = ids[len(ids) - num_out + self.num_sent:]
        self.num_sent = num_out
        return new, num_out

    def apply(self, piece: str, done: bool, stopped_at: int | None) -> None:
        if piece:
            self.pieces.append(piece)
        if stopped_at is not None:
            self.stopped_at = stopped_at
        self.done = self.done or done

    def output(self, request: Request) -> RequestOutput:
        """The request's state now; the delta fields hold what is new since its previous output."""
        # (one per request and step on LLM.step()'s path: the request's fields are read once each)
        finished = request.is_finished
        if finished and not self.done and (self.text is not None or self.key is None):
            self.update(request)  # aborted, or finished between updates (a remote text is flushed by LLM)
        ids, prompt = request.token_ids, request.prompt_token_ids
        num_prompt = len(prompt)
        num_tokens = len(ids) - num_prompt
        reason = request.finish_reason
        if self.stopped_at is not None:
            num_tokens, finished, reason = min(num_tokens, self.stopped_at), True, FinishReason.STOP
        reported, pieces = self.num_reported_tokens, self.pieces
        num_pieces = len(pieces)
        times = request.token_times
        logprobs = request.logprobs if request.params.logprobs is not None else None
        out = RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=prompt,
            new_token_ids=ids[num_prompt + reported:num_prompt + num_tokens],
            new_text="".join(pieces[self.num_reported_pieces:]),
            finished=finished,
            finish_reason=reason.value if reason else None,
            ttft_s=times[0] - request.arrival_time if times else None,
            num_preemptions=request.num_preemptions,
            history=TextHistory(ids, num_prompt, num_tokens, pieces, num_pieces, times, logprobs),
            new_logprobs=None if logprobs is None else logprobs[reported:num_tokens],
        )
        self.num_reported_tokens = num_tokens
        self.num_reported_pieces = num_pieces
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
    live, updates = [], []
    for tracker, request in pairs:
        new, num_out = tracker.take_new(request)
        if tracker.text is None:  # no tokenizer: no text, and the tokens end where the request ends
            tracker.done = request.is_finished
        elif not tracker.done:
            live.append((tracker, request))
            updates.append((tracker.text, new, num_out, end_code(request)))
    matched = []
    if updates:
        for (tracker, request), (piece, stop) in zip(live, advance_all(updates)):
            tracker.apply(piece, tracker.text.done, tracker.text.stopped_at)
            if stop:
                matched.append(request)
    return matched
