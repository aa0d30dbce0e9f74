"""The front end's process: detokenization and stop strings beside the step loop, not on its thread.

Inline, a step's text costs the step thread ~0.5 ms at batch 64 (one batched Rust decode plus the
per-request windows and stop-string scans in Python). A thread of its own does not help: its Python
holds the GIL when the step thread wakes from its wait for the device, and the next launch waits
behind it (bench/results/h100-2026-11-28/engine-core/h200-thread-vs-inline/ measures both).
A process has its own interpreter, as vLLM's detokenizing API process and SGLang's detokenizer
process do. The step thread's share is one record a step out and one reply in.

Protocol, over two pipes (multiprocessing.connection framing, pickled tuples):
- start: the path of a file holding the tokenizer's JSON (the fast tokenizer's own serialization: the
  same Rust tokenizer; TextProcess.attach).
- per step, one record `(news, updates)`: `news` = (key, prompt context ids, stop strings,
  include_stop, min_tokens) for requests seen the first time, `updates` = (key, new token ids, output
  tokens so far, end code) for each request that got tokens (or ended) in the step.
- per record, one reply: (key, text emitted, done, stopped_at or None) for each request whose text
  moved or ended; ("error", traceback) if the process failed, after which it exits.

Invariants:
- Records are answered in order, one reply each; `flush()` waits until every record sent is answered.
  `LLM.step()` and the end of `generate()` flush before they build outputs, so outputs hold the same
  text as inline.
- A stop string found in the process is applied by the step thread when its reply is read (at the
  next step at the latest): the request is finished then, and the tokens sampled meanwhile are never
  reported (OutputTracker.stopped_at), exactly the outputs of an inline match.
- The process reads only what records carry; a request's state there is dropped with its last reply
  (done). A process that dies or fails is an error raised on the step thread, never a silent loss.
"""
from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import tempfile
from multiprocessing.connection import Connection
from typing import Any

from engine.core.detokenizer import END_RUNNING, PROMPT_CONTEXT_TOKENS, BatchDecoder, OutputTracker, end_code, update_all
from engine.request import Request, RequestStatus

logger = logging.getLogger("engine")
_FINISHED = RequestStatus.FINISHED

# The longest wait for a reply before the process counts as hung: its first covers its imports and
# the tokenizer's parse (a few seconds), every later one a step's decode (a millisecond or so).
REPLY_TIMEOUT_S = 120.0


class TextProcessError(RuntimeError):
    """The front end's process failed or exited: the text of the requests in flight is lost."""


class InlineText:
    """The front end on the step thread: each record is applied at once."""

    process = False

    def hand_over(self, pairs: list[tuple[OutputTracker, Request]]) -> list[Request]:
        """Advance these requests' texts; the requests whose stop string matched."""
        return update_all(pairs) if pairs else []

    def poll(self) -> list[Request]:
        return []

    def flush(self) -> list[Request]:
        return []

    def close(self) -> None:
        pass


class TextProcess:
    """The front end in a process of its own; `poll` / `flush` return the requests whose stop string
    it found (to be finished by the caller)."""

    process = True

    def __init__(self) -> None:
        """Start the process (it imports the engine's modules meanwhile: ~2 s); `attach` gives it the
        tokenizer. The engine starts it first thing, so both overlap its own start-up."""
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "engine.core.text_worker", str(to_child_r), str(from_child_w)],
                pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL, env=env)
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        self._send = Connection(to_child_w, readable=False)
        self._recv = Connection(from_child_r, writable=False)
        self._tokenizer_file: str | None = None
        self._live: dict[int, tuple[OutputTracker, Request]] = {}
        self._next_key = 0
        self._unanswered = 0
        self.records = 0
        self.flush_waits = 0

    def attach(self, tokenizer: Any) -> None:
        """Hand the process the tokenizer: its Rust backend's JSON, through a file (33 MB for Gemma's: a
        pipe would block this thread until the process, still importing, read it all). The process
        removes the file once read; `close` does if it never was."""
        fd, self._tokenizer_file = tempfile.mkstemp(prefix="infer-graphs-tokenizer-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(tokenizer._tokenizer.to_str())
        self._send.send(self._tokenizer_file)

    @staticmethod
    def can_run(tokenizer: Any) -> bool:
        """Whether the process decodes exactly as this tokenizer does: its Rust backend's batched
        decode is the engine's decode (BatchDecoder), checked on a probe of token ids."""
        decode = BatchDecoder(tokenizer)
        if decode._batch is None:
            return False
        size = len(tokenizer)
        probe = [[(i * 7919 + 13) % size for i in range(24)], list(range(min(size, 24)))]
        return all(decode._batch([ids], skip_special_tokens=True)[0] == tokenizer.decode(ids, skip_special_tokens=True)
                   for ids in probe)

    def hand_over(self, pairs: list[tuple[OutputTracker, Request]]) -> list[Request]:
        """Send one record of these requests' new tokens; [] (matches come back through poll / flush)."""
        self.poll_failure()
        news, updates = [], []
        for tracker, request in pairs:  # ~0.3 us a request: this loop is the step thread's whole share
            if tracker.done:
                continue
            key = tracker.key
            if key is None:
                tracker.key = key = self._next_key
                self._next_key += 1
                self._live[key] = (tracker, request)
                params = request.params
                news.append((key, request.prompt_token_ids[-PROMPT_CONTEXT_TOKENS:], tuple(params.stop),
                             params.include_stop_str_in_output, params.min_tokens))
            # tracker.take_new and end_code, inline (64 times a step at batch 64)
            ids, num_prompt = request.token_ids, len(request.prompt_token_ids)
            num_out = len(ids) - num_prompt
            new = ids[num_prompt + tracker.num_sent:]
            tracker.num_sent = num_out
            updates.append((key, new, num_out, END_RUNNING if request.status is not _FINISHED else end_code(request)))
        if updates:
            self._send.send((news, updates))
            self._unanswered += 1
            self.records += 1
        return []

    def poll(self) -> list[Request]:
        """Apply the replies already here, without waiting."""
        matched: list[Request] = []
        while self._unanswered and self._recv.poll():
            self._apply(self._receive(), matched)
        return matched

    def flush(self) -> list[Request]:
        """Apply every reply still owed (waiting for them)."""
        matched = self.poll()
        if self._unanswered:
            self.flush_waits += 1
        while self._unanswered:
            if not self._recv.poll(REPLY_TIMEOUT_S):  # (a process that died is an EOF here, at once)
                raise TextProcessError(f"the front end's process did not answer in {REPLY_TIMEOUT_S:.0f} s "
                                       f"({self._unanswered} record(s) unanswered)")
            self._apply(self._receive(), matched)
        return matched

    def _receive(self) -> Any:
        try:
            return self._recv.recv()
        except EOFError:
            raise TextProcessError(f"the front end's process exited (status {self._proc.poll()}) with "
                                   f"{self._unanswered} record(s) unanswered") from None

    def poll_failure(self) -> None:
        code = self._proc.poll()
        if code is not None:
            raise TextProcessError(f"the front end's process exited with status {code}")

    def _apply(self, reply: Any, matched: list[Request]) -> None:
        self._unanswered -= 1
        if isinstance(reply, tuple):
            raise TextProcessError(f"the front end's process failed:\n{reply[1]}")
        live = self._live
        for key, piece, done, stopped_at in reply:
            tracker, request = live[key]
            tracker.apply(piece, done, stopped_at)
            if done:  # (a stop string's match ends the text too)
                del live[key]
                if stopped_at is not None:
                    matched.append(request)

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._send.send(None)
            except OSError:
                pass
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._send.close()
        self._recv.close()
        if self._tokenizer_file is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._tokenizer_file)


def spawn_front_end(want: bool) -> TextProcess | None:
    """The process, started before the engine's start-up where EngineConfig.frontend_process asks for
    it; None where it is not asked for or could not start (said in the log: the text is the same inline)."""
    if not want:
        return None
    try:
        return TextProcess()
    except OSError as exc:  # no process to be had (a sandbox, a limit)
        logger.warning("the front end runs on the step thread: its process did not start (%s)", exc)
        return None


def start_front_end(tokenizer: Any, spawned: TextProcess | None) -> InlineText | TextProcess:
    """The engine's front end once its tokenizer is known: the spawned process, given the tokenizer;
    inline without a process, without a tokenizer, or where the process could not decode exactly as
    the tokenizer does (said once in the log; the process is ended)."""
    if spawned is None:
        return InlineText()
    if tokenizer is None or not TextProcess.can_run(tokenizer):
        if tokenizer is not None:
            logger.info("the front end runs on the step thread: the tokenizer has no batched Rust decode equal "
                        "to its decode()")
        spawned.close()
        return InlineText()
    spawned.attach(tokenizer)
    return spawned
