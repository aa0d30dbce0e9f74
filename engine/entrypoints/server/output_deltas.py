"""A step's outputs on their way from the engine process to the server, as deltas.

A RequestOutput reads its cumulative fields (every token id, text piece, token time, logprob) through
cursors into its request's own lists, which grow by a few entries a step. Pickling them whole each step
would cost in proportion to the request's length; instead the child sends only the entries the parent
has not seen (`encode_output`, with the child's cursors in a ChildStream), and the parent appends them
to its copy of the lists (`Mirror`) and builds RequestOutputs over that copy, which read as the child's.
"""
from __future__ import annotations

from engine.outputs import RequestOutput, TextHistory


class ChildStream:
    """The child's side of a request's stream: what of its lists the parent has already been sent."""

    __slots__ = ("request_id", "every_step", "sent_first", "tokens", "pieces", "times", "logprobs")

    def __init__(self, request_id: str, every_step: bool) -> None:
        self.request_id, self.every_step = request_id, every_step
        self.sent_first = False
        self.tokens = self.pieces = self.times = self.logprobs = 0


def encode_output(stream: ChildStream, out: RequestOutput) -> tuple:
    """A RequestOutput as what the parent has not seen of it: the new entries of the request's lists
    (the prompt with the first), the cursors, and the delta fields."""
    h = out.history
    if h is None:
        history = None
    else:
        end = h.num_prompt_tokens + h.num_output_tokens
        logprobs = None if h.token_logprobs is None else h.token_logprobs[stream.logprobs:h.num_output_tokens]
        history = (h.num_prompt_tokens, h.all_token_ids[stream.tokens:end], h.text_pieces[stream.pieces:h.num_text_pieces],
                   h.token_times[stream.times:h.num_output_tokens], logprobs, h.num_output_tokens, h.num_text_pieces)
        stream.tokens, stream.pieces, stream.times = end, h.num_text_pieces, h.num_output_tokens
        if logprobs is not None:
            stream.logprobs = h.num_output_tokens
    return (out.request_id, out.new_token_ids, out.new_text, out.finished, out.finish_reason, out.ttft_s,
            out.num_preemptions, out.new_logprobs, history)


class Mirror:
    """The parent's copy of one request's lists, grown from the deltas; RequestOutputs read it as the
    child's read the request's own."""

    __slots__ = ("prompt", "all_token_ids", "text_pieces", "token_times", "token_logprobs")

    def __init__(self) -> None:
        self.prompt: list[int] = []
        self.all_token_ids: list[int] = []
        self.text_pieces: list[str] = []
        self.token_times: list[float] = []
        self.token_logprobs: list | None = None

    def output(self, fields: tuple) -> RequestOutput:
        request_id, new_ids, new_text, finished, reason, ttft, preemptions, new_logprobs, history = fields
        h = None
        if history is not None:
            num_prompt, tokens, pieces, times, logprobs, num_out, num_pieces = history
            if not self.all_token_ids:
                self.prompt = tokens[:num_prompt]
            self.all_token_ids.extend(tokens)
            self.text_pieces.extend(pieces)
            self.token_times.extend(times)
            if logprobs is not None:
                if self.token_logprobs is None:
                    self.token_logprobs = []
                self.token_logprobs.extend(logprobs)
            h = TextHistory(self.all_token_ids, num_prompt, num_out, self.text_pieces, num_pieces, self.token_times,
                            self.token_logprobs)
        return RequestOutput(request_id, self.prompt, new_ids, new_text, finished, reason, ttft, preemptions,
                             history=h, new_logprobs=new_logprobs)
