"""compile_model: the model under torch.compile with the infer_graphs backend, owned by one engine.

The backend's capture sizes are the engine's prefill graph sizes, so the dispatcher's PIECEWISE table
and the graphs the pieces hold are the same list. With prefill graphs off the backend never captures
(cudagraphs=False): NONE steps run the compiled pieces, FULL steps pass through to the decode graphs.

Under EngineConfig.full_graph_compile "layered" or "unsplit" (with decode graphs) the backend also
compiles the same trace for FULL steps with the attention op inside Inductor's graphs (one per
decoder layer, identical layers compiled once; or the whole forward as one), and the decode capture
records that. One Dynamo trace serves both (tracing is most of a warm start-up), and the pieces
keep NONE and PIECEWISE steps.

Per-engine compiled code: Dynamo keeps its compiled entries on the CODE OBJECT of the frame it
compiles. Compiling the model itself puts every engine's entry on the model class's `forward`
code, shared by all engines: closed engines stay referenced from it and the 9th engine in a process
hits the recompile limit (`FailOnRecompileLimitHit` under fullgraph). So each engine compiles its
own one-line function whose code object is a fresh copy (`code.replace()` returns a new object):
its entries are its own, and `release()` removes them (`remove_from_cache` on that code object,
which no other engine shares) without touching any other compiled model in the process
(`torch._dynamo.reset()` would reset them all).
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

from engine.config import EngineConfig


def _call_model(model: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def engine_forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return model(input_ids, positions)
    return engine_forward


@dataclass
class CompiledModel:
    """An engine's compiled forward and the backend behind it; `release()` frees both for good."""

    forward: Callable[..., torch.Tensor] | None
    backend: Any
    code: types.CodeType | None  # the fresh code object Dynamo keys this engine's entries on

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.forward is None:
            raise RuntimeError("this engine's compiled model was released (LLM.close)")
        return self.forward(input_ids, positions)

    def release(self) -> None:
        if self.code is not None:
            from torch._dynamo.eval_frame import remove_from_cache
            remove_from_cache(self.code)  # this engine's cache entries only: nobody else has this code
        self.forward = self.code = None
        backend, self.backend = self.backend, None
        if backend is not None:
            backend.release()
            _forget_backend(backend)


def _forget_backend(backend: Any) -> None:
    """Dynamo remembers every backend it was given (for `torch._dynamo.reset()`), wrapped by
    torch.compile; drop ours so the (already emptied) backend object itself can go too. Best effort:
    a torch without that registry just keeps a small empty object."""
    from torch._dynamo import eval_frame
    registry = getattr(eval_frame, "cached_backends", None)
    if not isinstance(registry, dict):
        return
    for key, value in list(registry.items()):
        if value is backend or getattr(value, "compiler_fn", None) is backend:
            del registry[key]


def compile_model(model: torch.nn.Module, config: EngineConfig, pool: Any = None,
                  ) -> tuple[CompiledModel, Callable[..., None], Any]:
    """(compiled forward, token-dim marker to call before each forward, the backend for its stats).

    `pool`: the GraphPool the backend captures into (the engine's, shared with its decode graphs);
    None lets the backend make its own.
    """
    from compile_backend import BackendConfig, InferGraphsBackend, mark_token_dim

    backend = InferGraphsBackend(BackendConfig(
        piece_compiler=config.piece_compiler,
        capture_sizes=tuple(config.prefill_graph_sizes),
        cudagraphs=bool(config.prefill_graphs),
        full_graph_compile=config.full_graph_compile if config.cuda_graphs else "piecewise",
    ), pool=pool)
    template = _call_model(model)
    code = template.__code__.replace()  # a new code object: this engine's Dynamo entries live on it
    forward = types.FunctionType(code, template.__globals__, template.__name__, template.__defaults__,
                                 template.__closure__)
    compiled = torch.compile(forward, backend=backend, fullgraph=True)
    return CompiledModel(compiled, backend, code), mark_token_dim, backend
