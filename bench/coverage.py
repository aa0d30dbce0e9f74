"""Graph coverage of a workload: which steps a set of capture sizes serves, at what padding cost.

A step is a (token count, uniform decode?) pair. With decode graphs of batch sizes D and piecewise
graphs of token counts P, the engine's own dispatcher (engine.worker.dispatch.Dispatcher, the one place that
decides a step's mode) says how each step runs: FULL (a decode graph), PIECEWISE or NONE, and its
padded size. Padding waste is the share of the tokens computed under graphs that are padding.
`suggest_sizes` picks the k sizes that minimise the padded tokens of a token-count histogram (exact
dynamic programme over the observed counts).
"""
from __future__ import annotations

import bisect
import contextlib
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np


@dataclass(frozen=True)
class Step:
    num_tokens: int
    uniform_decode: bool


@dataclass(frozen=True)
class Coverage:
    steps: int
    full_steps: int
    piecewise_steps: int
    none_steps: int
    real_tokens: int          # over all steps
    graph_real_tokens: int    # real tokens of steps served by a graph
    graph_padded_tokens: int  # tokens those graphs computed (real + padding)

    @property
    def hit_rate(self) -> float:
        """Share of steps served by a graph."""
        return (self.full_steps + self.piecewise_steps) / self.steps if self.steps else 0.0

    @property
    def token_hit_rate(self) -> float:
        """Share of real tokens computed under a graph."""
        return self.graph_real_tokens / self.real_tokens if self.real_tokens else 0.0

    @property
    def padding_waste(self) -> float:
        """Share of graph-computed tokens that are padding."""
        if not self.graph_padded_tokens:
            return 0.0
        return 1.0 - self.graph_real_tokens / self.graph_padded_tokens


def bucket(n: int, sizes: Sequence[int]) -> int | None:
    """Smallest size >= n, or None if n is beyond the largest (sizes sorted ascending)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def coverage(steps: Iterable[Step], decode_sizes: Sequence[int], piecewise_sizes: Sequence[int]) -> Coverage:
    from custom_ops import RuntimeMode
    from engine.worker.dispatch import BatchDescriptor, Dispatcher
    dispatcher = Dispatcher(tuple(decode_sizes), tuple(piecewise_sizes), decode_graphs_wanted=True,
                            piecewise_graphs_wanted=True)
    counts = Counter()
    real = graph_real = graph_padded = 0
    with _quiet("engine"):  # a simulated step past the largest graph is a result (none_steps), not an event
        for step in steps:
            n = step.num_tokens
            real += n
            dispatch = dispatcher.dispatch(BatchDescriptor(n, step.uniform_decode))
            counts[dispatch.mode] += 1
            if dispatch.mode is not RuntimeMode.NONE:
                graph_real += n
                graph_padded += dispatch.descriptor.num_tokens
    return Coverage(sum(counts.values()), counts[RuntimeMode.FULL], counts[RuntimeMode.PIECEWISE],
                    counts[RuntimeMode.NONE], real, graph_real, graph_padded)


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def padded_tokens(histogram: dict[int, int], sizes: Sequence[int]) -> int:
    """Tokens computed when every count in the histogram is padded to its bucket (None-bucket: as is)."""
    sizes = sorted(sizes)
    return sum((bucket(n, sizes) or n) * w for n, w in histogram.items())


def suggest_sizes(histogram: dict[int, int], k: int, max_size: int | None = None) -> list[int]:
    """The <= k capture sizes minimising padded tokens for this histogram of token counts.

    Counts above max_size are ignored (they run without graphs whatever the list). The largest
    remaining count is always a size, so every covered step has a bucket. Exact: each bucket ends at
    an observed count, and a dynamic programme over the sorted counts picks the boundaries
    (O(k m^2) with numpy over m distinct counts).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    values = sorted(n for n in histogram if histogram[n] > 0 and (max_size is None or n <= max_size))
    if not values:
        return []
    if len(values) <= k:
        return values
    v = np.array(values, dtype=np.float64)
    w = np.array([histogram[n] for n in values], dtype=np.float64)
    W = np.concatenate([[0.0], np.cumsum(w)])
    S = np.concatenate([[0.0], np.cumsum(w * v)])
    m = len(values)
    # cost[a, b]: values a..b-1 (0-based, half-open) padded to v[b-1]
    a_idx = np.arange(m + 1)[:, None]
    b_idx = np.arange(m + 1)[None, :]
    vb = np.where(b_idx > 0, v[np.maximum(b_idx - 1, 0)], 0.0)
    cost = vb * (W[b_idx] - W[a_idx]) - (S[b_idx] - S[a_idx])
    cost = np.where(a_idx < b_idx, cost, np.inf)
    best = cost[0].copy()          # best[b]: values 0..b-1 covered with one bucket
    choice = [np.zeros(m + 1, dtype=np.int64)]
    for _ in range(1, k):
        total = best[:, None] + cost  # [a, b]: first a values with j buckets, then one bucket a..b-1
        total[0, :] = cost[0]         # or fewer buckets (a = 0: one bucket covers all)
        arg = np.argmin(total, axis=0)
        best = total[arg, np.arange(m + 1)]
        choice.append(arg)
    sizes = []
    b = m
    for j in range(k - 1, -1, -1):
        sizes.append(values[b - 1])
        a = int(choice[j][b]) if j > 0 else 0
        if a == 0:
            break
        b = a
    return sorted(set(sizes))


def simulate_steps(specs, max_num_seqs: int = 32, max_num_batched_tokens: int = 1024, block_size: int = 16,
                   num_blocks: int | None = None, step_s=None) -> list[Step]:
    """The steps the engine's scheduler makes for a workload (bench.workload specs), without a model.

    Time advances by `step_s(num_tokens, uniform)` per step (default: 8 ms + 20 us per token, about a
    3B model with graphs on an H100), so arrivals interleave with steps as in a real run.
    """
    from engine.core.scheduler import Scheduler
    from engine.kv.block_pool import BlockPool
    from engine.params import SamplingParams
    from engine.request import Request

    step_s = step_s or (lambda n, uniform: 0.008 + 20e-6 * n)
    max_len = max(s.prompt_len + s.output_len for s in specs) + block_size
    if num_blocks is None:
        num_blocks = 1 + max_num_seqs * -(-max_len // block_size)
    scheduler = Scheduler(BlockPool(num_blocks, block_size), max_num_seqs, max_num_batched_tokens, max_len)
    pending = sorted(specs, key=lambda s: s.arrival_s)
    now, i, steps = 0.0, 0, []
    while i < len(pending) or scheduler.has_unfinished():
        while i < len(pending) and pending[i].arrival_s <= now:
            spec = pending[i]
            scheduler.add(Request(f"r{i}", list(spec.prompt_ids), SamplingParams(max_tokens=spec.output_len,
                                                                                  ignore_eos=True), arrival_time=now))
            i += 1
        if not scheduler.has_unfinished():
            now = pending[i].arrival_s
            continue
        out = scheduler.schedule()
        if out.is_empty:
            raise RuntimeError("scheduler made no progress (KV pool too small for the workload?)")
        steps.append(Step(out.num_tokens, out.is_uniform_decode))
        now += step_s(out.num_tokens, out.is_uniform_decode)
        scheduler.update(out, [5] * sum(c.samples for c in out.chunks), now)
    return steps
