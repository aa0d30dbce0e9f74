"""StepLoop: the engine's one step loop: schedule, launch, resolve, at depth 0 or 1.

One call of `step()` schedules and launches a step, then reads back ("resolves") a step's sampled
tokens: at depth 1 (async scheduling, the default) the PREVIOUS step's, so while the device runs
step N the host reads step N-1, returns its outputs and schedules, stages and launches N+1, and the
device never waits for Python between two steps; at depth 0 the step it just launched (the host
waits for the device every step; for debugging, and the reference the tests compare against). The
two depths share every line but which step is resolved: one schedule, one launch, one post-step
update (Scheduler.advance at launch, Scheduler.resolve_token at read, Scheduler.publish_filled
between), so a per-token feature is written once.

Invariants:
- Every sampled token stays on the device until read: the step that samples it scatters it into its
  request's slot of `TokenSlots.tokens` (one slot per request, held until it finishes; not a ring,
  which wraps onto live requests under load). A step's input id at a position whose token is still
  in flight is gathered from that slot on the device, in the step's upload and before the forward
  (a decode graph reads the static input_ids buffer).
- `request.token_ids` holds only tokens the host has read, and only grows; tokens in flight are a
  count (`Request.num_inflight_tokens`) that the scheduler plans with (`num_planned_tokens`), and
  they are read in launch order, so a resolved token is always appended at the end.
- A step advances `num_computed_tokens` and the in-flight counts when it is launched. A request
  whose in-flight token reaches max_tokens or max_model_len leaves the running list then, so it is
  never scheduled past its length (that limit never lags). EOS and stop tokens are known only when
  the token is read, one step late at depth 1: the scheduler finishes the request then, its blocks
  are freed, and the token its extra in-flight step samples is dropped, never emitted. Freeing
  blocks while a step that writes them is in flight is safe: all device work is ordered on one
  stream, so whoever gets the blocks next writes them in a later step. The same holds for the
  sliding-window blocks the scheduler gives back when it plans step N+1 (engine.kv.groups).
- A preempted request keeps its in-flight token (that step ran on its blocks before they were
  freed); if it is readmitted before the token is read, the gather fills its prefill input.
- Blocks a step fills are published to the prefix cache after the step before it is resolved (every
  token below `num_computed_tokens` is then known on the host) and before its own tokens are.
- A step's index lists (the input ids it gathers, the slots its tokens go to) reach the device in
  the runner's one staging copy of the step; its read-back buffer and sampled tokens live in its
  `_InFlight` record until it is resolved. Host lists reach the device through pinned memory with
  non_blocking copies, and the sampler does the same, so launching a step never blocks the host on
  the device.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from engine.core.scheduler import Scheduler
from engine.request import Request
from engine.sample.staging import host_to_device
from engine.spec.sampling import VerifyLayout, sample_verify
from engine.step import ScheduledChunk, SchedulerOutput
from engine.worker.input_buffers import DeviceIds

if TYPE_CHECKING:
    from engine.worker.startup import Runtime


class ReadBack:
    """Device-to-host copies of each step's sampled tokens (and log-probabilities), on their own stream.

    Their own stream: a device-to-host copy on the compute stream holds it up, so the next step's first
    kernels waited ~9.6 us behind an 8-byte copy on an H100 (measured between graph replays); on a side
    stream the step took +0.1 us. The tokens land in pinned buffers allocated once (a fresh pinned block
    per step costs the host tens of us, and the host is the bottleneck at large batches): a step's
    buffer is written again DEPTH steps later, after `StepLoop._resolve` has waited for its event and
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
    host_tokens: torch.Tensor | None   # the tokens' read-back buffer (pinned on CUDA)
    ready: torch.cuda.Event | None     # recorded after the read-back copy (CUDA only)
    keep_alive: list[torch.Tensor] = field(default_factory=list)  # device tensors the step reads
    logprob_rows: list[int] = field(default_factory=list)  # rows of `sampling` that asked for logprobs
    host_logprobs: torch.Tensor | None = None  # their Sampler.logprobs tensor's read-back buffer
    # A step that verifies proposals (engine.spec): its sampling chunks, whose tokens are `width` a
    # chunk (accepted proposals + one, then -1), and whose logprob rows are logits rows
    verify: list[ScheduledChunk] | None = None
    layout: VerifyLayout | None = None


class StepLoop:
    def __init__(self, scheduler: Scheduler, runtime: Runtime, depth: int = 1) -> None:
        if depth not in (0, 1):
            raise ValueError(f"StepLoop depth must be 0 (resolve each step at once) or 1 (one step later), got {depth}")
        self.scheduler = scheduler
        self.runtime = runtime
        self.depth = depth
        self.device = runtime.runner.device
        self.slots = TokenSlots(2 * scheduler.max_num_seqs, self.device)
        proposer = scheduler.proposer
        self.width = 1 + (proposer.config.num_speculative_tokens if proposer is not None else 0)
        self._read_back = (ReadBack(scheduler.max_num_seqs * self.width, self.device)
                           if self.device.type == "cuda" else None)
        self._inflight: _InFlight | None = None
        self.num_overlapped_steps = 0  # launched while the previous step was still in flight
        self.num_drains = 0            # the host had to read the in-flight step before scheduling more
        self.num_discarded_tokens = 0  # sampled after their request had finished
        self.num_spec_waits = 0        # the host read the in-flight step before scheduling, for proposals
        # how the host waits for a CUDA event: under tensor parallelism the leader's wait, which raises
        # when a rank dies instead of blocking on a collective that can no longer complete
        self.wait_for: Callable[[torch.cuda.Event], None] = torch.cuda.Event.synchronize
        self.num_tokens_read = 0       # tokens appended to requests (a verify chunk adds up to 1 + k)

    def has_inflight(self) -> bool:
        """True while a launched step samples for a live request (it may have left the running list)."""
        return self._inflight is not None and any(not r.is_finished for r in self._inflight.sampling)

    def step(self) -> tuple[bool, list[Request]]:
        """(whether a step was launched, the requests whose token was read, in chunk order)."""
        early: list[Request] = []
        if self._inflight is not None and (self._inflight.verify is not None or self.scheduler.wants_known_tokens()):
            # Proposals continue a request's tokens, and a verify step's token count is known only
            # once read: the step in flight is read before this one is planned (engine.spec.proposer's
            # back-off keeps this to the steps where speculation pays).
            previous, self._inflight = self._inflight, None
            early = self._resolve(previous)
            self.num_spec_waits += 1
        out = self.scheduler.schedule()
        previous, self._inflight = self._inflight, None
        if out.is_empty:
            if previous is None:
                if early:
                    return False, early
                if self.scheduler.has_unfinished():
                    raise RuntimeError("scheduler made no progress with requests pending (KV pool too small?)")
                return False, []
            # Nothing to launch without the in-flight tokens (every request at its end, or the
            # blocks and sequence slots that finishing requests hold): the device idles meanwhile.
            self.num_drains += 1
            return False, self._resolve(previous)
        try:
            launched = self._launch(out)
        except BaseException:
            # Nothing of `out` was advanced: the scheduler plans it again, and the step still in
            # flight keeps its tokens.
            self._inflight = previous
            raise
        resolved = early
        if previous is not None:
            self.num_overlapped_steps += 1
            resolved = self._resolve(previous)
        block_size = self.scheduler.pool.block_size
        for chunk in out.chunks:  # every token below num_computed_tokens is known now
            # (a verify chunk's computed count holds its proposals until it is read: published then);
            # publish_filled's own test first: a decode chunk fills a block once in block_size steps
            request = chunk.request
            if (request.num_computed_tokens // block_size > chunk.start // block_size
                    and not request.is_finished and not chunk.proposals):
                self.scheduler.publish_filled(chunk)
        if self.depth == 0:
            return True, resolved + self._resolve(launched)
        self._inflight = launched
        return True, resolved

    def drain(self) -> list[Request]:
        """Read the in-flight step now, if any, and wait for the device (before the engine frees what
        that step runs on: a step with no sampling row has no read-back to wait for)."""
        previous, self._inflight = self._inflight, None
        resolved = self._resolve(previous) if previous is not None else []
        if self.device.type == "cuda":
            idle = torch.cuda.Event()
            idle.record(torch.cuda.current_stream(self.device))
            self.wait_for(idle)
        return resolved

    def finished(self, request: Request) -> None:
        """A request the engine finished between steps (an abort, a stop string): its slot goes back
        now, unless the step in flight samples for it (then reading that step releases it)."""
        if self._inflight is None or request not in self._inflight.sampling:
            self.slots.release(request)

    # -- one step ------------------------------------------------------------------------------

    def _launch(self, out: SchedulerOutput) -> _InFlight:
        runtime = self.runtime
        gather_rows: list[int] = []
        gather_slots: list[int] = []
        row = 0
        verify = False
        slot_of = self.slots.slot
        for chunk in out.chunks:  # rows in the order ModelRunner flattens the chunks
            request = chunk.request
            verify = verify or bool(chunk.proposals)
            known = len(request.token_ids)  # num_tokens (this loop runs 64 times a step at batch 64)
            # its input reaches a token still in flight (a verify chunk's proposals are the host's own)
            if chunk.start + chunk.num_tokens - len(chunk.proposals) > known:
                newest = known + request.num_inflight_tokens - 1  # num_planned_tokens - 1
                if chunk.start + chunk.num_tokens - 1 != newest or known != newest:
                    raise RuntimeError(f"request {request.request_id!r}: chunk [{chunk.start}, "
                                       f"{chunk.start + chunk.num_tokens}) needs tokens from {known} on, but only "
                                       f"the newest in-flight token ({newest}) is on the device")
                gather_rows.append(row + newest - chunk.start)
                gather_slots.append(slot_of(request))
            row += chunk.num_tokens
        sampling = [c.request for c in out.chunks if c.samples]
        if verify:
            return self._launch_verify(out, sampling, DeviceIds(self.slots.tokens, gather_rows, gather_slots))
        sample_slots = [slot_of(r) for r in sampling]
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
        self.scheduler.advance(out)
        return _InFlight(sampling, host_tokens, ready, keep, logprob_rows, host_logprobs)

    def _launch_verify(self, out: SchedulerOutput, sampling: list[Request], device_ids: DeviceIds) -> _InFlight:
        """A step with proposals: its tokens are read before the next step is planned (`step`), so none
        goes through a token slot; logprobs, where asked, are of every token a chunk adds."""
        runtime = self.runtime
        result = runtime.runner.execute(out, runtime.block_pool, device_ids)
        chunks = [c for c in out.chunks if c.samples]
        layout = VerifyLayout(sampling, [c.proposals for c in chunks], self.width, self.scheduler.proposer.draft_probs)
        tokens = sample_verify(runtime.sampler, result.logits, layout, result.argmax_keys)
        keep, host_tokens, ready, logprob_rows, host_logprobs = [tokens], tokens.view(-1), None, [], None
        if any(r.params.logprobs is not None for r in sampling):
            cells = host_to_device(layout.row_cells(), torch.int64, tokens.device)
            row_tokens = tokens.view(-1).index_select(0, cells).clamp(min=0)
            logprobs = runtime.sampler.logprobs(result.logits, row_tokens, layout.row_requests())
            if logprobs is not None:
                logprob_rows, host_logprobs = logprobs
                keep += [cells, row_tokens]
        if tokens.is_cuda:
            if host_logprobs is not None:
                keep.append(host_logprobs)
            host_tokens, host_logprobs, ready = self._read_back.copy(tokens.view(-1), host_logprobs)
        self.scheduler.advance(out)
        return _InFlight(sampling, host_tokens, ready, keep, logprob_rows, host_logprobs, chunks, layout)

    def _resolve(self, step: _InFlight) -> list[Request]:
        """Read the step's tokens into their requests (the scheduler finishes those they end); the
        requests that got a token."""
        if not step.sampling:
            return []
        if step.ready is not None:
            self.wait_for(step.ready)
        if step.verify is not None:
            return self._resolve_verify(step)
        tokens = step.host_tokens.tolist()
        logprobs = {}
        if step.logprob_rows:
            logprobs = dict(self.runtime.sampler.unpack(step.logprob_rows, step.host_logprobs.tolist(), tokens,
                                                        step.sampling))
        now = time.perf_counter()
        resolved = []
        resolve, release = self.scheduler.resolve_token, self.slots.release  # (bound once: 64 calls a step)
        for row, (request, token) in enumerate(zip(step.sampling, tokens)):
            if request.is_finished:  # finished a step earlier (or aborted): sampled past its end
                self.num_discarded_tokens += 1
                release(request)
                continue
            if logprobs and row in logprobs:
                request.logprobs.append(logprobs[row])
            if resolve(request, token, now) is not None:
                release(request)  # a step still in flight may write it once more (TokenSlots.release)
            resolved.append(request)
        self.num_tokens_read += len(resolved)
        return resolved

    def _resolve_verify(self, step: _InFlight) -> list[Request]:
        flat = step.host_tokens.tolist()
        width, layout = self.width, step.layout
        logprobs = {}
        if step.logprob_rows:
            row_tokens = [flat[cell] for cell in layout.row_cells()]
            logprobs = dict(self.runtime.sampler.unpack(step.logprob_rows, step.host_logprobs.tolist(), row_tokens,
                                                        layout.row_requests()))
        now = time.perf_counter()
        resolved = []
        for i, (chunk, row) in enumerate(zip(step.verify, layout.row_starts)):
            request = chunk.request
            if request.is_finished:
                self.num_discarded_tokens += 1
                self.slots.release(request)
                continue
            tokens = [t for t in flat[i * width:(i + 1) * width] if t >= 0]
            if chunk.proposals:
                appended = self.scheduler.resolve_verified(chunk, tokens, now)
                if not request.is_finished:
                    self.scheduler.publish_filled(chunk)  # its computed count holds only accepted tokens now
            else:
                appended = 1
                self.scheduler.resolve_token(request, tokens[0], now)
            self.num_tokens_read += appended
            for j in range(appended):
                if row + j in logprobs:
                    request.logprobs.append(logprobs[row + j])
            if request.is_finished:
                self.slots.release(request)
            resolved.append(request)
        return resolved
