"""Scheduler: continuous batching with chunked prefill and preemption by recompute.

Every request is one token list (prompt + generated) of which `num_computed_tokens` are in the KV
cache; a step computes the next chunk of each scheduled request. A decode is simply a chunk of one
token, so decodes and prefill chunks share one budget (`max_num_batched_tokens`) without a special
case. Running requests go first, oldest first; waiting requests are admitted after them while the
budget, `max_num_seqs` and the free blocks allow.

When a running request cannot get the blocks for its chunk, the newest running request is preempted:
its blocks are freed, its computed count drops to zero, and it goes to the front of the waiting
queue. Its token list (prompt + everything generated so far) is kept, so on readmission the whole
list is recomputed as a prefill and generation continues where it stopped: nothing is lost.

With prefix caching, admission takes the longest run of cached full blocks matching the request's
tokens (engine.kv.prefix_cache) and starts its computed count there, so only the rest is prefilled (an
extend); a preempted request readmitted hits the blocks it published itself. Full blocks are
published after the step that computed them, and finishing, aborting (`finish`) or preempting drops
the request's references.

With sliding-window layers in their own pool (engine.kv.groups), a scheduled request first gives back
the sliding blocks its chunk and every later query cannot see, and admission and growth need blocks
in every group.
"""
from __future__ import annotations

import logging
from collections import deque

from typing import TYPE_CHECKING

from engine.kv.block_pool import BlockPool
from engine.request import FinishReason, Request, RequestStatus
from engine.step import ScheduledChunk, SchedulerOutput

if TYPE_CHECKING:
    from engine.spec.proposer import Proposer

logger = logging.getLogger("engine")


class Scheduler:
    def __init__(self, block_pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: tuple[int, ...] = (),
                 enable_prefix_caching: bool = False, proposer: Proposer | None = None) -> None:
        if block_pool.blocks_for(max_model_len) > block_pool.num_usable_blocks:
            raise ValueError(
                f"the KV pool has {block_pool.num_usable_blocks} usable blocks of {block_pool.block_size} "
                f"tokens, fewer than one request of max_model_len={max_model_len} needs "
                f"({block_pool.blocks_for(max_model_len)}): raise num_gpu_blocks / kv_memory_fraction or "
                "lower max_model_len")
        self.pool = block_pool
        if enable_prefix_caching:
            block_pool.enable_prefix_caching()
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.proposer = proposer  # speculative decoding (engine.spec.proposer), or None
        self.num_schedules = 0    # schedule() calls: the clock of the proposer's back-off

    def add(self, request: Request) -> None:
        max_tokens = request.params.max_tokens
        request.length_limit = (self.max_model_len if max_tokens is None
                                else min(self.max_model_len, request.num_prompt_tokens + max_tokens))
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def wants_known_tokens(self) -> bool:
        """Whether the next schedule may propose for a running request: proposals continue the
        request's tokens, so every token of the step in flight must be read first (engine.core.step_loop)."""
        return self.proposer is not None and any(self.proposer.eligible(r, self.num_schedules) for r in self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.num_schedules += 1
        speculating: list[tuple[int, int]] = []  # (chunk index, proposal room) of decode chunks that may propose
        running, pool = self.running, self.pool
        i = 0
        while i < len(running) and budget > 0:  # (a decode step's loop: 64 times a step at batch 64)
            request = running[i]
            start = request.num_computed_tokens
            planned = len(request.token_ids) + request.num_inflight_tokens  # num_planned_tokens
            num_new = min(planned - start, budget)
            # pool.holds first: a decode step's every request but one in 16 needs no new block
            if pool.holds(request.request_id, start + num_new, start) or self._reserve(request, num_new, out):
                chunk = ScheduledChunk(request, start, num_new, start + num_new == planned)  # next_for, inline
                budget -= num_new
                if self.proposer is not None and num_new == 1 and chunk.samples:
                    room = self._proposal_room(request, budget)
                    if room > 0:  # the room is held out of the budget until the proposals are known
                        speculating.append((len(out.chunks), room))
                        budget -= room
                out.chunks.append(chunk)
                i += 1
            else:  # the request preempted itself: it was the newest, nothing after it runs
                break
        if speculating:
            budget += self._with_proposals(out, speculating)
        if out.preempted:  # blocks are short: admitting more would only preempt again
            return self._checked(out)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]  # holds no blocks: new, or preempted (its blocks released)
            cached = self.pool.match_prefix(request.token_ids)
            num_cached = len(cached) * self.pool.block_size
            num_new = min(request.num_planned_tokens - num_cached, budget)
            if not self.pool.admit(request.request_id, cached, num_cached + num_new):
                break
            if self.pool.cache is not None:
                self.pool.cache.count_lookup(request.num_tokens, num_cached)
            request.num_computed_tokens = num_cached
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(ScheduledChunk.next_for(request, num_new))
            budget -= num_new
        return self._checked(out)

    def _proposal_room(self, request: Request, budget: int) -> int:
        """Tokens a decode chunk may verify after its last one: none while it has a token in flight or
        the proposer holds it back; else bounded by the step's token budget, k, max_tokens and
        max_model_len (the last token a verify step can add is its extra one)."""
        if request.num_inflight_tokens or not self.proposer.eligible(request, self.num_schedules):
            return 0
        room = min(budget, self.max_model_len - request.num_tokens - 1, self.proposer.config.num_speculative_tokens)
        if request.params.max_tokens is not None:
            room = min(room, request.params.max_tokens - (request.num_tokens - request.num_prompt_tokens) - 1)
        return room

    def _with_proposals(self, out: SchedulerOutput, speculating: list[tuple[int, int]]) -> int:
        """Turn the decode chunks at `speculating` into verify chunks with the proposer's tokens, all
        proposed in one call (a draft model runs them as one batch), where the blocks allow (proposals
        never preempt anyone: without a block they are dropped). Returns the budget left unused."""
        chunks = [out.chunks[index] for index, _ in speculating]
        proposals = self.proposer.propose_batch([(c.request, room) for c, (_, room) in zip(chunks, speculating)],
                                                self.num_schedules)
        unused = 0
        for (index, room), chunk, tokens in zip(speculating, chunks, proposals):
            tokens = tokens[:room]
            unused += room - len(tokens)
            if not tokens:
                continue
            request = chunk.request
            end = chunk.start + 1 + len(tokens)
            if not (self.pool.holds(request.request_id, end, chunk.start) or self.pool.grow(request.request_id, end)):
                self.proposer.dropped(len(tokens))
                unused += len(tokens)
                continue
            out.chunks[index] = ScheduledChunk(request, chunk.start, 1 + len(tokens), True, tuple(tokens))
        return unused

    def _checked(self, out: SchedulerOutput) -> SchedulerOutput:
        """Under debug checks: no chunk writes into a shared or published block, and the pool adds up."""
        if self.pool.debug_checks:
            for chunk in out.chunks:
                self.pool.check_writable(chunk.request.request_id, chunk.start, chunk.start + chunk.num_tokens)
            self.pool.check_consistency()
        return out

    def _reserve(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Blocks for the chunk, preempting the newest running requests as needed; False if request itself went."""
        start = request.num_computed_tokens
        if self.pool.holds(request.request_id, start + num_new, start):
            return True  # most decode steps: 15 of 16 tokens land in a block the request already has
        # Sliding-window blocks no query from the chunk's start on can see go back first (engine.kv.groups).
        self.pool.release_before(request.request_id, start)
        while not self.pool.grow(request.request_id, start + num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.pool.free(request.request_id)
        if self.proposer is not None:
            self.proposer.preempted(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        logger.debug("preempted request %s (%d tokens to recompute)", request.request_id, request.num_tokens)

    # -- after a step: the one update, in two halves ------------------------------------------------
    # `advance` runs when a step is launched, `resolve_token` when its tokens are read: at once in
    # the synchronous loop (`update`), one step later in the overlapped one (engine.core.step_loop). Both
    # loops go through these, so every rule about finishing lives here.

    def advance(self, out: SchedulerOutput) -> None:
        """A launched step: its chunks are computed, and each sampling chunk has one token in flight.
        A request whose in-flight token reaches max_tokens or max_model_len leaves the running list
        now, so it is never scheduled past its length (it finishes when that token is read)."""
        for chunk in out.chunks:
            request = chunk.request
            request.num_computed_tokens += chunk.num_tokens
            if not chunk.samples:
                continue  # a partial prefill chunk emits no token
            request.num_inflight_tokens += 1
            if len(request.token_ids) + request.num_inflight_tokens >= request.length_limit and request in self.running:
                self.running.remove(request)  # (its planned tokens reach its length: _at_length, inline)

    def resolve_token(self, request: Request, token: int, now: float) -> FinishReason | None:
        """The oldest in-flight token of `request` is read: append it, and finish the request if it
        ends it (returns why). A request finished meanwhile (abort, stop string, or an earlier token
        of its own) drops the token: nothing is appended, and None is returned."""
        if request.status is RequestStatus.FINISHED:
            return None
        request.num_inflight_tokens -= 1
        ids = request.token_ids
        ids.append(token)
        request.token_times.append(now)
        if len(ids) < request.length_limit and token not in self.eos_token_ids and not request.params.stop_token_ids:
            return None  # most tokens end nothing: _finish_reason's three tests at once (64 times a step)
        reason = self._finish_reason(request, token)
        if reason is not None:
            self.finish(request, reason)
        return reason

    def resolve_verified(self, chunk: ScheduledChunk, tokens: list[int], now: float) -> int:
        """A verify chunk's result is read: `tokens` are its accepted proposals and the one token after
        them. The rejected proposals' positions leave the computed count (their K/V is overwritten by
        a later step before anything reads it), then the tokens are appended one by one as
        resolve_token does, until one ends the request. Returns the tokens appended."""
        request = chunk.request
        if request.is_finished:
            return 0
        accepted = len(tokens) - 1
        request.num_computed_tokens -= len(chunk.proposals) - accepted
        self.proposer.verified(request, len(chunk.proposals), accepted, self.num_schedules)
        for i, token in enumerate(tokens):
            if i:
                request.num_inflight_tokens += 1  # resolve_token reads one in-flight token each
            if self.resolve_token(request, token, now) is not None:
                return i + 1
        return len(tokens)

    def update(self, out: SchedulerOutput, sampled: list[int], now: float) -> list[Request]:
        """`advance` and `resolve_token` at once (the step's tokens are known): `sampled` holds one
        token per sampling chunk, in chunk order. Returns the requests that finished."""
        self.advance(out)
        for chunk in out.chunks:
            self.publish_filled(chunk)
        finished = []
        tokens = iter(sampled)
        for chunk in out.chunks:
            if chunk.samples and self.resolve_token(chunk.request, next(tokens), now) is not None:
                finished.append(chunk.request)
        return finished

    def publish_filled(self, chunk: ScheduledChunk) -> None:
        """Publish the blocks a computed chunk filled to the prefix cache (call once the chunk's request
        counts it in num_computed_tokens and every token below that is known on the host)."""
        request, block_size = chunk.request, self.pool.block_size
        if request.num_computed_tokens // block_size > chunk.start // block_size:  # a block filled up
            self.pool.publish(request.request_id, request.token_ids, request.num_computed_tokens)

    def _finish_reason(self, request: Request, token: int) -> FinishReason | None:
        """Why `token`, the request's newest known token, ends it, or None."""
        params = request.params
        if not params.ignore_eos and token in self.eos_token_ids:
            return FinishReason.EOS
        if token in params.stop_token_ids:
            return FinishReason.STOP
        if self._at_length(request, request.num_tokens):
            return FinishReason.LENGTH
        return None

    def _at_length(self, request: Request, num_tokens: int) -> bool:
        """Whether a request of num_tokens tokens has reached max_tokens (None: no bound) or max_model_len."""
        return num_tokens >= request.length_limit

    def stop_string_matched(self, request: Request) -> None:
        """The request's text reached one of its stop strings (engine.core.detokenizer): it ends with
        FinishReason.STOP, also if the token that completed the string ended it otherwise (max_tokens,
        EOS): the stop string decides."""
        if request.is_finished:
            request.finish_reason = FinishReason.STOP
        else:
            self.finish(request, FinishReason.STOP)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a request (its stop condition, or an abort): out of the queues, its block references dropped."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.pool.free(request.request_id)
        if self.proposer is not None:
            self.proposer.forget(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.num_inflight_tokens = 0  # whatever a step still in flight samples for it is dropped
