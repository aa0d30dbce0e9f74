"""InferGraphsBackend: the Dynamo backend object (`torch.compile(model, backend=InferGraphsBackend(cfg))`).

Per traced graph: split at the splitting ops, compile the compute pieces once for the symbolic token
count, and return a CompiledGraph that dispatches each step by the forward context's runtime mode.
The instance keeps its graphs, so `capture()`, `split_summary()` and `stats` cover everything it
compiled.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx

from compile_backend.artifacts import ArtifactSink, keeps_artifact, load_graph, save_graph
from compile_backend.compile_pieces import compile_pieces, graph_fake_inputs
from compile_backend.compiled_graph import CompiledGraph, GraphHandle, step_inputs_of
from compile_backend.config import BackendConfig
from compile_backend.pool import GraphPool, gc_frozen, pool_handle
from compile_backend.split import SplitSummary, split_graph
from compile_backend.stats import BackendStats
from custom_ops.forward_context import RuntimeMode, forward_context
from custom_ops.gemv_table import mark_trace_constants
from custom_ops.pdl import pdl_wanted

logger = logging.getLogger(__name__)

# Before any trace this backend serves (`backend="infer_graphs"` imports this module when torch.compile
# looks the name up): the ops' configuration functions Dynamo must read as constants.
mark_trace_constants()


def _warm_compile_workers() -> None:
    """Start Inductor's Triton compile workers now, while Dynamo traces, not at the first kernel of
    the first compile: what torch's own "inductor" backend does when it is called (this backend calls
    compile_fx directly, which starts them lazily). Once per process; TORCH_WARM_POOL=0 turns it off."""
    from torch._inductor.async_compile import maybe_warm_pool
    maybe_warm_pool()


# The checks Inductor writes into its generated code: each input's and each custom op result's size
# and stride, 16-byte alignment, scalar ranges: ~17 a piece, ~0.4 us each on the host (CPU box), so
# ~0.2 ms a step of a 28-layer model that runs the pieces without a graph (and at captures; never at
# replay).
# Dynamo's guards check the model's inputs and the ops' fakes are opchecked in the tests, so they are
# off unless BackendConfig.debug_checks (torch's own "reduce-overhead" mode turns size asserts off too).
_ASSERT_OPTIONS = ("size_asserts", "alignment_asserts", "scalar_asserts")


def _inductor_options(config: BackendConfig) -> contextlib.AbstractContextManager:
    """Inductor settings for this backend's compiles: programmatic dependent launch (its kernels on
    Hopper and newer launch while the previous one finishes and wait for its results in-kernel), unless
    BackendConfig.pdl or INFER_GRAPHS_PDL=0 turns it off (Inductor only emits it for sm_90+ CUDA
    devices), and the generated code's runtime asserts only under BackendConfig.debug_checks. Inductor's
    FX-graph cache key covers these settings; a torch without one of them compiles as before."""
    if config.piece_compiler != "inductor":
        return contextlib.nullcontext()
    from torch._inductor import config as inductor_config
    patches = {name: config.debug_checks for name in _ASSERT_OPTIONS if hasattr(inductor_config, name)}
    if hasattr(inductor_config.triton, "enable_pdl"):
        patches["triton.enable_pdl"] = config.pdl and pdl_wanted()
    return inductor_config.patch(patches)


def num_outputs(gm: torch.fx.GraphModule) -> int | None:
    """How many values the traced graph returns (a tuple), or None for another output structure."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    value = output.args[0]
    return len(value) if isinstance(value, (tuple, list)) else None


def _splitting_strings(gm: torch.fx.GraphModule, splitting_ops: Sequence[str]) -> list[str]:
    """The string arguments of the splitting ops' calls (attention layer names), in graph order."""
    from compile_backend.split import is_splitting_node
    ops = frozenset(splitting_ops)
    return [a for n in gm.graph.nodes if is_splitting_node(n, ops)
            for a in (*n.args, *n.kwargs.values()) if isinstance(a, str)]


class InferGraphsBackend:
    def __init__(self, config: BackendConfig | None = None, *, pool: Any = None,
                 artifacts: ArtifactSink | None = None, warm_workers: bool = True):
        """`pool`: the GraphPool (or raw handle) this backend captures into; None makes one of its own on
        first use (compile_backend/pool.py states the rule). The engine passes its own, shared with its
        decode graphs. `artifacts`: where to write each graph it compiles, for `load` in a later process
        (compile_backend/artifacts.py). `warm_workers=False`: do not start Inductor's compile workers
        (a caller that will only `load`)."""
        if config is not None and not isinstance(config, BackendConfig):
            raise TypeError(f"InferGraphsBackend expects a BackendConfig, got {type(config).__name__}")
        self.config = config or BackendConfig()
        self.stats = BackendStats()
        self.graphs: list[CompiledGraph] = []
        self._handles: list[GraphHandle] = []  # what Dynamo holds, one per graph
        self._pool = pool
        self._owns_pool = False
        self.artifacts = artifacts
        if warm_workers and self.config.piece_compiler == "inductor" and torch.cuda.is_available():
            _warm_compile_workers()

    @property
    def handles(self) -> list[GraphHandle]:
        """What each compiled or loaded graph was handed back as, in order (callable without Dynamo)."""
        return list(self._handles)

    @property
    def pool(self) -> Any:
        """The allocator handle of this backend's pool."""
        if self._pool is None:
            self._pool, self._owns_pool = GraphPool(), True
        return pool_handle(self._pool)

    def release(self) -> None:
        """Drop every compiled graph, its captured CUDA graphs and static buffers, and the pool if it
        is this backend's own. Dynamo may still hold this object (its backend registry); after
        release it holds nothing heavy. The owner must also drop the compiled callable."""
        for handle in self._handles:
            handle.cut()
        for graph in self.graphs:
            graph.release()
        self._handles.clear()
        self.graphs.clear()
        if self._owns_pool:
            self._pool.release()
        self._pool, self._owns_pool = None, False

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        with _inductor_options(self.config):
            return self._compile(gm, example_inputs)

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        start = time.perf_counter()
        input_names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        fake_mode, fake_inputs = graph_fake_inputs(example_inputs)
        keep = self.artifacts is not None
        outputs = num_outputs(gm)  # before the split, which rewrites gm
        layer_names = _splitting_strings(gm, self.config.splitting_ops)
        split = split_graph(gm, self.config.splitting_ops)
        if self.config.splitting_ops and not split.summary.num_splitting_pieces:
            logger.warning("infer_graphs: no node of %s in the traced graph; it runs as one piece",
                           ", ".join(self.config.splitting_ops))
        runners, distinct = compile_pieces(split, fake_mode, fake_inputs, self.config.piece_compiler, keep)
        step_inputs = step_inputs_of(fake_inputs, input_names)
        if keep:
            self._save(split, runners, example_inputs, {
                "input_names": input_names, "step_inputs": step_inputs, "num_outputs": outputs,
                "layer_names": layer_names})
        pool = self.pool if torch.cuda.is_available() and self.config.cudagraphs else None
        graph = CompiledGraph(split, runners, step_inputs, self.config, self.stats, pool)
        self.graphs.append(graph)
        summary = split.summary
        self.stats.graphs_compiled += 1
        self.stats.pieces += len(summary.pieces)
        self.stats.compute_pieces += summary.num_compute_pieces
        self.stats.splitting_pieces += summary.num_splitting_pieces
        self.stats.piece_compilations += distinct
        seconds = time.perf_counter() - start
        self.stats.compile_seconds += seconds
        logger.info("%s\ncompiled with %s in %.1f s (%d distinct compute pieces)", summary,
                    self.config.piece_compiler, seconds, distinct)
        handle = GraphHandle(graph)
        self._handles.append(handle)
        return handle

    def _save(self, split: Any, runners: dict[str, Any], example_inputs: Sequence[Any],
              meta: dict[str, Any]) -> None:
        """Write this graph to the artifact sink (graph i to its directory i); a graph that cannot be
        written is compiled and served all the same, and the sink says why it was not kept."""
        sink = self.artifacts
        directory = sink.directory / f"graph{self.stats.graphs_compiled}"
        start = time.perf_counter()
        try:
            unsaveable = [name for name, fn in runners.items()
                          if not keeps_artifact(fn) and name in {p.name for p in split.summary.pieces if not p.is_splitting}]
            if unsaveable:
                raise ValueError(f"compute pieces {unsaveable} have no artifact")
            if sink.describe_inputs is not None:
                meta = {**meta, "inputs": sink.describe_inputs(example_inputs)}
            directory.mkdir(parents=True, exist_ok=False)
            save_graph(directory, split, runners, meta)
        except Exception as exc:  # noqa: BLE001 - not keeping a graph never fails the compile
            sink.failure = f"graph {self.stats.graphs_compiled} not saved: {type(exc).__name__}: {exc}"
            logger.warning("infer_graphs: %s", sink.failure)
            return
        sink.saved += 1
        logger.info("infer_graphs: graph %d saved to %s in %.2f s", self.stats.graphs_compiled, directory,
                    time.perf_counter() - start)

    def load(self, directory: Any, layer_names: Sequence[str] | None = None) -> tuple[GraphHandle, dict[str, Any]]:
        """A graph `_save` wrote (the artifact sink's `graph<i>` directory), ready to be called as Dynamo
        would call it: (the callable, the meta it was saved with). `layer_names`: the string arguments
        of the splitting ops (attention layer names) the caller's model uses, in graph order, where
        they may differ from the saved model's. Raises compile_backend.artifacts.ArtifactError when
        the directory cannot be used."""
        start = time.perf_counter()
        loaded = load_graph(directory, layer_names)
        pool = self.pool if torch.cuda.is_available() and self.config.cudagraphs else None
        graph = CompiledGraph(loaded.split, loaded.runners, loaded.meta["step_inputs"], self.config, self.stats,
                              pool, piece_inputs=loaded.piece_inputs)
        self.graphs.append(graph)
        summary = loaded.split.summary
        self.stats.graphs_loaded += 1
        self.stats.pieces += len(summary.pieces)
        self.stats.compute_pieces += summary.num_compute_pieces
        self.stats.splitting_pieces += summary.num_splitting_pieces
        seconds = time.perf_counter() - start
        self.stats.load_seconds += seconds
        logger.info("infer_graphs: loaded %d pieces from %s in %.2f s (no trace, no compile)", len(summary.pieces),
                    directory, seconds)
        handle = GraphHandle(graph)
        self._handles.append(handle)
        return handle, loaded.meta

    def split_summary(self, graph_index: int = -1) -> SplitSummary:
        """The split of a compiled graph (default: the latest); print it for a readable table."""
        if not self.graphs:
            raise RuntimeError("infer_graphs: nothing compiled yet; call the compiled model once first")
        return self.graphs[graph_index].split.summary

    def captured_sizes(self) -> list[int]:
        return self.stats.captured_sizes

    def capture(self, forward_fn: Callable[[int], Any], sizes: Iterable[int] | None = None,
                attn_metadata_fn: Callable[[int], Any] | None = None, kv_caches: Any = None) -> dict[int, float]:
        """Capture the piecewise graphs of every size (default: all capture sizes), largest first.

        `forward_fn(n)` runs one forward of exactly n tokens (inputs padded to n, token dim marked);
        it is called inside a PIECEWISE forward context with num_tokens=n and the attention metadata
        `attn_metadata_fn(n)` (None: the op's no-metadata path) and the caller's `kv_caches` (layer name
        -> paged cache, which metadata needs). Sizes already captured just replay.
        Garbage collection is frozen for the loop and paused inside each capture. On CPU, or with
        cudagraphs=False, the forwards run without graphs (a warm-up). Returns size -> capture seconds.
        """
        chosen = sorted(set(self.config.capture_sizes if sizes is None else sizes), reverse=True)
        unknown = [n for n in chosen if n not in self.config.capture_sizes]
        if unknown:
            raise ValueError(f"capture sizes {unknown} are not in BackendConfig.capture_sizes "
                             f"({self.config.capture_sizes[0]}..{self.config.max_capture_size})")
        with gc_frozen():
            for n in chosen:
                meta = attn_metadata_fn(n) if attn_metadata_fn is not None else None
                with forward_context(meta, RuntimeMode.PIECEWISE, n, kv_caches):
                    forward_fn(n)
                if torch.cuda.is_available():
                    free, total = torch.cuda.mem_get_info()
                    logger.info("infer_graphs: captured %d tokens; %.2f GiB free of %.2f", n,
                                free / 2**30, total / 2**30)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {n: self.stats.capture_seconds[n] for n in chosen if n in self.stats.capture_seconds}
