"""PieceRunner: one compute piece; runs it, or captures/replays one CUDA graph of it per token count.

The runner holds no policy: the graph's dispatcher (compiled_graph.py) decides once per step what
every piece does (run, capture or replay at which size) and writes it into the shared StepPlan.

Warm-up before a capture: the first call of a piece does work that must not be recorded (kernel
loading, Inductor's autotuning, the capture stream's cuBLAS workspace), so a runner runs its piece once
outside the capture before its first capture. Later sizes skip it (it cost as much host time as the
capture itself: ~1.2 s of gemma-3-1b's 48-size start-up on an H100), except where a size can load new
code: Triton specializes an integer argument on its divisibility by 16 and on equality to 1, and an
argument affine in the token count n falls in the same class for equal (n mod 16, n == 1), so a size
of a class this runner has not run yet is warmed up first. Anything else a first call does that a
capture cannot hold (a synchronize, a benchmark) makes the capture raise, and the error names
BackendConfig.warm_up_every_size, which warms up before every capture. A failed capture cannot be
retried in the same process: torch leaves its allocator and RNG state mid-capture.

Per captured size a runner keeps the graph, the addresses its inputs had at capture (for the debug
check), and its outputs held WEAKLY: the tensors returned on replay view the graph's output blocks
without owning them, so the next capture may reuse those blocks. Replays of one step run in piece
order and a piece's outputs are read by later pieces of the same step before any other replay, so
a reused block is always rewritten before it is read.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from compile_backend.pool import capture_stream, gc_paused, new_graph, reserved_bytes, weak_tensor
from compile_backend.stats import BackendStats


class StepAction(enum.Enum):
    RUN = "run"          # no graph: NONE and FULL modes, CPU, fallbacks
    CAPTURE = "capture"  # first step at a capture size: warm up, capture, replay
    REPLAY = "replay"


@dataclass
class StepPlan:
    action: StepAction = StepAction.RUN
    num_tokens: int = 0


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    outputs: Any                    # weak views of the graph's outputs
    input_ptrs: tuple[int | None, ...]


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


@dataclass
class PieceRunner:
    name: str                        # the split module's attribute ("submod_2")
    index: int                       # execution order among all pieces
    fn: Callable[..., Any]           # the compiled piece
    plan: StepPlan                   # shared by all pieces of one graph
    input_names: tuple[str, ...]     # the piece's placeholder names, for error messages
    pool: Any                        # graph pool handle
    stats: BackendStats
    debug_checks: bool = False
    warm_every_size: bool = False    # BackendConfig.warm_up_every_size
    captured: dict[int, _Captured] = field(default_factory=dict)
    warmed: set[tuple[int, bool]] = field(default_factory=set)  # specialization classes run (module doc)

    def __call__(self, *args: Any) -> Any:
        action = self.plan.action
        if action is StepAction.RUN:
            return self.fn(*args)
        if action is StepAction.REPLAY:
            entry = self.captured[self.plan.num_tokens]
            if self.debug_checks:
                self._check_addresses(entry, args)
            entry.graph.replay()
            self.stats.piece_replays += 1
            return entry.outputs
        return self._capture(self.plan.num_tokens, args)

    def drop(self, num_tokens: int) -> None:
        self.captured.pop(num_tokens, None)

    def _capture(self, num_tokens: int, args: tuple) -> Any:
        stream = capture_stream()
        stream.wait_stream(torch.cuda.current_stream())
        specialization = (num_tokens % 16, num_tokens == 1)
        warm = self.warm_every_size or specialization not in self.warmed
        with torch.cuda.stream(stream):
            if warm:
                self.fn(*args)
                self.warmed.add(specialization)
                self.stats.piece_warm_ups += 1
            try:
                graph, outputs = self._record(args)
            except RuntimeError as exc:
                if warm:
                    raise
                raise RuntimeError(
                    f"infer_graphs: capturing piece {self.name} for {num_tokens} tokens failed; it ran without "
                    "a warm-up at this size (its first call at an earlier size of the same specialization "
                    "class did the first-call work). If the piece does work at each new token count that a "
                    "capture cannot hold, set BackendConfig.warm_up_every_size=True, in a new process: torch "
                    "leaves a failed capture's allocator and RNG state behind.") from exc
        torch.cuda.current_stream().wait_stream(stream)
        # Capturing records kernels without running them: replay once so this step's outputs hold values.
        graph.replay()
        ptrs = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else None for a in args)
        self.captured[num_tokens] = _Captured(graph, _map_tensors(outputs, weak_tensor), ptrs)
        self.stats.piece_captures += 1
        return outputs  # strong for the rest of this step; later steps get the weak views

    def _record(self, args: tuple) -> tuple[torch.cuda.CUDAGraph, Any]:
        """One capture of the piece on the current (capture) stream: (graph, its outputs)."""
        graph = new_graph()
        reserved_before = reserved_bytes()
        with gc_paused():
            graph.capture_begin(pool=self.pool)
            try:
                outputs = self.fn(*args)
            finally:
                graph.capture_end()
        self.stats.graph_pool_bytes += reserved_bytes() - reserved_before
        return graph, outputs

    def _check_addresses(self, entry: _Captured, args: tuple) -> None:
        for i, (arg, ptr) in enumerate(zip(args, entry.input_ptrs)):
            if ptr is not None and arg.data_ptr() != ptr:
                name = self.input_names[i] if i < len(self.input_names) else f"#{i}"
                raise RuntimeError(
                    f"infer_graphs debug check: piece {self.name} (#{self.index}) input {name!r} lives at "
                    f"{arg.data_ptr():#x}, but its graph for {self.plan.num_tokens} tokens was captured "
                    f"reading {ptr:#x}; the replay would read stale memory. Inputs of captured pieces "
                    "(weights, buffers, step inputs) must keep their addresses after capture.")

