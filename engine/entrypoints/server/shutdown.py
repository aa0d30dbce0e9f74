"""Shutdown: SIGINT and SIGTERM drain the server; a second signal ends it at once.

The first signal starts a drain: new API requests get 503 and /health 503 (a load balancer stops
sending), and every request in flight runs on (an admitted request's choices 1..n-1 still start)
for up to `shutdown_timeout_s`. Then whatever still runs is aborted: its stream ends with an error
event, a non-streamed request gets a 503. uvicorn stops, serve_llm closes the engine, logs "server
stopped" and returns 0.

A second signal ends the drain now: every request is aborted, its handler gets up to FORCED_GRACE_S
to send the error event, uvicorn does not wait for connections, and serve_llm returns 1; its
clean-up still runs (closing the engine is what stops tensor-parallel ranks). A signal during that
clean-up exits the process there and then.

An engine that can serve nothing more (a tensor-parallel rank died: EngineLoop.failure) stops the
server the same way, without a drain (its requests were already aborted with the step that failed):
/health is 503 from the failure on, and serve_llm returns 1.

uvicorn's own signal handlers are never installed (capture_signals is a no-op): once stopped,
uvicorn re-raises the signal it caught, which ended SIGTERM with -15 and turned SIGINT into a
KeyboardInterrupt before the engine was closed. The handlers here stay installed until serve_llm's
clean-up is over. A handler runs on the main thread between two bytecodes of the event loop, so it
only sets flags and puts on the engine loop's command queue (safe there); the drain is watched from
uvicorn's tick, every 0.1 s.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from typing import Iterator

import uvicorn

from engine.entrypoints.server.engine_loop import EngineLoop
from engine.entrypoints.server.guard import Guard

logger = logging.getLogger("engine.server")

# After a drain's timeout aborts what still runs: how long the handlers get to send their error
# events before uvicorn stops anyway (an abort reaches a handler within one engine step).
ABORT_GRACE_S = 5.0
FORCED_GRACE_S = 1.0  # the same after a second signal, which asked for an exit now
SIGNALS = (signal.SIGINT, signal.SIGTERM)
TICK_S = 0.1  # uvicorn.Server.main_loop's sleep between two on_tick calls


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: EngineLoop, guard: Guard, shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self.engine, self.guard = engine, guard
        self.shutdown_timeout_s = shutdown_timeout_s
        self.signal_name: str | None = None  # the first signal's, once one came
        self.forced = False                  # a second signal came
        self.cleaning_up = False             # uvicorn has stopped; serve_llm is closing the engine
        self.failed = False                  # the engine failed for good (EngineLoop.failure)
        self._failed_at = 0.0
        self._drain_start: float | None = None
        self._forced_at = 0.0
        self._aborted_at: float | None = None
        self._metrics = getattr(getattr(guard.app, "state", None), "metrics", None)
        self._last_tick: float | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # handled by `signals_handled`, for longer than uvicorn runs

    @contextlib.contextmanager
    def signals_handled(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: object) -> None:
        if self.cleaning_up:
            os.write(2, f"{signal.Signals(sig).name} during clean-up: exiting now\n".encode())
            os._exit(1)
        if self.signal_name is None:
            self.signal_name = signal.Signals(sig).name
            self.engine.stop_accepting()
        elif not self.forced:
            self.forced, self._forced_at = True, time.monotonic()
            self.engine.shutdown()

    async def on_tick(self, counter: int) -> bool:
        await super().on_tick(counter)
        now, in_flight = time.monotonic(), self.guard.in_flight
        if self._last_tick is not None and self._metrics is not None:  # uvicorn ticks every TICK_S
            self._metrics.loop_lag.observe(max(0.0, now - self._last_tick - TICK_S))
        self._last_tick = now
        if not self.failed and self.engine.failure is not None:
            self.failed, self._failed_at = True, now
            logger.error("stopping: the engine cannot serve any more: %s", self.engine.failure.splitlines()[0])
            self.engine.shutdown()
        if self.failed:
            return in_flight == 0 or now - self._failed_at >= ABORT_GRACE_S
        if self.signal_name is None:
            return False
        if self.forced:
            self.force_exit = in_flight == 0 or now - self._forced_at >= FORCED_GRACE_S
            return self.force_exit
        if self._drain_start is None:
            self._drain_start = now
            logger.info("%s: draining %d requests in flight for up to %.3g s (--shutdown-timeout); new requests "
                        "get 503; a second signal stops now", self.signal_name, in_flight, self.shutdown_timeout_s)
        if in_flight == 0:
            if self._aborted_at is None:
                logger.info("drained in %.2f s", now - self._drain_start)
            return True
        if self._aborted_at is None and now - self._drain_start >= self.shutdown_timeout_s:
            logger.warning("drain timed out after %.3g s: aborting the %d requests still in flight",
                           self.shutdown_timeout_s, in_flight)
            self.engine.shutdown()
            self._aborted_at = now
        return self._aborted_at is not None and now - self._aborted_at >= ABORT_GRACE_S
