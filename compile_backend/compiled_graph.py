"""CompiledGraph: what Dynamo calls for one traced graph; decides once per step what the pieces do.

The runtime mode comes from the forward context (the engine, or `piecewise_context`, sets it):
  NONE      compiled pieces, no graphs;
  PIECEWISE one graph per compute piece per captured token count: replay it, capture it on the
            first step at that size, or (a size that is not captured) run without graphs and count
            a fallback; on CPU or with cudagraphs=False simply run the pieces;
  FULL      the pieces run straight through, attention between them, so the caller's own capture
            (the engine's decode and mixed graphs) records the whole forward.

Step inputs (graph inputs whose shape has the token dimension) are copied into persistent buffers
before a graph step: a graph reads the addresses it was captured with, and a caller's fresh tensor
lives somewhere else every step. The copy is skipped when the caller already passes that buffer.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import torch

from compile_backend.config import BackendConfig
from compile_backend.piecewise import PieceRunner, StepAction, StepPlan
from compile_backend.split import SplitGraph
from compile_backend.stats import BackendStats
from custom_ops.forward_context import RuntimeMode, get_forward_context

logger = logging.getLogger(__name__)


def _token_dim(value: Any) -> int | None:
    """The first symbolic dimension of a fake tensor (the marked token dim), or None if static."""
    if not isinstance(value, torch.Tensor):
        return None
    for d, size in enumerate(value.shape):
        if isinstance(size, torch.SymInt):
            return d
    return None


class GraphHandle:
    """What the backend hands Dynamo for one compiled graph: a forwarder that `cut()` empties.

    Dynamo installs it as a global of the traced function's module, and keeps that global for as long
    as the compiled entry's guards live; a guard on an object that never dies (under tensor
    parallelism, on a class) keeps it for the whole process. Slotted, so `torch._dynamo.disable`'s
    wrapper (functools.wraps copies a callable's `__dict__`) holds no second reference to the graph:
    once cut, the graph, its captured CUDA graphs and their pool go with their engine."""

    __slots__ = ("graph",)

    def __init__(self, graph: CompiledGraph) -> None:
        self.graph: CompiledGraph | None = graph

    def __call__(self, *args: Any) -> Any:
        graph = self.graph
        if graph is None:
            raise RuntimeError("infer_graphs: this compiled graph was released (its backend's release())")
        return graph(*args)

    def cut(self) -> None:
        self.graph = None


def step_inputs_of(fake_inputs: Sequence[Any], input_names: Sequence[str]) -> list[tuple[int, int, str]]:
    """(input index, token dim, name) of every graph input whose shape has the token dimension."""
    return [(i, d, input_names[i]) for i, v in enumerate(fake_inputs) if (d := _token_dim(v)) is not None]


class CompiledGraph:
    def __init__(self, split: SplitGraph, runners: dict[str, Any], step_inputs: Sequence[tuple[int, int, str]],
                 config: BackendConfig, stats: BackendStats, pool: Any,
                 piece_inputs: dict[str, tuple[str, ...]] | None = None):
        """`step_inputs`: step_inputs_of the graph's inputs. `piece_inputs`: each compute piece's
        placeholder names, where the split module holds no piece to read them from (a loaded graph)."""
        self.split = split
        self.config = config
        self.stats = stats
        self.plan = StepPlan()
        self.sizes = frozenset(config.capture_sizes)
        self.captured: set[int] = set()
        self.pieces: list[PieceRunner] = []
        for info in split.summary.pieces:
            fn = runners[info.name]
            if not info.is_splitting:
                if piece_inputs is not None:
                    names = tuple(piece_inputs[info.name])
                else:
                    names = tuple(n.name for n in split.piece(info).graph.nodes if n.op == "placeholder")
                fn = PieceRunner(info.name, info.index, fn, self.plan, names, pool, stats, config.debug_checks,
                                 config.warm_up_every_size)
                self.pieces.append(fn)
            # The split module calls `self.<name>(...)`: a plain attribute (not a submodule) takes
            # the submodule's place so the call goes straight to the runner.
            delattr(split.module, info.name)
            split.module.__dict__[info.name] = fn
        self.forward = split.module.forward
        self.step_inputs = [tuple(entry) for entry in step_inputs]
        self.static_inputs: dict[int, torch.Tensor] = {}       # input index -> buffer at max size
        self.static_views: dict[int, list[torch.Tensor]] = {}  # token count -> views, one per step input
        self._warned_fallback = False

    def release(self) -> None:
        """Drop every captured graph and static buffer now (whoever still holds this object)."""
        for piece in self.pieces:
            piece.captured.clear()
        self.pieces.clear()
        self.captured.clear()
        self.static_inputs.clear()
        self.static_views.clear()

    def __call__(self, *args: Any) -> Any:
        context = get_forward_context()
        mode = context.runtime_mode if context is not None else RuntimeMode.NONE
        if mode is RuntimeMode.FULL:
            self.stats.full_steps += 1
            return self.forward(*args)
        if mode is RuntimeMode.NONE or not self.config.cudagraphs or not self._on_cuda(args):
            self.stats.graphless_steps += 1
            return self.forward(*args)
        num_tokens = context.num_tokens
        if num_tokens in self.captured:
            action = StepAction.REPLAY
        elif num_tokens in self.sizes:
            action = StepAction.CAPTURE
        else:
            return self._fallback(num_tokens, args)
        args = self._stage_inputs(args, num_tokens)
        self.plan.action, self.plan.num_tokens = action, num_tokens
        start = time.perf_counter()
        try:
            out = self.forward(*args)
        except BaseException:
            if action is StepAction.CAPTURE:
                for piece in self.pieces:
                    piece.drop(num_tokens)
            raise
        finally:
            self.plan.action = StepAction.RUN
        if action is StepAction.CAPTURE:
            self.captured.add(num_tokens)
            self.stats.capture_seconds[num_tokens] = (self.stats.capture_seconds.get(num_tokens, 0.0)
                                                      + time.perf_counter() - start)
            logger.info("infer_graphs: captured %d pieces for %d tokens in %.3f s", len(self.pieces),
                        num_tokens, time.perf_counter() - start)
        else:
            self.stats.replay_steps += 1
        return out

    def _on_cuda(self, args: tuple) -> bool:
        if self.step_inputs:
            return args[self.step_inputs[0][0]].is_cuda
        return any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)

    def _fallback(self, num_tokens: int, args: tuple) -> Any:
        self.stats.fallback_steps += 1
        if not self._warned_fallback:
            self._warned_fallback = True
            logger.warning(
                "infer_graphs: a PIECEWISE step with %d tokens has no graph (capture sizes %d..%d; pad "
                "with pad_to_capture_size); it runs the compiled pieces without graphs. Counted in "
                "stats.fallback_steps; logged once.", num_tokens, min(self.sizes), max(self.sizes))
        return self.forward(*args)

    def _stage_inputs(self, args: tuple, num_tokens: int) -> tuple:
        views = self.static_views.get(num_tokens)
        if views is None:
            views = self.static_views[num_tokens] = [self._static_view(args, i, d, name, num_tokens)
                                                     for i, d, name in self.step_inputs]
        staged = list(args)
        for (i, d, name), view in zip(self.step_inputs, views):
            arg = args[i]
            if arg.shape != view.shape:
                raise ValueError(
                    f"infer_graphs: input {name!r} has shape {tuple(arg.shape)} but the forward context says "
                    f"{num_tokens} tokens (expected {tuple(view.shape)}): pad the step's inputs to the "
                    "context's num_tokens")
            if arg.data_ptr() != view.data_ptr() or arg.stride() != view.stride():
                view.copy_(arg)
            staged[i] = view
        return tuple(staged)

    def _static_view(self, args: tuple, index: int, dim: int, name: str, num_tokens: int) -> torch.Tensor:
        arg = args[index]
        buffer = self.static_inputs.get(index)
        if buffer is None:
            shape = list(arg.shape)
            shape[dim] = self.config.max_capture_size
            buffer = self.static_inputs[index] = torch.zeros(shape, dtype=arg.dtype, device=arg.device)
        if arg.shape[dim] != num_tokens:
            raise ValueError(
                f"infer_graphs: input {name!r} has {arg.shape[dim]} tokens in dim {dim} but the forward "
                f"context says {num_tokens}: pad the step's inputs to the context's num_tokens")
        return buffer.narrow(dim, 0, num_tokens)
