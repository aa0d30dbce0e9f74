"""compile_model: the model under torch.compile with the infer_graphs backend, owned by one engine.

The backend's capture sizes are the engine's prefill graph sizes, so the dispatcher's PIECEWISE table
and the graphs the pieces hold are the same list. With prefill graphs off the backend never captures
(cudagraphs=False): NONE steps run the compiled pieces, FULL steps pass through to the decode graphs.

FULL steps (decode and mixed graphs) run the same pieces straight through, attention between them,
and the engine's capture records the whole forward: one Dynamo trace and one compile serve every
mode. (A second compile for FULL steps, one Inductor graph per decoder layer or of the whole forward,
recorded the same kernels: decode replays within 1% of the pieces' on an H100,
bench/results/h100-2026-11-23/layered and h100-2026-11-26/startup-compile/decode-piecewise-vs-layered;
it cost start-up time and was removed.)

Warm start: when the compile cache holds the compiled graph of this model and configuration
(engine/worker/warm_start.py), nothing is traced or compiled: the backend loads the graph and the
engine calls it with the model's parameters (warm_start.CachedForward). Otherwise Dynamo traces at
the first forward, the backend writes what it compiled into a temporary entry, and `finish_cache`
keeps it once the start-up has succeeded.

After the first trace, the same: Dynamo's compiled code evaluates its guards on every call (a few
hundred tensors: ~1 ms a step of a 28-layer model on the CPU box, bench/results/cpu-2026-12-07/
dynamo-bypass/), for every step that runs the model outside a CUDA graph (piecewise and graphless
steps, captures). Once the one graph is traced, the engine calls it directly as a warm start does
(`CompiledModel.direct`), its inputs found again by the binder and checked on each call.

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

import logging
import sys
import threading
import time
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

from engine.config import EngineConfig
from engine.kv.block_pool import debug_checks_from_env

logger = logging.getLogger("engine")


# What a compile, and a warm start's load of the cached graph alike, import before they do anything:
# Dynamo, and Inductor's loader and the modules its generated code imports (~1.0-1.3 s on the CPU box,
# all of it Python under the GIL). Imported on a thread from the start of an engine's start-up, they
# overlap its weight load and tokenizer parse, whose file reads and copies release the GIL.
_COMPILE_IMPORTS = ("torch._dynamo", "torch._inductor.standalone_compile", "torch._inductor.async_compile",
                    "torch._inductor.select_algorithm")
_prefetch: threading.Thread | None = None


def prefetch_compile_imports(device_type: str) -> None:
    """Import the compile stack on a daemon thread (once per process; nothing where it is imported).
    On the CPU also Inductor's probe of the vector ISA, which compiles and runs test programs in
    subprocesses (~1.2 s on the CPU box, waiting, not computing). `wait_for_compile_imports` joins it;
    anything the thread failed to import is imported again, and fails, where it is needed."""
    global _prefetch
    if _prefetch is not None or all(name in sys.modules for name in _COMPILE_IMPORTS):
        return

    def run() -> None:
        import importlib
        try:
            for name in _COMPILE_IMPORTS:
                importlib.import_module(name)
            if device_type == "cpu":
                from torch._inductor.cpu_vec_isa import pick_vec_isa
                pick_vec_isa()  # cached for the process
        except Exception as exc:  # the main thread's own import says what is wrong
            logger.debug("compile imports on a thread failed: %s", exc)

    _prefetch = threading.Thread(target=run, name="infer-graphs-compile-imports", daemon=True)
    _prefetch.start()


def wait_for_compile_imports() -> float:
    """Join the prefetch thread, if one runs; the seconds waited. Called before the engine imports any
    of those modules itself: one thread importing them at a time keeps their circular imports safe."""
    thread = _prefetch
    if thread is None or not thread.is_alive():
        return 0.0
    start = time.perf_counter()
    thread.join()
    return time.perf_counter() - start


def _call_model(model: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def engine_forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return model(input_ids, positions)
    return engine_forward


@dataclass
class CompiledModel:
    """An engine's compiled forward and the backend behind it; `release()` frees both for good.

    `cache_status`: "hit" (the graph came from the compile cache: no Dynamo, no Inductor;
    engine/worker/warm_start.py), "miss:<why>", or "off:<why>" (no cache could be used)."""

    forward: Callable[..., torch.Tensor] | None
    backend: Any
    code: types.CodeType | None  # the fresh code object Dynamo keys this engine's entries on
    cache_status: str = "off: not asked"
    binder: Any = None           # warm_start.InputBinder: describes a traced graph's inputs, finds them again
    pending: Any = None          # (store, temporary entry, key fields, artifact sink) until finish_cache
    cache_saved: str | None = None  # what finish_cache did, for the log and stats
    traced: Any = None           # the traced graph's input specs (InputBinder.describe), once traced
    direct: Any = None           # warm_start.CachedForward of the traced graph: calls skip Dynamo
    compiler: Any = None         # what torch.compile was given (forgotten with the backend)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        direct = self.direct
        if direct is not None:
            return direct(input_ids, positions)
        if self.forward is None:
            raise RuntimeError("this engine's compiled model was released (LLM.close)")
        if self.binder is not None:  # Dynamo may trace in this call: the binder names its arguments
            self.binder.call_args = (input_ids, positions)
        out = self.forward(input_ids, positions)
        if self.traced is not None:
            self._go_direct()
        return out

    def mark(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """The token-dim marks Dynamo reads when it traces; nothing once the graph is called directly."""
        if self.direct is None and self.code is not None:
            from compile_backend import mark_token_dim
            mark_token_dim(input_ids, positions)

    def _go_direct(self) -> None:
        """Call the traced graph directly from now on, where it is the only one and its inputs are found
        again; otherwise Dynamo keeps calling it (said once in the log)."""
        from engine.worker import warm_start
        specs, self.traced = self.traced, None
        handles = self.backend.handles if self.backend is not None else []
        try:
            if len(handles) != 1 or isinstance(specs, str):
                raise ValueError(specs if isinstance(specs, str) else f"{len(handles)} graphs traced")
            self.direct = warm_start.CachedForward(handles[0], *self.binder.bind(specs))
        except ValueError as exc:
            logger.info("compiled model: Dynamo keeps calling the traced graph (%s)", exc)

    @property
    def dynamo_traced(self) -> bool:
        return self.backend is not None and self.backend.stats.graphs_compiled > 0

    def finish_cache(self) -> None:
        """After a successful start-up: keep the entry the backend wrote, if it is complete (exactly one
        traced graph, saved); otherwise drop it and say why. Never raises for the cache's sake."""
        if self.pending is None:
            return
        store, tmp, fields, sink = self.pending
        self.pending, self.binder = None, None
        from compile_backend.artifacts import remove_tree
        graphs = self.backend.stats.graphs_compiled if self.backend is not None else 0
        try:
            if graphs != 1 or sink.saved != 1 or sink.failure:
                self.cache_saved = ("not saved: " + (sink.failure or f"{graphs} graphs traced, a warm start "
                                                     "serves one"))
                remove_tree(tmp)
            else:
                entry = store.commit(tmp, fields)
                self.cache_saved = f"saved {entry}" if entry is not None else "another process saved this key"
        except OSError as exc:
            self.cache_saved = f"not saved: {exc}"
            remove_tree(tmp)
        logger.info("compile cache: %s", self.cache_saved)

    def release(self) -> None:
        if self.pending is not None:
            from compile_backend.artifacts import remove_tree
            remove_tree(self.pending[1])
            self.pending = self.binder = None
        self.direct = self.traced = None
        if self.code is not None:
            from torch._dynamo.eval_frame import remove_from_cache
            remove_from_cache(self.code)  # this engine's cache entries only: nobody else has this code
        self.forward = self.code = None
        backend, self.backend = self.backend, None
        if backend is not None:
            backend.release()
            _forget_backend(backend, self.compiler)
        self.compiler = None


def _forget_backend(backend: Any, compiler: Any = None) -> None:
    """Dynamo remembers every backend it was given (for `torch._dynamo.reset()`), wrapped by
    torch.compile; drop ours so the (already emptied) backend object itself can go too. Best effort:
    a torch without that registry just keeps a small empty object."""
    from torch._dynamo import eval_frame
    registry = getattr(eval_frame, "cached_backends", None)
    if not isinstance(registry, dict):
        return
    for key, value in list(registry.items()):
        if any(value is c or getattr(value, "compiler_fn", None) is c for c in (backend, compiler) if c is not None):
            del registry[key]


def _no_marker(input_ids: torch.Tensor, positions: torch.Tensor) -> None:
    """A loaded graph needs no token-dim marks: nothing traces it."""


def compile_model(model: torch.nn.Module, config: EngineConfig, pool: Any = None,
                  ) -> tuple[CompiledModel, Callable[..., None], Any]:
    """(compiled forward, token-dim marker to call before each forward, the backend for its stats).

    From the compile cache when it holds this model and configuration (engine/worker/warm_start.py),
    else traced by Dynamo on the first forward, compiled, and written to the cache once start-up
    succeeds (CompiledModel.finish_cache).

    `pool`: the GraphPool the backend captures into (the engine's, shared with its decode graphs);
    None lets the backend make its own.
    """
    from compile_backend import BackendConfig
    from engine.worker import warm_start

    backend_config = BackendConfig(
        piece_compiler=config.piece_compiler,
        capture_sizes=tuple(config.prefill_graph_sizes),
        cudagraphs=bool(config.prefill_graphs),
        debug_checks=debug_checks_from_env(),  # INFER_GRAPHS_DEBUG_CHECKS=1: replay and Inductor checks
    )
    binder = warm_start.InputBinder(model)
    writing = None
    if not warm_start.enabled():
        status = f"off: {warm_start.SWITCH_ENV}=0"
    else:
        found, status, writing = _look_up(model, config, backend_config, pool, binder)
        if found is not None:
            return found, _no_marker, found.backend
    logger.info("compile cache: %s", status)
    return _traced(model, backend_config, pool, binder, status, writing)


def _look_up(model: torch.nn.Module, config: EngineConfig, backend_config: Any, pool: Any, binder: Any,
             ) -> tuple[CompiledModel | None, str, tuple | None]:
    """(the CompiledModel loaded from the cache, "hit", None) on a hit; else (None, the miss's status,
    (store, a fresh temporary entry, key fields), or None where nothing can be written)."""
    from compile_backend import InferGraphsBackend
    from compile_backend.artifacts import ArtifactError, remove_tree
    from engine.worker import warm_start
    try:
        store = warm_start.graph_store()
        fields = warm_start.key_fields(model, config)
        entry = store.entry(warm_start.key_of(fields))
        if (entry / warm_start.KEY_FILE).is_file():
            backend = InferGraphsBackend(backend_config, pool=pool, warm_workers=False)
            try:
                handle, meta = backend.load(entry / "graph0", list(getattr(model, "attention_layer_names", ())))
                if meta.get("num_outputs") != 1:
                    raise ValueError(f"the cached graph returns {meta.get('num_outputs')} values, the forward one")
                forward = warm_start.CachedForward(handle, *binder.bind(meta["inputs"]))
            except (ArtifactError, ValueError, KeyError, TypeError) as exc:
                backend.release()
                remove_tree(entry)
                status = f"miss: entry {entry.name} unusable, removed ({exc})"
            else:
                store.touch(entry)
                logger.info("compile cache: hit %s (no trace, no compile)", entry)
                return CompiledModel(forward, backend, None, cache_status="hit"), "hit", None
        else:
            status = "miss: " + store.miss_reason(fields)
        return None, status, (store, store.new_entry(), fields)
    except OSError as exc:  # an unwritable cache directory: compile as before, keep nothing
        return None, f"off: {exc}", None


def _traced(model: torch.nn.Module, backend_config: Any, pool: Any, binder: Any, status: str,
            writing: tuple | None) -> tuple[CompiledModel, Callable[..., None], Any]:
    """The model under torch.compile: Dynamo traces it at the first forward; with `writing` (store,
    temporary entry, key fields), the backend writes what it compiled there for finish_cache."""
    from compile_backend import InferGraphsBackend
    from compile_backend.artifacts import ArtifactSink
    from compile_backend.backend import num_outputs

    sink = ArtifactSink(writing[1], binder.describe) if writing is not None else None
    backend = InferGraphsBackend(backend_config, pool=pool, artifacts=sink)
    template = _call_model(model)
    code = template.__code__.replace()  # a new code object: this engine's Dynamo entries live on it
    forward = types.FunctionType(code, template.__globals__, template.__name__, template.__defaults__,
                                 template.__closure__)
    result = CompiledModel(None, backend, code, cache_status=status, binder=binder,
                           pending=(*writing, sink) if writing is not None else None)

    def describing(gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        # what the engine needs to call this graph without Dynamo (CompiledModel._go_direct); read
        # before the backend runs, as its split rewrites gm
        try:
            if num_outputs(gm) != 1:
                raise ValueError("the traced graph does not return one value")
            result.traced = binder.describe(example_inputs)
        except ValueError as exc:
            result.traced = str(exc)
        return backend(gm, example_inputs)

    result.forward = torch.compile(forward, backend=describing, fullgraph=True)
    result.compiler = describing
    return result, result.mark, backend
