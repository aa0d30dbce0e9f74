"""The sampler's argmax over a vocabulary row: torch's one-pass reduction, or a chunked one where the
device runs that faster, chosen by timing both once per vocabulary size and dtype.

On an H100 (torch 2.11) torch's argmax of one 128,256-wide row (Llama 3's vocabulary) took about
26 us of GPU time: the row is reduced by few blocks. Cut into 256 runs it is one wide reduction and
two tiny ones, half the time. For 151,936 and 262,144 (Qwen3, Gemma 3) torch's own reduction is
already the faster one (bench/results/h100-2026-11-24/argmax-probe.log times both in graph replays),
so neither choice fits every vocabulary: the engine times both at warm-up and keeps the faster. Both
give the same token: the lowest index among equal maxima, and a NaN where a row has one.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger("engine")

ARGMAX_CHUNKS = 256
_TIMED_CALLS = 20


def chunked_argmax(x: torch.Tensor, chunks: int | None = None) -> torch.Tensor:
    """`x.argmax(dim=-1)` for [N, V] x in two reductions: each row cut into `chunks` equal runs (by
    default the largest power of two up to ARGMAX_CHUNKS dividing V), every run's maximum and its first
    index, then the first run holding the row's maximum. A V with no such divisor of at least 16 gets
    plain argmax."""
    n, vocab = x.shape
    if chunks is None:
        chunks = min(ARGMAX_CHUNKS, vocab & -vocab)
    if chunks < 16 or vocab % chunks:
        return x.argmax(dim=-1)
    width = vocab // chunks
    values, within = x.view(n, chunks, width).max(dim=-1)  # ties: the first index, as argmax
    best = values.argmax(dim=-1, keepdim=True)              # a NaN run wins, as in argmax
    return (best * width + within.gather(-1, best)).squeeze(-1)


def _plain_argmax(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


def _gpu_us_per_call(fn, x: torch.Tensor) -> float:
    """GPU time of one call: the calls queue behind a sleeping kernel, so the host's launch rate does
    not pace them and the events measure the device alone."""
    for _ in range(3):
        fn(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(x.device)
    torch.cuda._sleep(2_000_000)
    start.record()
    for _ in range(_TIMED_CALLS):
        fn(x)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / _TIMED_CALLS


class RowArgmax:
    """argmax(dim=-1) of [N, V] rows by the faster method for (V, dtype) on this device; `choose` times
    both (on CUDA; elsewhere torch's). Unchosen shapes use torch's, so nothing here ever syncs a step."""

    def __init__(self) -> None:
        self._chunked: dict[tuple[int, torch.dtype], bool] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._chunked.get((x.shape[-1], x.dtype)):
            return chunked_argmax(x)
        return _plain_argmax(x)

    def choose(self, logits: torch.Tensor) -> bool:
        """Time both methods on one row of `logits` (real values: a warm-up step's) and keep the faster
        for its vocabulary size and dtype, and for float32 (the sampled path's dtype). True if chunked."""
        for dtype in dict.fromkeys((logits.dtype, torch.float32)):
            row = logits[:1].to(dtype)
            key = (row.shape[-1], dtype)
            if key in self._chunked:
                continue
            faster = False
            if row.is_cuda and torch.equal(chunked_argmax(row), row.argmax(dim=-1)):
                with torch.cuda.device(row.device):
                    plain, chunked = _gpu_us_per_call(_plain_argmax, row), _gpu_us_per_call(chunked_argmax, row)
                faster = chunked < plain
                logger.info("sampler: argmax over %d %s logits: torch's %.1f us, chunked %.1f us per row: %s",
                            key[0], str(dtype).removeprefix("torch."), plain, chunked,
                            "chunked" if faster else "torch's")
            self._chunked[key] = faster
        return self._chunked[(logits.shape[-1], logits.dtype)]
