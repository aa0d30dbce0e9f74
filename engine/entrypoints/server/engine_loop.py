"""The one thread that drives the engine: every LLM call (add_request, step, abort, stats) runs here.

HTTP handlers run on the asyncio loop and never touch the LLM: they put commands on a thread-safe
queue and read their request's outputs from an asyncio queue, which this thread feeds through
`loop.call_soon_threadsafe` (once per step for all requests, not once per request). While nothing
runs, the thread blocks on the command queue; while requests run, it drains the commands between
steps, so a new request or an abort waits at most one step.

A request's stream receives, in order: ACCEPTED (or the InvalidRequestError / QueueFullError that
refused it), then RequestOutputs until one is finished, or an EngineUnavailable error (the engine
failed a step, or the server is shutting down). One bad request or one failed step never ends the loop.

What /health and /metrics read never waits for a step: the engine's counters (LLM.stats() without
the other tensor-parallel ranks' part) are a `snapshot` this thread publishes, as one new dict, at
most SNAPSHOT_INTERVAL_S apart while requests run and whenever it is about to go idle (before it
delivers the outputs that finished the last request, so a client that got its answer and then scrapes
sees it counted). A scrape during a step of any length reads the latest snapshot, at once.

Back-pressure: LLM.add_request enforces EngineConfig.max_waiting_requests on this thread, but a
request would only learn of it one step later (and after its prompt was tokenized). `queue_full`
answers at once on the asyncio side, from the waiting count this thread publishes after every step
and command batch plus the submissions it has not yet processed; add_request stays the authority.

Shutting down has two stages: `stop_accepting` (a drain: handlers refuse new API requests, /health
is 503, everything admitted runs on, the choices 1..n-1 of an admitted request included) and
`shutdown` (abort what still runs; every later submission is refused).

A failed tensor-parallel rank fails the step in progress (its requests end with EngineUnavailable)
and every later one: `failure` says so, and the server stops (engine.entrypoints.server.shutdown).
While idle this thread looks at the ranks every IDLE_CHECK_S, so a rank that dies between requests
is found without waiting for a request to fail on it.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any

from engine.core.llm import LLM, QueueFullError
from engine.core.stats import collect_stats
from engine.distributed.rank_loop import TensorParallelError
from engine.params import InvalidRequestError, SamplingParams

logger = logging.getLogger("engine.server")

ACCEPTED = object()
IDLE_CHECK_S = 1.0
# A collective fails as soon as a dead rank's sockets close, which can be a moment before the
# process can be seen to have exited: after a failed step the ranks are looked at for this long.
RANK_EXIT_WAIT_S = 2.0
# How stale /metrics may be while requests run: publishing costs tens of microseconds, too much
# for every step, nothing at this interval.
SNAPSHOT_INTERVAL_S = 0.1


class EngineUnavailable(RuntimeError):
    """The request cannot finish: the server is shutting down, or the engine failed a step."""


class Stream:
    """Where one engine request's outputs go, on the asyncio side: (index, item) pairs on `queue`. The n
    engine requests of one API request share one queue, each with its choice's index
    (engine.entrypoints.server.choices)."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, into: Any,
                 index: int = 0, every_step: bool = True) -> None:
        self.request_id = request_id
        self.loop = loop
        self.queue = into
        self.index = index
        # False (a response sent whole): only its first output with a token and its final one are
        # delivered; the final one's cumulative fields hold what the steps between said
        self.every_step = every_step
        self.sent_first = False  # engine thread only

    def put(self, item: Any) -> None:
        """Event loop thread only."""
        self.queue.put_nowait((self.index, item))


class Admission:
    """What the handlers read of an engine loop before they submit, the same whether the loop is a
    thread here (EngineLoop) or in a process of its own (engine_process.EngineProcess): accepting,
    healthy, and the back-pressure estimate. A subclass says whether its loop runs and why it failed."""

    def __init__(self, max_waiting: int | None) -> None:
        self.accepting = True   # new API requests are let in (False from the first shutdown signal)
        self._stopped = False   # every submission is refused (shutdown: the rest was aborted)
        self.max_waiting = max_waiting
        # Each counter has one writer, so reading them from the other thread needs no lock.
        self._num_submitted = 0  # asyncio side: submissions put on the command queue
        self._num_added = 0      # engine side: submissions it has processed (admitted or refused)
        self.num_waiting = 0     # engine side: len(scheduler.waiting) after its latest commands / step

    def is_alive(self) -> bool:
        raise NotImplementedError

    @property
    def failure(self) -> str | None:
        raise NotImplementedError

    @property
    def healthy(self) -> bool:
        """Accepting, the loop running, and no failure that makes every step fail."""
        return self.accepting and self.is_alive() and self.failure is None

    @property
    def num_admitting(self) -> int:
        """Submissions the engine has not processed yet (on their way to the waiting queue)."""
        return self._num_submitted - self._num_added

    def queue_full(self) -> bool:
        """Whether max_waiting_requests requests wait or are on their way to the queue (an estimate
        that may lag by one step; add_request's own check is exact)."""
        if self.max_waiting is None:
            return False
        return self.num_waiting + self.num_admitting >= self.max_waiting


class EngineLoop(Admission):
    def __init__(self, llm: LLM) -> None:
        super().__init__(llm.config.max_waiting_requests)
        self.llm = llm
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # put() is safe from a signal handler
        self._streams: dict[str, Stream] = {}   # engine thread only
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.failed_steps = 0
        # engine thread (and this constructor, before it starts): the latest counters, never mutated
        self.snapshot: dict[str, Any] = collect_stats(llm, gather_ranks=False)
        self._published_at = time.monotonic()

    # -- the asyncio side -----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def failure(self) -> str | None:
        """Why the engine can serve nothing more (a tensor-parallel rank failed), or None."""
        tp = self.llm.tp
        return None if tp is None else tp.failure

    def submit(self, prompt: Any, params: SamplingParams, request_id: str, into: Any,
               index: int = 0, every_step: bool = True) -> Stream:
        """Queue a request; its items go on `into` as (index, item). Choice 0 of an API request is
        bounded by max_waiting_requests; choices 1..n-1 belong to a request already let in.
        `every_step` False: a consumer that reads only the first and the final output (Stream)."""
        stream = Stream(request_id, asyncio.get_running_loop(), into, index, every_step)
        if self._stopped or not self.is_alive():
            stream.put(EngineUnavailable("the server is shutting down" if self._stopped
                                         else "the engine loop is not running"))
        else:
            self._num_submitted += 1
            self._commands.put((self._add, (prompt, params, stream, index == 0)))
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent; a finished or unknown one is left alone)."""
        self._commands.put((self._abort, (request_id,)))

    def stop_accepting(self) -> None:
        """The drain: new API requests are refused (handlers read `accepting`), admitted ones run on.
        Safe to call from a signal handler."""
        self.accepting = False

    def shutdown(self) -> None:
        """Refuse every submission and abort the running requests (their streams end with
        EngineUnavailable). Safe to call from a signal handler."""
        self.accepting = False
        self._stopped = True
        self._commands.put((self._abort_all, ("the server is shutting down",)))

    def stop(self, timeout_s: float = 10.0) -> None:
        self.shutdown()
        self._commands.put(None)
        self._thread.join(timeout_s)

    # -- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            idle = not self.llm.has_unfinished_requests()
            try:
                command = self._commands.get(block=idle, timeout=IDLE_CHECK_S if idle and self.llm.tp else None)
            except queue.Empty:
                command = ()
                if idle:
                    self._check_ranks()
            while command != ():
                if command is None:
                    return
                method, args = command
                try:
                    method(*args)
                except Exception:  # a command must never end the loop
                    logger.exception("engine loop: %s failed", method.__name__)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = ()
            self._publish()
            if self.llm.has_unfinished_requests():
                self._step()  # publishes before it delivers

    def _check_ranks(self, wait_s: float = 0.0) -> None:
        """Set tp.failure if a rank has exited (looking again until wait_s has passed)."""
        deadline = time.monotonic() + wait_s
        while self.llm.tp.failure is None:
            try:
                self.llm.tp.check_workers()
            except TensorParallelError as exc:
                logger.error("%s", exc)
                return
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def _publish(self) -> None:
        """The queue depth always (back-pressure reads it), the counters when due (module docstring)."""
        self.num_waiting = len(self.llm.scheduler.waiting)
        now = time.monotonic()
        if now - self._published_at >= SNAPSHOT_INTERVAL_S or not self.llm.has_unfinished_requests():
            self._published_at = now
            try:
                self.snapshot = collect_stats(self.llm, gather_ranks=False)
            except Exception:  # the scrape shows the previous counters; the loop must go on
                logger.exception("engine loop: collecting the engine's stats failed")

    def _step(self) -> None:
        try:
            outputs = self.llm.step()
        except Exception:
            self.failed_steps += 1
            logger.exception("engine step failed; aborting the %d requests in flight", len(self._streams))
            # A collective that failed on a dead rank: /health says so before any client hears of it.
            if self.llm.tp is not None:
                self._check_ranks(wait_s=RANK_EXIT_WAIT_S)
            self._abort_all("the engine failed a step (see the server log)")
            return
        batch = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted by its client: nobody listens
                continue
            if out.finished:
                del self._streams[out.request_id]
            elif not stream.every_step:
                # a whole response: the event loop wakes for its first token (choices 1..n-1 go out
                # then, TTFT is counted) and its end, not once per step (it shares the GIL with this
                # thread: at batch 64 every step's 64 outputs cost the loop more than the step itself)
                if stream.sent_first or not out.new_token_ids:
                    continue
                stream.sent_first = True
            batch.append((stream, out))
        self._publish()
        self._deliver(batch)

    def _add(self, prompt: Any, params: SamplingParams, stream: Stream, bounded: bool) -> None:
        self._num_added += 1
        try:
            self.llm.add_request(prompt, params, request_id=stream.request_id, bounded=bounded)
        except (InvalidRequestError, QueueFullError) as exc:
            self._deliver([(stream, exc)])
            return
        except Exception as exc:  # e.g. the tokenizer failed on this prompt
            logger.exception("request %s could not be added", stream.request_id)
            self._deliver([(stream, EngineUnavailable(f"the request could not be added: {exc}"))])
            return
        self._streams[stream.request_id] = stream
        self._deliver([(stream, ACCEPTED)])

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.llm.abort(request_id)

    def _abort_all(self, reason: str) -> None:
        streams, self._streams = self._streams, {}
        for request_id in streams:
            self.llm.abort(request_id)
        self._deliver([(s, EngineUnavailable(reason)) for s in streams.values()])

    def _deliver(self, batch: list[tuple[Stream, Any]]) -> None:
        deliver(batch)


def deliver(batch: list[tuple[Stream, Any]]) -> None:
    """Hand (stream, item) pairs to their streams' event loops, one callback per loop (any thread)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Stream, Any]]] = {}
    for stream, item in batch:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the event loop is closed: the server is gone
            pass


def _put_all(items: list[tuple[Stream, Any]]) -> None:
    for stream, item in items:
        stream.put(item)
