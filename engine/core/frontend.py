"""FrontEnd: detokenization and stop strings, off the step thread when the host runs ahead.

After every step the step thread hands the front end one record: each request that got tokens, with a
`Snapshot` of it (its token count and its end, as the step left them). With the overlapped loop and a
tokenizer, a thread of the front end's own takes the records in order and advances each request's
text (one batched decode a step, engine.core.detokenizer.update_all), so the step thread goes on to
schedule and launch the next step meanwhile; the Rust decode runs without the GIL. With the
synchronous loop (depth 0, for debugging) or no tokenizer, the same update runs inline.

Invariants:
- The front end reads a request's token list only up to its snapshot (the list only grows) and owns
  the OutputTrackers' text state; the step thread reads a tracker only after `flush()`, when every
  record handed over so far has been applied.
- A stop string found by the thread is a request for the step thread to finish that request: it is
  queued and applied by `take_stopped()` before the next step is scheduled (so a step or two later).
  The tokens sampled meanwhile are never reported: the tracker's output stops at the token whose text
  completed the stop string, with finish_reason "stop", exactly as when the match ends the request at
  once.
- A failure in the thread (a tokenizer error) is raised on the step thread at the next hand-over or
  flush, never swallowed.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable

from engine.core.detokenizer import OutputTracker, Snapshot, update_all
from engine.request import Request

Update = tuple[OutputTracker, Request, Snapshot]


class FrontEnd:
    def __init__(self, threaded: bool) -> None:
        self.threaded = threaded
        self._records: queue.SimpleQueue[list[Update] | None] = queue.SimpleQueue()
        self._stopped: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._done = threading.Condition()
        self._handed = 0   # records handed to the thread
        self._applied = 0  # ... and applied by it (under _done)
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name="engine-frontend", daemon=True)
            self._thread.start()

    def hand_over(self, updates: list[Update]) -> list[Request]:
        """Advance these requests' texts. Inline: the requests whose stop string matched, now. On the
        thread: [] (its matches come out of `take_stopped`)."""
        self._raise_failure()
        if not updates:
            return []
        if not self.threaded:
            return update_all(updates)
        self._handed += 1
        self._records.put(updates)
        return []

    def flush(self) -> None:
        """Wait until every record handed over so far has been applied."""
        if self.threaded:
            with self._done:
                self._done.wait_for(lambda: self._applied == self._handed or self._failure is not None)
        self._raise_failure()

    def take_stopped(self) -> list[Request]:
        """The requests whose stop string the thread found since the last call."""
        stopped = []
        while True:
            try:
                stopped.append(self._stopped.get_nowait())
            except queue.Empty:
                return stopped

    def close(self) -> None:
        if self._thread is not None:
            self._records.put(None)
            self._thread.join(timeout=10)
            self._thread = None

    def _run(self) -> None:
        while (updates := self._records.get()) is not None:
            try:
                for request in update_all(updates):
                    self._stopped.put(request)
            except BaseException as exc:  # the step thread raises it; this thread keeps no state worth going on with
                self._failure = exc
            with self._done:
                self._applied += 1
                self._done.notify_all()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise RuntimeError("the engine's front end (detokenization / stop strings) failed") from failure


def snapshot_updates(requests: list[Request], trackers: Callable[[str], OutputTracker]) -> list[Update]:
    """One record: each request's tracker and its state now."""
    return [(trackers(r.request_id), r, Snapshot.of(r)) for r in requests]
