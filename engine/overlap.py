"""OverlapLoop: the step loop with the host one step ahead of the device (async scheduling).

One call of `step()` schedules and launches step N, then reads back step N-1. While the device runs
step N the host returns step N-1's outputs and schedules, stages and launches step N+1, so the device
never waits for Python between two steps. The synchronous loop (LLM._step with
EngineConfig.async_scheduling=False) gives the same greedy and seeded tokens; it is kept for
debugging and as the reference the tests compare against.

Invariants:
- Every sampled token stays on the device: the step that samples it scatters it into its request's
  slot of `TokenSlots.tokens` (one slot per request, held until it finishes; not a ring, which
  wraps onto live requests under load). A step's input id at the position of a token not read
  back yet is gathered from that slot on the device, after the static buffers are loaded and
  before the forward (a decode graph reads the static input_ids buffer).
- Between calls, `request.token_ids` holds only tokens the host has read, exactly as after a
  synchronous step (outputs, stop strings, abort and the prefix cache see nothing else), while
  `num_computed_tokens` already counts the in-flight step. Inside a call the in-flight token is a
  PLACEHOLDER appended at its position, so `num_tokens` counts it and the scheduler plans the next
  chunk as usual; only trailing positions are ever placeholders (steps resolve in order).
- A step advances `num_computed_tokens` and appends its placeholders when it is launched. A
  request whose new token reaches max_tokens or max_model_len leaves the running list then, so it
  is never scheduled past its length (that limit never lags). EOS and stop tokens are known only
  when the token is read, one step late: the request finishes then, its blocks are freed, and the
  token its extra in-flight step samples is discarded, never emitted. Freeing blocks while a step
  that writes them is in flight is safe: all device work is ordered on one stream, so whoever gets
  the blocks next writes them in a later step. The same holds for the sliding-window blocks the
  scheduler gives back when it plans step N+1 (engine.kv_groups): step N may still read them.
- A preempted request keeps its in-flight token (that step ran on its blocks before they were
  freed); if it is readmitted before the token is read, the gather fills its prefill input.
- A step's index lists (the input ids it gathers, the slots its tokens go to) reach the device in
  the runner's one staging copy of the step; its read-back buffer and sampled tokens live in its
  `_InFlight` record until it is resolved. Host lists reach the device through pinned memory with
  non_blocking copies, and the sampler does the same, so launching a step never blocks the host on
  the device.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.model_runner import DeviceIds
from engine.request import FinishReason, Request
from engine.scheduler import Scheduler, SchedulerOutput

if TYPE_CHECKING:
    from engine.runtime import Runtime

PLACEHOLDER = -1  # an in-flight token on the host, inside a call; out of vocabulary: a missed gather fails loudly


class ReadBack:
    """Device-to-host copies of each step's sampled tokens (and log-probabilities), on their own stream.

    Their own stream: a device-to-host copy on the compute stream holds it up, so the next step's first
    kernels waited ~9.6 us behind an 8-byte copy on an H100 (measured between graph replays); on a side
    stream the step took +0.1 us. The tokens land in pinned buffers allocated once (a fresh pinned block
    per step costs the host tens of us, and the host is the bottleneck at large batches): a step's
    buffer is written again DEPTH steps later, after `OverlapLoop._resolve` has waited for its event and
    read it. The device tensors must stay alive until the event completes (the caller keeps them: their
    blocks could otherwise be reused on the compute stream while the copy still reads them)."""

    DEPTH = 3  # buffers in turn: one step launched, one in flight, one being read

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self._tokens = [torch.empty(capacity, dtype=torch.int64, pin_memory=True) for _ in range(self.DEPTH)]
        self._turn = 0

    def copy(self, tokens: torch.Tensor, logprobs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                               torch.cuda.Event]:
        """(host tokens, host log-probabilities or None, the event after both copies), queued behind the
        work queued so far on the current stream."""
        buffer = self._tokens[self._turn]
        self._turn = (self._turn + 1) % self.DEPTH
        if tokens.dtype != torch.int64 or tokens.numel() > buffer.numel():
            raise ValueError(f"ReadBack: {tokens.numel()} {tokens.dtype} tokens; it holds {buffer.numel()} int64")
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            host_tokens = buffer[:tokens.numel()].copy_(tokens, non_blocking=True)
            host_logprobs = None
            if logprobs is not None:  # rare, and of varying shape: torch's pinned blocks
                host_logprobs = torch.empty(logprobs.shape, dtype=logprobs.dtype, pin_memory=True)
                host_logprobs.copy_(logprobs, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return host_tokens, host_logprobs, ready


class TokenSlots:
    """One device token per request: where a sampled token waits to become the next step's input."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.tokens = torch.zeros(max(capacity, 1), dtype=torch.int64, device=device)
        self._free = list(range(self.tokens.numel() - 1, -1, -1))
        self._slots: dict[Request, int] = {}

    def slot(self, request: Request) -> int:
        """The request's slot, assigned on first use."""
        slot = self._slots.get(request)
        if slot is None:
            if not self._free:
                self._grow()
            slot = self._slots[request] = self._free.pop()
        return slot

    def release(self, request: Request) -> None:
        """Give the slot back (idempotent). A step still in flight may write it once more; the next
        owner writes it in a later step before it ever reads it."""
        slot = self._slots.pop(request, None)
        if slot is not None:
            self._free.append(slot)

    def _grow(self) -> None:
        # Preempted requests keep their slots while they wait, so the running limit does not bound
        # the count. The copy is queued after every write to the old buffer already launched.
        old = self.tokens
        n = old.numel()
        self.tokens = torch.zeros(2 * n, dtype=old.dtype, device=old.device)
        self.tokens[:n].copy_(old)
        self._free.extend(range(2 * n - 1, n - 1, -1))


@dataclass
class _InFlight:
    """A launched step whose tokens the host has not read yet."""
    sampling: list[Request]            # requests that sample, in chunk order (= token rows)
    positions: list[int]               # each one's placeholder index in its token_ids
    host_tokens: torch.Tensor | None   # the tokens' read-back buffer (pinned on CUDA)
    ready: torch.cuda.Event | None     # recorded after the read-back copy (CUDA only)
    keep_alive: list[torch.Tensor] = field(default_factory=list)  # device tensors the step reads
    logprob_rows: list[int] = field(default_factory=list)  # rows of `sampling` that asked for logprobs
    host_logprobs: torch.Tensor | None = None  # their Sampler.logprobs tensor's read-back buffer


class OverlapLoop:
    def __init__(self, scheduler: Scheduler, runtime: Runtime) -> None:
        self.scheduler = scheduler
        self.runtime = runtime
        self.device = runtime.runner.device
        self.slots = TokenSlots(2 * scheduler.max_num_seqs, self.device)
        self._read_back = ReadBack(scheduler.max_num_seqs, self.device) if self.device.type == "cuda" else None
        self._pending: dict[Request, int] = {}  # request -> position of its newest in-flight token
        self._inflight: _InFlight | None = None
        self.num_overlapped_steps = 0  # launched while the previous step was still in flight
        self.num_drains = 0            # the host had to read the in-flight step before scheduling more
        self.num_discarded_tokens = 0  # sampled after their request had finished

    def has_pending(self) -> bool:
        """True while a live request has a token in flight (it may have left the running list)."""
        return any(not r.is_finished for r in self._pending)

    def step(self) -> tuple[bool, list[Request]]:
        """(whether a step was launched, the requests whose token was read: the previous step's)."""
        self._show_inflight()
        try:
            return self._step()
        finally:
            self._hide_inflight()

    def drain(self) -> list[Request]:
        """Read the in-flight step now, if any, and wait for the device (before the engine frees what
        that step runs on: a step with no sampling row has no read-back to wait for)."""
        previous, self._inflight = self._inflight, None
        self._show_inflight()
        try:
            resolved = self._resolve(previous) if previous is not None else []
        finally:
            self._hide_inflight()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return resolved

    def finished(self, request: Request) -> None:
        """A request the engine finished between steps (an abort, a stop string): its slot goes back
        now, unless a step still in flight samples for it (then reading that step releases it)."""
        if request not in self._pending:
            self.forget(request)

    def forget(self, request: Request) -> None:
        """Drop a finished request's in-flight token and slot (idempotent)."""
        while request.token_ids and request.token_ids[-1] == PLACEHOLDER:
            request.token_ids.pop()
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
        self._pending.pop(request, None)
        self.slots.release(request)

    def _show_inflight(self) -> None:
        for request, position in self._pending.items():
            if request.is_finished:  # aborted or stopped between calls: its token will be discarded
                continue
            if position != request.num_tokens:
                raise RuntimeError(f"request {request.request_id!r}: its in-flight token is at position {position} "
                                   f"but it has {request.num_tokens} tokens (token_ids changed between steps)")
            request.token_ids.append(PLACEHOLDER)

    def _hide_inflight(self) -> None:
        for request in self._pending:
            while request.token_ids and request.token_ids[-1] == PLACEHOLDER:
                request.token_ids.pop()

    def _step(self) -> tuple[bool, list[Request]]:
        out = self.scheduler.schedule()
        previous, self._inflight = self._inflight, None
        if out.is_empty:
            if previous is None:
                if self.scheduler.has_unfinished():
                    raise RuntimeError("scheduler made no progress with requests pending (KV pool too small?)")
                return False, []
            # Nothing to launch without the in-flight tokens (every request at its end, or the
            # blocks and sequence slots that finishing requests hold): the device idles meanwhile.
            self.num_drains += 1
            return False, self._resolve(previous)
        try:
            self._inflight = self._launch(out)
        except BaseException:
            # Nothing of `out` was advanced: the scheduler plans it again, and the step still in
            # flight keeps its tokens.
            self._inflight = previous
            raise
        if previous is None:
            self._publish(out)
            return True, []
        self.num_overlapped_steps += 1
        resolved = self._resolve(previous)
        self._publish(out)
        return True, resolved

    def _publish(self, out: SchedulerOutput) -> None:
        """Publish the blocks `out` fills to the prefix cache, as Scheduler.update does synchronously.

        Every token below num_computed_tokens is known on the host by now (the in-flight token `out`
        computes was resolved just before), and a request that hits these blocks runs in a later
        step on the same stream, after `out` has written their K/V."""
        for chunk in out.chunks:
            if not chunk.request.is_finished:
                self.scheduler.publish_filled(chunk)

    # -- one step ------------------------------------------------------------------------------

    def _launch(self, out: SchedulerOutput) -> _InFlight:
        runtime = self.runtime
        gather_rows: list[int] = []
        gather_slots: list[int] = []
        row = 0
        for chunk in out.chunks:  # rows in the order ModelRunner flattens the chunks
            position = self._pending.get(chunk.request)
            if position is not None and chunk.start <= position < chunk.start + chunk.num_tokens:
                gather_rows.append(row + position - chunk.start)
                gather_slots.append(self.slots.slot(chunk.request))
            row += chunk.num_tokens
        sampling = [c.request for c in out.chunks if c.samples]
        sample_slots = [self.slots.slot(r) for r in sampling]
        slot_tokens = self.slots.tokens  # after any growth above
        # The input ids of the gathered rows are written with the step's upload (on CUDA one kernel that
        # also copies the staged values: each kernel between two replays costs the step ~3-4 us), and
        # the sampled tokens' slots ride in the same copy, into the runner's fixed `step_indices`
        # buffer, which holds them until the next step is loaded, after this step's scatter below has
        # read them (one stream).
        sample_t = runtime.runner.buffers.step_indices[:len(sample_slots)]
        result = runtime.runner.execute(out, runtime.block_pool, DeviceIds(slot_tokens, gather_rows, gather_slots),
                                        sample_slots)
        host_tokens, ready, logprob_rows, host_logprobs = None, None, [], None
        keep: list[torch.Tensor] = []
        if sampling:
            # into their slots for the next step's inputs, by the sampler's own launch where it can
            tokens = runtime.sampler.sample(result.logits, sampling, result.argmax_keys, (slot_tokens, sample_t))
            keep.append(tokens)
            logprobs = runtime.sampler.logprobs(result.logits, tokens, sampling)
            if logprobs is not None:
                logprob_rows, host_logprobs = logprobs
            if tokens.is_cuda:
                if host_logprobs is not None:
                    keep.append(host_logprobs)  # read by the copy on the read-back stream
                host_tokens, host_logprobs, ready = self._read_back.copy(tokens, host_logprobs)
            else:
                host_tokens = tokens
        positions = self._advance(out)
        return _InFlight(sampling, positions, host_tokens, ready, keep, logprob_rows, host_logprobs)

    def _advance(self, out: SchedulerOutput) -> list[int]:
        """What the synchronous loop's Scheduler.update does at once, minus the token values."""
        positions = []
        max_model_len = self.scheduler.max_model_len
        for chunk in out.chunks:
            request = chunk.request
            request.num_computed_tokens += chunk.num_tokens
            if not chunk.samples:
                continue  # a partial prefill chunk emits no token
            positions.append(request.num_tokens)
            self._pending[request] = request.num_tokens
            request.token_ids.append(PLACEHOLDER)
            at_length = (request.num_tokens - request.num_prompt_tokens >= request.params.max_tokens
                         or request.num_tokens >= max_model_len)
            if at_length and request in self.scheduler.running:
                self.scheduler.running.remove(request)  # never scheduled past its length; finished when read
        return positions

    def _resolve(self, step: _InFlight) -> list[Request]:
        """Read the step's tokens; fill placeholders, finish requests; the requests that got a token."""
        if not step.sampling:
            return []
        if step.ready is not None:
            step.ready.synchronize()
        tokens = step.host_tokens.tolist()
        logprobs = {}
        if step.logprob_rows:
            logprobs = dict(self.runtime.sampler.unpack(step.logprob_rows, step.host_logprobs.tolist(), tokens,
                                                        step.sampling))
        now = time.perf_counter()
        resolved = []
        for row, (request, position, token) in enumerate(zip(step.sampling, step.positions, tokens)):
            if self._pending.get(request) == position:
                del self._pending[request]
            if request.is_finished:  # finished a step earlier (or aborted): sampled past its end
                self.num_discarded_tokens += 1
                self.forget(request)
                continue
            request.token_ids[position] = token
            request.token_times.append(now)
            if row in logprobs:
                request.logprobs.append(logprobs[row])
            reason: FinishReason | None = self.scheduler._finish_reason(request, token, position + 1)
            if reason is not None:
                self.forget(request)  # the token its extra in-flight step samples is never emitted
                self.scheduler.finish(request, reason)
            resolved.append(request)
        return resolved
