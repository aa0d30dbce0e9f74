"""The engine in a process of its own: the server's HTTP side and the engine's step loop stop sharing a GIL.

In one process (EngineLoop) the event loop and the step thread take turns at the GIL: at batch 64 each
step's 64 streamed chunks are ~1 ms of Python on the event loop, and a step whose GPU work is done
waits for it. Here (`serve --engine-process`, as vLLM's API server and engine core are split) the child
process builds the LLM and runs an EngineLoop in it; the parent runs the HTTP server and this
EngineProcess, which has EngineLoop's interface, so the app, Choices and the drain use either alike.

Over two pipes:
- parent -> child: commands (add, abort, stop accepting, shutdown, stop), sent by a sender thread from
  a SimpleQueue, so that a signal handler on the main thread can put one (as with EngineLoop);
- child -> parent: per step, the outputs as deltas (output_deltas.py: only the new entries of each
  request's lists cross, and the parent's mirror of those lists backs its RequestOutputs), and the
  counters EngineLoop publishes (queue depth, submissions processed, the stats snapshot, the
  tensor-parallel failure).

The child ignores SIGINT and SIGTERM (a Ctrl-C reaches the whole process group): the parent drains and
then stops it. A child that exits on its own is an engine failure (`failure`), which stops the server
as a dead tensor-parallel rank does; every request in flight ends with EngineUnavailable.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import threading
import time
from typing import Any, Callable

from engine.core.llm import LLM
from engine.core.tokenizer_load import PendingTokenizer
from engine.entrypoints.server.engine_loop import ACCEPTED, Admission, EngineLoop, EngineUnavailable, Stream, deliver
from engine.entrypoints.server.output_deltas import ChildStream, Mirror, encode_output
from engine.params import SamplingParams

logger = logging.getLogger("engine.server")

READY_TIMEOUT_S = 3600.0  # a cold GPU start-up compiles and captures for minutes
STOP_TIMEOUT_S = 30.0


# -- the child ------------------------------------------------------------------------------------

class _ChildLoop(EngineLoop):
    """EngineLoop whose deliveries and published counters go down a pipe instead of to an event loop."""

    def __init__(self, llm: Any, conn: Any) -> None:
        super().__init__(llm)
        self._conn = conn
        self._sent_state: tuple | None = None
        self._sent_snapshot: dict | None = None

    def _deliver(self, batch: list[tuple[Any, Any]]) -> None:  # engine thread
        # the counters first: a failure the outputs report (a dead rank) is the parent's before their errors
        self._send_state()
        items = []
        for stream, item in batch:
            if item is ACCEPTED:
                items.append((stream.request_id, "accepted", None))
            elif isinstance(item, BaseException):
                items.append((stream.request_id, "error", item))
            else:
                items.append((stream.request_id, "output", encode_output(stream, item)))
        self._send(("outputs", items))

    def _publish(self) -> None:  # engine thread
        published = self.snapshot
        super()._publish()
        if self.snapshot is not published:  # a new snapshot: this process's memory beside the engine's counters
            self.snapshot = {**self.snapshot, **_memory(self.llm.config.device)}
        self._send_state()

    def _send_state(self) -> None:
        """What EngineLoop publishes, when it changed since it was last sent."""
        state = (self.num_waiting, self._num_added, self.failure)
        if state != self._sent_state or self.snapshot is not self._sent_snapshot:  # a snapshot is never mutated
            self._sent_state, self._sent_snapshot = state, self.snapshot
            self._send(("state", (*state, self.snapshot)))

    def _send(self, message: tuple) -> None:
        try:
            self._conn.send(message)
        except (BrokenPipeError, EOFError, OSError):  # the parent is gone; stop() follows
            pass

    def command(self, message: tuple) -> None:
        """A command from the parent (the child's reader thread)."""
        kind, *args = message
        if kind == "add":
            prompt, params, request_id, every_step, bounded = args
            self._num_submitted += 1
            self._commands.put((self._add, (prompt, params, ChildStream(request_id, every_step), bounded)))
        elif kind == "abort":
            self.abort(*args)
        elif kind == "stop_accepting":
            self.stop_accepting()
        elif kind == "shutdown":
            self.shutdown()


def _memory(device: Any) -> dict[str, int]:
    """This process's resident memory (Linux /proc; 0 elsewhere) and, on CUDA, its allocator's bytes: the
    server's /metrics reads its own process, which holds neither the model nor a CUDA context."""
    try:
        with open("/proc/self/statm") as f:
            resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        resident = 0
    memory = {"engine_process_rss_bytes": resident}
    if str(device).startswith("cuda"):
        import torch
        memory.update(cuda_memory_allocated_bytes=torch.cuda.memory_allocated(device),
                      cuda_memory_reserved_bytes=torch.cuda.memory_reserved(device))
    return memory


def _logging_setup() -> tuple[int, str | None]:
    """The parent's root logger level and format: a spawned child starts with logging unconfigured, and the
    engine's start-up lines (phases, graphs, the KV pool) are what a user reads while it starts."""
    root = logging.getLogger()
    formatter = root.handlers[0].formatter if root.handlers else None
    return root.level, None if formatter is None else formatter._fmt


def tokenizer_fingerprint(tokenizer: Any) -> tuple[str, int] | None:
    """Enough of a tokenizer to tell that two processes loaded the same one from the same source."""
    return None if tokenizer is None else (type(tokenizer).__name__, len(tokenizer))


def _child_main(build: Callable[[], Any], commands: Any, outputs: Any, log_setup: tuple[int, str | None],
                send_tokenizer: bool = True) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent drains and stops this process
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    level, fmt = log_setup
    if fmt is None:
        logging.getLogger().setLevel(level)
    else:
        logging.basicConfig(level=level, format=fmt)
    try:
        llm = build()
    except BaseException as exc:  # the parent raises it: start-up errors read as in one process
        _send_or_log(outputs, ("failed", exc))
        return
    loop = _ChildLoop(llm, outputs)
    loop.snapshot = {**loop.snapshot, **_memory(llm.config.device)}
    # the parent loads its own copy where it knows the source (EngineProcess's tokenizer_source): pickling
    # a 262k-token tokenizer here and parsing it there costs ~3 s of serve's start-up on the CPU box
    tokenizer = llm.tokenizer if send_tokenizer else tokenizer_fingerprint(llm.tokenizer)
    if not _send_or_log(outputs, ("ready", (llm.config, tokenizer, loop.snapshot))):
        llm.close()  # its tensor-parallel ranks and front-end process with it
        return
    loop.start()
    while True:
        try:
            message = commands.recv()
        except (EOFError, OSError):  # the parent died: nothing will read the outputs
            message = None
        if message is None:
            break
        loop.command(message)
    loop.stop(STOP_TIMEOUT_S)
    if not loop.is_alive():
        llm.close()
    _send_or_log(outputs, ("stopped", None))


def _send_or_log(outputs: Any, message: tuple) -> bool:
    """Send to the server; False, and one log line instead of a traceback, where the server is gone (a
    SIGTERM before `ready` ends it at once: the child finds out when it has something to say)."""
    try:
        outputs.send(message)
        return True
    except (BrokenPipeError, ConnectionResetError, EOFError):
        logging.getLogger("engine.server").warning("engine process: the server is gone (its %r message was "
                                                   "not delivered); the engine process ends", message[0])
        return False


# -- the parent -----------------------------------------------------------------------------------

class EngineInfo:
    """What the app reads of the LLM in the parent: its configuration and tokenizer."""

    encode = LLM.encode  # reads only self.tokenizer

    def __init__(self, config: Any, tokenizer: Any) -> None:
        self.config, self.tokenizer = config, tokenizer


class EngineProcess(Admission):
    """EngineLoop's interface (engine_loop.py) over an engine built by `build()` in a child process.
    `build` must pickle (a module-level function, or functools.partial of one). Construction waits
    until the child's engine is ready and raises what its start-up raised (or what `meanwhile()`, run on
    a thread once the child is spawned, raised); whatever ends a start-up early stops the child.

    `tokenizer_source` (name, required), where the caller knows what the engine's tokenizer is loaded
    from (EngineConfig.tokenizer, or a model directory's own: engine.entrypoints.server.tokenizer_source):
    this process loads its copy on a thread while the child starts, instead of receiving the child's
    pickled. That copy, or the received one, is this process's alone: the engine detokenizes with its own."""

    def __init__(self, build: Callable[[], Any], ready_timeout_s: float = READY_TIMEOUT_S,
                 tokenizer_source: tuple[str, bool] | None = None, meanwhile: Callable[[], Any] | None = None) -> None:
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        self._commands_recv, commands_send = ctx.Pipe(duplex=False)
        outputs_recv, self._outputs_send = ctx.Pipe(duplex=False)
        # not a daemon: the engine starts processes of its own (tensor-parallel ranks, the text front end);
        # it exits when this process goes, as its command pipe then reads EOF
        self._proc = ctx.Process(target=_child_main, name="engine",
                                 args=(build, self._commands_recv, self._outputs_send, _logging_setup(),
                                       tokenizer_source is None))
        self._proc.start()
        self._commands_recv.close()
        self._outputs_send.close()
        self._conn_out, self._conn_in = commands_send, outputs_recv
        try:
            # the child's interpreter, imports and engine take seconds to minutes: what this process loads
            # (its tokenizer, the caller's `meanwhile`) overlaps them instead of following them. On threads:
            # the main thread imports nothing meanwhile, as a Ctrl-C inside an import can leave CPython's
            # import lock held (the signal lost, every other thread's import stuck for good)
            pending = PendingTokenizer(*tokenizer_source, background=True) if tokenizer_source else None
            loading = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="server-start-up")
            meanwhile_done = loading.submit(meanwhile or (lambda: None))
            loading.shutdown(wait=False)
            kind, payload = self._receive_ready(ready_timeout_s)
            if kind == "failed":
                raise payload
            meanwhile_done.result()
            config, tokenizer, snapshot = payload
            if pending is not None:
                tokenizer = self._own_tokenizer(pending, tokenizer)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                logger.warning("interrupted: stopping the engine process once it has started (a 2nd Ctrl-C kills it)")
            self._abandon()
            raise
        super().__init__(config.max_waiting_requests)
        self.llm = EngineInfo(config, tokenizer)
        self.snapshot: dict[str, Any] = snapshot
        self._child_failure: str | None = None
        self._exited: str | None = None  # why the child is gone, when it went without being stopped
        self._streams: dict[str, tuple[Stream, Mirror]] = {}
        self._send_queue: queue.SimpleQueue = queue.SimpleQueue()  # put() is safe from a signal handler
        self._sender = threading.Thread(target=self._send_commands, name="engine-commands", daemon=True)
        self._reader = threading.Thread(target=self._read_outputs, name="engine-outputs", daemon=True)
        self._stopping = False
        self._join_lock = threading.Lock()

    @staticmethod
    def _own_tokenizer(pending: PendingTokenizer, child_fingerprint: Any) -> Any:
        """This process's copy, checked against the child's."""
        tokenizer = pending.result()
        if tokenizer_fingerprint(tokenizer) != child_fingerprint:
            raise RuntimeError(f"the server loaded tokenizer {tokenizer_fingerprint(tokenizer)} from "
                               f"{pending.name!r}, but the engine process holds {child_fingerprint}")
        return tokenizer

    def _abandon(self) -> None:
        """A start-up this process gives up on (the child's failed, the tokenizers differ, an interrupt): the
        child closes its engine and exits once it has started, or is killed; it never outlives the server."""
        try:
            self._conn_out.send(None)
        except OSError:  # it is gone already
            pass
        try:
            self._proc.join(STOP_TIMEOUT_S)
        finally:
            if self._proc.exitcode is None:
                self._proc.kill()
                self._proc.join()

    def _receive_ready(self, timeout_s: float) -> tuple[str, Any]:
        deadline = time.monotonic() + timeout_s
        while not self._conn_in.poll(1.0):
            if not self._proc.is_alive():
                raise RuntimeError(f"the engine process exited with code {self._proc.exitcode} during start-up "
                                   "(see its log above)")
            if time.monotonic() > deadline:
                self._proc.kill()
                raise RuntimeError(f"the engine process was not ready after {timeout_s:.0f} s")
        return self._conn_in.recv()

    # -- EngineLoop's interface (event loop thread, and signal handlers where EngineLoop allows) -------

    def start(self) -> None:
        self._sender.start()
        self._reader.start()

    def is_alive(self) -> bool:
        # the sentinel, not Process.is_alive: that reaps the child (waitpid), racing the thread that joins it
        return self._reader.is_alive() and not multiprocessing.connection.wait([self._proc.sentinel], 0)

    @property
    def failure(self) -> str | None:
        return self._child_failure or self._exited

    def submit(self, prompt: Any, params: SamplingParams, request_id: str, into: Any,
               index: int = 0, every_step: bool = True) -> Stream:
        stream = Stream(request_id, asyncio.get_running_loop(), into, index, every_step)
        if self._stopped or not self.is_alive() or self.failure is not None:
            stream.put(EngineUnavailable("the server is shutting down" if self._stopped
                                         else "the engine process is not running"))
            return stream
        self._streams[request_id] = (stream, Mirror())
        self._num_submitted += 1
        self._send_queue.put(("add", prompt, params, request_id, every_step, index == 0))
        return stream

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._send_queue.put(("abort", request_id))

    def stop_accepting(self) -> None:
        self.accepting = False
        self._send_queue.put(("stop_accepting",))

    def shutdown(self) -> None:
        self.accepting = False
        self._stopped = True
        self._send_queue.put(("shutdown",))

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Abort what runs, stop the child's loop, let it close its engine, and wait for it to exit
        (idempotent)."""
        if self._stopping:
            return
        self._stopping = True
        self.shutdown()
        self._send_queue.put(None)
        if not self._join(timeout_s):
            logger.error("the engine process did not stop within %.0f s; killing it", timeout_s)
            self._proc.kill()
            self._join(5)
        self._reader.join(5)

    def _join(self, timeout_s: float) -> bool:
        """Wait for the child to exit; whether it did. Only here, one thread at a time: two waitpid calls
        on one child race, and the loser reads a process that is gone as alive."""
        with self._join_lock:
            self._proc.join(timeout_s)
            return self._proc.exitcode is not None

    # -- the parent's threads ---------------------------------------------------------------------

    def _send_commands(self) -> None:
        while True:
            message = self._send_queue.get()
            try:
                self._conn_out.send(message)
            except (BrokenPipeError, OSError):  # the child is gone: the reader reports it
                return
            if message is None:
                return

    def _read_outputs(self) -> None:
        while True:
            try:
                kind, payload = self._conn_in.recv()
            except (EOFError, OSError):
                break
            if kind == "outputs":
                self._dispatch(payload)
            elif kind == "state":
                self.num_waiting, self._num_added, self._child_failure, self.snapshot = payload
            elif kind == "stopped":
                break
        if not self._stopping:
            self._join(5)
            self._exited = f"the engine process exited unexpectedly (exit code {self._proc.exitcode})"
            logger.error("%s", self._exited)
        # whoever still waits for outputs will get none
        streams, self._streams = self._streams, {}
        deliver([(stream, EngineUnavailable(self._exited or "the server is shutting down"))
                              for stream, _ in streams.values()])

    def _dispatch(self, items: list[tuple[str, str, Any]]) -> None:
        batch = []
        for request_id, kind, payload in items:
            entry = self._streams.get(request_id)
            if entry is None:  # aborted by its client: nobody listens
                continue
            stream, mirror = entry
            if kind == "accepted":
                batch.append((stream, ACCEPTED))
            elif kind == "error":
                self._streams.pop(request_id, None)
                batch.append((stream, payload))
            else:
                out = mirror.output(payload)
                if out.finished:
                    self._streams.pop(request_id, None)
                batch.append((stream, out))
        deliver(batch)
