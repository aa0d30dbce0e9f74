"""Draft-model proposals (speculative_config {"model": PATH, "num_speculative_tokens": k}).

A smaller model with the target's vocabulary runs beside it, built by the engine's own start-up
(engine.worker.startup.build_runtime): its own runner, static buffers, KV cache and block pool, its
own decode graphs (and piecewise graphs for its catch-up steps). Its cache is keyed by request id,
like the target's, but holds no prefix cache: the draft computes every request's tokens once.

One round, for the requests of a step that may propose (Scheduler._with_proposals calls
`propose_batch` once per step with all of them):
1. catch-up: the draft computes each request's tokens it has not seen, up to the last one (a new
   request's whole prompt, later the one or two tokens the last verify added), chunked by the token
   budget; the last row's logits give the first proposal;
2. k - 1 decode steps: each feeds the previous proposal back from the device (no host sync in
   between) and replays the draft's decode graph at the batch's bucket;
3. one read-back of the [B, k] proposals.
Greedy requests propose the draft's argmax; sampled ones draw from the draft's distribution under the
request's own temperature / top-k / top-p / min-p (its generator where seeded), and those
distributions are kept for the verify step's rejection sampling (`draft_probs`).

After the verify step accepts a of them, the draft's cache is valid up to the last token plus the
accepted proposals it was fed (positions n - 1 + min(a, fed)); the rest is rewritten next round.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

import models
from engine.config import ConfigError, EngineConfig
from engine.request import Request
from engine.sample.sampler import Sampler
from engine.sample.staging import host_to_device
from engine.spec.config import SpeculativeConfig
from engine.spec.proposer import Proposer
from engine.step import ScheduledChunk, SchedulerOutput
from engine.worker.input_buffers import DeviceIds
from engine.worker.startup import Runtime, build_runtime
from engine.worker.timeline import StartupTimeline
from models.errors import ModelLoadError

logger = logging.getLogger("engine")

# The draft's KV pool on CUDA: blocks for max_num_seqs requests of max_model_len, but at most this
# share of the memory free once the draft's weights are loaded (the target's pool is sized after it,
# from what is left).
DRAFT_KV_SHARE = 0.3
# A draft whose proposals are accepted with probability a per token has a round with none accepted
# with probability 1 - a (0.3 at a = 0.7, a useful draft): one such round must not send the request
# into prompt lookup's back-off. Three in a row (0.027 at a = 0.7, 0.73 at a = 0.1) do.
DRAFT_MISSES_BEFORE_BACKOFF = 3


@dataclass
class _DraftState:
    computed: int = 0  # the request's tokens whose K/V the draft's cache holds
    drafted_at: int = 0  # the request's length when its last proposals were drafted
    fed: int = 0  # proposals fed back as the draft's input in that round (their K/V written after it)


class DraftProposer(Proposer):
    misses_before_backoff = DRAFT_MISSES_BEFORE_BACKOFF

    def __init__(self, config: SpeculativeConfig, runtime: Runtime, max_num_batched_tokens: int, seed: int) -> None:
        super().__init__(config)
        self.runtime = runtime
        self.max_num_batched_tokens = max_num_batched_tokens
        device = runtime.runner.device
        self.generator = torch.Generator(device).manual_seed(seed + 1)  # not the target sampler's stream
        self._states: dict[Request, _DraftState] = {}
        self._probs: torch.Tensor | None = None  # [S, k, V] of the last round's sampled requests
        self._prob_rows: dict[Request, int] = {}
        self.num_forwards = 0  # draft forwards (catch-up and decode steps)
        self.num_rounds = 0  # propose_batch calls that drafted
        self.seconds = 0.0  # host time in those calls: the draft's steps and the read-back that waits for them
        self.num_kv_full = 0  # rounds a request sat out for want of a draft KV block

    # -- proposals --------------------------------------------------------------------------------

    def propose_batch(self, items: list[tuple[Request, int]], now: int) -> list[list[int]]:
        k = self.config.num_speculative_tokens
        results: list[list[int]] = [[] for _ in items]
        rows: list[int] = []  # index into items of each drafted request
        counts: list[int] = []
        for i, (request, room) in enumerate(items):
            count = min(k, room)
            if count < 1:
                continue
            state = self._states.setdefault(request, _DraftState())
            # K/V of every token up to the last one, then of the count - 1 proposals fed back
            needed = request.num_tokens + count - 1
            if not self._reserve(request, state, needed):
                self.num_kv_full += 1
                continue
            rows.append(i)
            counts.append(count)
        if not rows:
            return results
        requests = [items[i][0] for i in rows]
        began = time.perf_counter()
        drafted = self._draft(requests, counts).tolist()  # the round's one host sync
        self.seconds += time.perf_counter() - began
        self.num_rounds += 1
        for i, request, count, tokens in zip(rows, requests, counts, drafted):
            state = self._states[request]
            state.computed = state.drafted_at = request.num_tokens
            state.fed = count - 1
            results[i] = tokens[:count]
        return results

    def verified(self, request: Request, proposed: int, accepted: int, now: int) -> None:
        super().verified(request, proposed, accepted, now)
        state = self._states.get(request)
        if state is not None and state.drafted_at:
            # the accepted proposals the draft was fed are in its cache; the rest are rewritten
            state.computed = state.drafted_at + min(accepted, state.fed)
            state.drafted_at = state.fed = 0

    def draft_probs(self, requests: list[Request]) -> torch.Tensor | None:
        if self._probs is None or not all(r in self._prob_rows for r in requests):
            return None
        rows = host_to_device([self._prob_rows[r] for r in requests], torch.int64, self._probs.device)
        return self._probs.index_select(0, rows)

    def forget(self, request: Request) -> None:
        super().forget(request)
        self.preempted(request)

    def preempted(self, request: Request) -> None:
        # the target recomputes a preempted request from its prompt: so does the draft, whose blocks
        # go to the running requests meanwhile
        if self._states.pop(request, None) is not None:
            self.runtime.block_pool.free(request.request_id)

    def close(self) -> None:
        self._probs, self._prob_rows = None, {}
        for request in list(self._states):
            self.runtime.block_pool.free(request.request_id)
        self._states.clear()
        self.runtime.close()

    def reset_stats(self) -> None:
        super().reset_stats()
        self.num_forwards = self.num_rounds = self.num_kv_full = 0
        self.seconds = 0.0

    def stats_dict(self) -> dict[str, Any]:
        pool, dispatcher = self.runtime.block_pool, self.runtime.runner.dispatcher
        return {"draft_rounds": self.num_rounds, "draft_forwards": self.num_forwards,
                "draft_ms_per_round": self.seconds / self.num_rounds * 1e3 if self.num_rounds else 0.0,
                "draft_modes": dict(dispatcher.mode_counts), "draft_graph_fallbacks": dispatcher.fallbacks,
                "draft_kv_full": self.num_kv_full, "draft_kv_blocks_free": pool.num_free_blocks}

    # -- the draft's steps ------------------------------------------------------------------------

    def _reserve(self, request: Request, state: _DraftState, num_tokens: int) -> bool:
        pool = self.runtime.block_pool
        rid = request.request_id
        if pool.holds(rid, num_tokens, state.computed):
            return True
        pool.release_before(rid, state.computed)  # sliding-window blocks no query from here sees
        return pool.grow(rid, num_tokens)

    def _draft(self, requests: list[Request], counts: list[int]) -> torch.Tensor:
        """[B, k] int64 proposals on the device (row b's first counts[b] are real)."""
        runner, k = self.runtime.runner, self.config.num_speculative_tokens
        batch = len(requests)
        drafted = torch.zeros(batch, k, dtype=torch.int64, device=runner.device)
        sampled = [b for b, r in enumerate(requests) if r.params.temperature != 0]
        self._prob_rows = {requests[b]: row for row, b in enumerate(sampled)}
        self._probs = (torch.zeros(len(sampled), k, self.runtime.runner.model.config.vocab_size,
                                   dtype=torch.float32, device=runner.device) if sampled else None)
        # 1. catch-up to each request's last token, as many passes as the token budget needs
        # (min: a round needs the last token's logits, whatever the cache holds)
        pending = [(b, min(self._states[r].computed, r.num_tokens - 1)) for b, r in enumerate(requests)]
        while pending:
            step, owners, rest, budget = SchedulerOutput(), [], [], self.max_num_batched_tokens
            for b, start in pending:
                request = requests[b]
                n = request.num_tokens
                num = min(n - start, budget)
                if num <= 0:
                    rest.append((b, start))
                    continue
                # Two tokens (the last round's proposals all accepted: the last one and the target's
                # next) go as a verify chunk, its second token a "proposal": with the other requests'
                # one-token catch-ups the step replays the draft's verify graph (a decode row per
                # token), not piecewise graphs, which cost more than a decode step of the same model.
                proposals = (request.token_ids[n - 1],) if num == 2 and start + num == n else ()
                step.chunks.append(ScheduledChunk(request, start, num, start + num == n, proposals))
                budget -= num
                if start + num < n:
                    rest.append((b, start + num))
                else:
                    owners.append(b)
            self._run(step, None, owners, requests, drafted, 0)
            pending = rest
        # 2. the proposals fed back, one decode step each
        flat = drafted.view(-1)
        for j in range(1, max(counts)):
            live = [b for b in range(batch) if counts[b] > j]
            step = SchedulerOutput([ScheduledChunk(requests[b], requests[b].num_tokens - 1 + j, 1, True)
                                    for b in live])
            ids = DeviceIds(flat, list(range(len(live))), [b * k + j - 1 for b in live])
            self._run(step, ids, live, requests, drafted, j)
        return drafted

    def _run(self, step: SchedulerOutput, ids: DeviceIds | None, owners: list[int], requests: list[Request],
             drafted: torch.Tensor, column: int) -> None:
        """One draft forward; its sampling rows' tokens (owners, in chunk order) into drafted[:, column]
        at once (a decode graph's logits are overwritten by its next replay)."""
        runtime = self.runtime
        result = runtime.runner.execute(step, runtime.block_pool, ids)
        self.num_forwards += 1
        if not owners:
            return
        logits = result.logits
        if any(c.proposals for c in step.chunks):  # a verify chunk's every row has logits
            last, row = [], -1
            for chunk in step.chunks:
                if chunk.samples:
                    row += 1 + len(chunk.proposals)
                    last.append(row)
            logits = logits.index_select(0, host_to_device(last, torch.int64, logits.device))
        else:
            logits = logits[:len(owners)]
        chosen = [requests[b] for b in owners]
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, r in enumerate(chosen) if r.params.temperature != 0]
        if sampled:
            device = logits.device
            at = host_to_device(sampled, torch.int64, device)
            reqs = [chosen[i] for i in sampled]
            temperature = host_to_device([r.params.temperature for r in reqs], torch.float32, device)
            probs = Sampler._filtered_probs(logits.index_select(0, at).float() / temperature[:, None], reqs)
            uniforms = torch.empty(len(reqs), probs.shape[1], dtype=torch.float32, device=device)
            for i, request in enumerate(reqs):
                uniforms[i].uniform_(generator=request.generator or self.generator)
            # a draw from probs: the argmax of p / E with E ~ Exp(1) (ties and zeros never win)
            exponential = -torch.log1p(-uniforms)
            tokens.index_copy_(0, at, (probs / exponential).argmax(dim=-1))
            rows = host_to_device([self._prob_rows[r] for r in reqs], torch.int64, device)
            self._probs[:, column].index_copy_(0, rows, probs)
        drafted[:, column].index_copy_(0, host_to_device(owners, torch.int64, drafted.device), tokens)


def build_draft_proposer(spec: SpeculativeConfig, config: EngineConfig, target_config: Any,
                         timeline: StartupTimeline) -> DraftProposer:
    """Load (or take) the draft model and build its engine beside the target's: `config` is the
    target's resolved EngineConfig, `target_config` its model's ModelConfig."""
    device, dtype = config.device, config.dtype
    with timeline.phase("draft load"):
        if isinstance(spec.model, str):
            try:
                draft = models.from_pretrained(spec.model, dtype=dtype, device=device,
                                               quantization=config.quantization)
            except (ModelLoadError, OSError, ValueError, KeyError) as exc:
                raise ConfigError(f"EngineConfig.speculative_config['model']={spec.model!r}: the draft model does "
                                  f"not load: {exc}") from exc
        else:
            draft = spec.model
            weight = next(draft.parameters())
            if weight.device != torch.device(device) or str(weight.dtype).removeprefix("torch.") != dtype:
                raise ConfigError(f"EngineConfig.speculative_config['model']: the built draft model is "
                                  f"{weight.dtype} on {weight.device}; the engine runs {dtype} on {device}")
    if draft.config.vocab_size != target_config.vocab_size:
        raise ConfigError(f"EngineConfig.speculative_config['model']: the draft's vocabulary "
                          f"({draft.config.vocab_size} tokens) is not the target's ({target_config.vocab_size}); "
                          "a draft must share the target's tokenizer")
    limit = draft.config.max_position_embeddings
    if limit is not None and limit < config.max_model_len:
        raise ConfigError(f"EngineConfig.speculative_config['model']: the draft's max_position_embeddings ({limit}) "
                          f"is below max_model_len ({config.max_model_len})")
    draft_config = dataclasses.replace(
        # k = 1: the draft's runtime captures verify graphs of 2-token chunks (its catch-up after a
        # round whose proposals were all accepted); the draft proposes nothing itself
        config, speculative_config=SpeculativeConfig(1, 1, 1), enable_prefix_caching=False, async_scheduling=False,
        num_gpu_blocks=_draft_blocks(draft, config), tensor_parallel_size=1, max_waiting_requests=None)
    draft_timeline = StartupTimeline()
    with timeline.phase("draft start-up"), torch.inference_mode():
        runtime = build_runtime(draft, draft_config, draft_timeline)
    logger.info("draft model: %d layers, KV pool of %s blocks; start-up phases %.2f s", draft.config.num_layers,
                runtime.kv_cache.num_blocks_by_group, draft_timeline.as_dict()["phases_seconds"])
    return DraftProposer(spec, runtime, config.max_num_batched_tokens, config.seed)


def _draft_blocks(draft: torch.nn.Module, config: EngineConfig) -> int | None:
    """The draft's KV pool in blocks of every layer: max_num_seqs requests of max_model_len, on CUDA
    at most DRAFT_KV_SHARE of the free memory (None on the CPU: the engine's CPU default)."""
    if torch.device(config.device).type != "cuda":
        return None
    from engine.kv.kv_cache import KVCache
    per_seq = -(-config.max_model_len // config.block_size)
    wanted = config.max_num_seqs * per_seq + 1
    kv = KVCache(draft.attention_layer_names, config.block_size, config.torch_dtype, torch.device(config.device))
    free = torch.cuda.mem_get_info(torch.device(config.device))[0]
    return max(per_seq + 1, min(wanted, kv.blocks_for_memory(free * DRAFT_KV_SHARE)))
