"""The ONE place that decides how a step runs: batch descriptor -> (runtime mode, padded descriptor).

FULL       a uniform decode batch whose size fits a captured decode graph: replay it, padded up to
           the bucket (the engine's native full-decode graph); with mixed graphs on (cudagraph_mode
           FULL), any other step whose token count fits a mixed-graph bucket: replay that native graph
           of the whole forward (engine.worker.mixed_graphs). The padded descriptor's uniform_decode
           says which of the two.
PIECEWISE  with prefill graphs on, any other step whose token count fits a piece bucket: the backend
           replays its per-piece graphs at the padded token count.
NONE       everything else: the compiled (or eager) model, no graph.

VERIFY     speculative decoding's verify steps (decodes of 1 + k tokens, engine.spec) replay a verify
           graph (a decode graph whose K/V are stored before any row attends) whenever decode graphs
           are on and one has as many rows as the step has tokens (every token a decode row of its
           own: ModelRunner._prepare), else a mixed-step graph (then captured for the larger verify
           steps too), whatever serves the other steps: a FULL step, not a piecewise one with
           attention launched from the host between pieces.

A uniform decode batch past the largest decode graph takes the other steps' graphs where it fits them
(counted as a fallback: it wanted a decode graph).

The tables are built once from the sizes that were actually captured, so a lookup is one list index.
A step that wanted a graph and got none is a fallback: counted per reason (which names the step's
size), and logged once per kind (decode batch too large, token count too large) so a stream of
varying sizes past the largest graph does not log every size it meets.
"""
from __future__ import annotations

import bisect
import logging
from collections import Counter
from dataclasses import dataclass

from custom_ops import RuntimeMode

logger = logging.getLogger("engine")


@dataclass(frozen=True)
class BatchDescriptor:
    num_tokens: int
    uniform_decode: bool  # every sequence contributes exactly one token (so num_tokens == num_seqs)
    verify: bool = False  # a speculative verify step (SchedulerOutput.is_verify)


@dataclass(frozen=True)
class Dispatch:
    mode: RuntimeMode
    descriptor: BatchDescriptor  # padded: num_tokens is the graph's size under FULL / PIECEWISE
    fallback: str | None = None  # why no graph was used although one was wanted


def _pad_table(sizes: tuple[int, ...]) -> list[int]:
    """table[n] = smallest size >= n, for n in 0..max(sizes)."""
    ordered = sorted(sizes)
    if not ordered:
        return [0]
    return [ordered[bisect.bisect_left(ordered, n)] for n in range(ordered[-1] + 1)]


class Dispatcher:
    def __init__(self, decode_sizes: tuple[int, ...] = (), piecewise_sizes: tuple[int, ...] = (),
                 decode_graphs_wanted: bool = False, piecewise_graphs_wanted: bool = False,
                 mixed_sizes: tuple[int, ...] = (), mixed_graphs_wanted: bool = False,
                 verify_graphs_wanted: bool = False, verify_sizes: tuple[int, ...] = ()) -> None:
        if piecewise_graphs_wanted and mixed_graphs_wanted:
            raise ValueError("Dispatcher: piecewise and mixed graphs serve the same steps; a mode has one of them")
        self.decode_sizes = tuple(sorted(decode_sizes))
        self.piecewise_sizes = tuple(sorted(piecewise_sizes))
        self.mixed_sizes = tuple(sorted(mixed_sizes))
        self._decode_wanted = decode_graphs_wanted
        self._piecewise_wanted = piecewise_graphs_wanted
        self._mixed_wanted = mixed_graphs_wanted
        self._verify_wanted = verify_graphs_wanted or mixed_graphs_wanted
        self.verify_sizes = tuple(sorted(verify_sizes))
        self._verify_pad = _pad_table(self.verify_sizes)
        self._full_pad = _pad_table(self.decode_sizes)
        self._piece_pad = _pad_table(self.piecewise_sizes)
        self._mixed_pad = _pad_table(self.mixed_sizes)
        self.mode_counts: Counter[str] = Counter()
        self.fallback_counts: Counter[str] = Counter()
        self.fallback_kinds: Counter[str] = Counter()  # decode | piecewise | mixed | verify

    @property
    def fallbacks(self) -> int:
        return sum(self.fallback_counts.values())

    def dispatch(self, batch: BatchDescriptor) -> Dispatch:
        result, kind = self._decide(batch)
        self.mode_counts[result.mode.value] += 1
        if result.fallback is not None:
            if kind not in self.fallback_kinds:
                logger.warning("no CUDA graph for this step (%s): running %s; further cases are counted "
                               "(LLM.stats()['fallback_reasons']), not logged", result.fallback, result.mode.value)
            self.fallback_counts[result.fallback] += 1
            self.fallback_kinds[kind] += 1
        return result

    def _decide(self, batch: BatchDescriptor) -> tuple[Dispatch, str | None]:
        """(the dispatch, the kind of its fallback or None)."""
        n = batch.num_tokens
        fallback, kind = None, None
        if batch.uniform_decode and self._decode_wanted:
            if n < len(self._full_pad):
                return Dispatch(RuntimeMode.FULL, BatchDescriptor(self._full_pad[n], True)), None
            fallback = f"decode batch of {n} > largest decode graph {self.decode_sizes[-1] if self.decode_sizes else 0}"
            kind = "decode"
        if batch.verify and self.verify_sizes and n < len(self._verify_pad):
            # every token a decode row (ModelRunner._prepare): the verify graph of n rows
            return Dispatch(RuntimeMode.FULL, BatchDescriptor(self._verify_pad[n], True, True)), None
        if batch.verify and self._verify_wanted:
            if 1 < n < len(self._mixed_pad):
                return Dispatch(RuntimeMode.FULL, BatchDescriptor(self._mixed_pad[n], False, True)), None
            fallback = f"verify step of {n} tokens > largest mixed graph {self.mixed_sizes[-1] if self.mixed_sizes else 0}"
            kind = "verify"
        if self._piecewise_wanted:
            if n < len(self._piece_pad):
                return Dispatch(RuntimeMode.PIECEWISE, BatchDescriptor(self._piece_pad[n], batch.uniform_decode),
                                fallback), kind
            if fallback is None:
                fallback = f"{n} tokens > largest piecewise graph {self.piecewise_sizes[-1] if self.piecewise_sizes else 0}"
                kind = "piecewise"
        if self._mixed_wanted:
            # a 1-token step is a uniform decode: the mixed table starts at 2 tokens
            if 1 < n < len(self._mixed_pad):
                return Dispatch(RuntimeMode.FULL, BatchDescriptor(self._mixed_pad[n], False), fallback), kind
            if fallback is None:
                fallback = f"{n} tokens > largest mixed graph {self.mixed_sizes[-1] if self.mixed_sizes else 0}"
                kind = "mixed"
        return Dispatch(RuntimeMode.NONE, batch, fallback), kind
