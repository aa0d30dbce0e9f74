"""The `n` choices of one API request: n engine requests for one prompt, read as one stream.

A module of its own because the fan-out (n engine requests, each with its seed), the fan-in (their
outputs on one queue, tagged with the choice's index) and the all-or-nothing abort are one idea that
both routes and both response modes share; app.py stays the HTTP layer.

Choice i is the engine request `<request id>-<i>`. With a seed it samples with seed + i, so the n
samples differ and the response is reproducible; without one, the engine's shared generator draws
different samples by itself; greedy gives n equal choices, as OpenAI does.

Choice 0 goes first and the other n - 1 once it has its first token: its prefill is then done and the
prompt's full blocks are in the prefix cache (a block is published after the step that computed it),
so the others prefill only what follows the last full block and share the rest. Submitted together,
all n would prefill the whole prompt in one step, none of its blocks computed yet to share. (Without
a prefix cache the wait only costs choices 1..n-1 a step of latency; one path serves both.)

A choice's outputs that wait on the queue together are read as one (engine.outputs.merged): when the
event loop falls behind the engine (the server under load), a stream sends one chunk for the steps it
missed instead of one per step, so the loop's work follows how often it runs, not the token rate
(vLLM's output collector does the same). A consumer that keeps up still reads one output per step.

All or nothing: the error that refuses choice 0 refuses the call (an InvalidRequestError is the same
400 as with n=1; the choices differ only in their seeds, which the protocol checked); any error after
that (the client gone, the server shutting down, a failed step) ends the call, and `abort` aborts
every choice submitted, so every choice's blocks go back. A choice never submitted is never started:
`abort` before the others go out keeps them from going out.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
from typing import Any

from engine.entrypoints.server.engine_loop import ACCEPTED, EngineLoop
from engine.outputs import RequestOutput, merged
from engine.params import SamplingParams


class Inbox:
    """The part of asyncio.Queue a request's outputs need (put_nowait, get, empty, get_nowait), for one
    reader: a deque and the reader's future. A stream puts and gets once a request and step, and
    asyncio.Queue's bookkeeping (its getter and putter deques, the full / maxsize checks) cost the event
    loop ~6% of its own work per streamed chunk (9.5 -> 8.9 us, bench/results/cpu-2026-12-07/sse-chunk/).
    Event loop thread only."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> Any:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self) -> Any:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()


class Choices:
    """Async-iterate for (choice index, RequestOutput) until every choice has finished; an error of any
    choice is raised from the iteration."""

    def __init__(self, engine: EngineLoop, prompt: Any, params: SamplingParams, request_id: str, n: int,
                 every_step: bool = True) -> None:
        """`every_step` False: the caller reads only each choice's first output with a token and its
        final one (a response sent whole; EngineLoop.submit)."""
        self.engine, self.prompt, self.params, self.n = engine, prompt, params, n
        self.every_step = every_step
        self.request_ids = [f"{request_id}-{i}" for i in range(n)]
        self.queue = Inbox()
        self.num_submitted = 0
        self.num_unfinished = n
        self.finished = [False] * n
        self.closed = False
        self._ready: collections.deque = collections.deque()  # (index, item) taken off the queue, in order
        self._submit(0)

    def _submit(self, index: int) -> None:
        params = self.params
        if params.seed is not None:
            params = dataclasses.replace(params, seed=params.seed + index)
        self.engine.submit(self.prompt, params, self.request_ids[index], self.queue, index, self.every_step)
        self.num_submitted += 1

    async def accepted(self) -> None:
        """Wait until the engine accepts choice 0; raises the InvalidRequestError that refused it, or
        EngineUnavailable."""
        index, item = await self.queue.get()
        if isinstance(item, Exception):
            raise item
        if (index, item) != (0, ACCEPTED):
            raise RuntimeError(f"request {self.request_ids[0]!r}: expected its acceptance, got {item!r}")

    def __aiter__(self) -> Choices:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        while self.num_unfinished:
            if not self._ready:
                self._ready.append(await self.queue.get())
                while not self.queue.empty():  # whatever else is here already: merged below
                    self._ready.append(self.queue.get_nowait())
            index, item = self._ready.popleft()
            if isinstance(item, Exception):
                raise item
            if item is ACCEPTED:  # choices 1..n-1 (choice 0's was read by `accepted`)
                continue
            item = self._merge_waiting(index, item)
            if self.num_submitted < self.n and not self.closed:  # choice 0's first token: its prompt is cached
                for i in range(1, self.n):
                    self._submit(i)
            if item.finished:
                self.finished[index] = True
                self.num_unfinished -= 1
            return index, item
        raise StopAsyncIteration

    def _merge_waiting(self, index: int, item: RequestOutput) -> RequestOutput:
        """`item` with the outputs of its choice that wait behind it merged in, up to its last one or the
        first error of any choice (which must still be raised after what came before it)."""
        rest = collections.deque()
        while self._ready and not item.finished:
            other_index, other = self._ready.popleft()
            if isinstance(other, Exception):
                rest.append((other_index, other))
                break
            if other_index == index and isinstance(other, RequestOutput):
                item = merged(item, other)
            else:
                rest.append((other_index, other))
        rest.extend(self._ready)
        self._ready = rest
        return item

    def abort(self) -> None:
        """Abort every choice submitted and submit no more (idempotent; a finished choice is left alone)."""
        self.closed = True
        for request_id, finished in zip(self.request_ids[:self.num_submitted], self.finished):
            if not finished:
                self.engine.abort(request_id)

    def fail(self, exc: Exception) -> None:
        """Abort, and end the iteration with `exc` (the client went away)."""
        self.abort()
        self.queue.put_nowait((None, exc))
