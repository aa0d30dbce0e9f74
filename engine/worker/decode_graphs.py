"""DecodeGraphs: one native CUDA graph per decode batch bucket around forward + compute_logits.

Each graph reads the runner's static buffers (sliced to its batch size) and writes its logits into
one static `[max batch, V]` buffer allocated outside the graph pool, so the pool only holds a
graph's intermediates and every smaller graph reuses the memory of the largest: capture goes
largest-first into the engine's graph pool (shared with its piecewise graphs), with garbage collection
frozen and paused (a collection during capture could free a tensor the graph records). The model
runs under a FULL forward context carrying the engine's own KV caches (and, with a KV pool per layer
kind, each group's slot mapping and block tables: engine.kv.groups, ModelRunner.forward_context), so
the backend's pieces pass straight through and this capture records everything, attention kernels
and KV addresses included.

Where the LM head runs the skinny GEMM with one K split (2-64 rows, models.base.CausalLM.argmax_key_tiles),
the graph also stores each vocabulary tile's argmax key per row into a static buffer, and the sampler
takes greedy tokens from those keys (custom_ops.triton_argmax.argmax_of_keys) instead of reading the
logits again: gemma-3-1b's 262,144-wide rows are 2,048 keys.

Cost (what keeps a capture cheap): the dummy decode metadata is loaded ONCE at the largest batch (the
rows of a smaller batch hold the same values, so its metadata is a slice); every size gets one eager
warm-up forward, all queued back to back on the capture stream with no synchronize between them,
then one synchronize, then the captures, again with none between them. The per-size warm-up stays
because lazy initialisation is per size: our Triton kernels specialize on values that change with
the batch (the decode split count is a constexpr; ints equal to 1 or divisible by 16), and compiling
or loading a kernel inside a capture is not allowed. `torch.cuda.graph` is not used: its entry
synchronizes and empties the allocator cache for every graph, so each capture would first wait for
the GPU and then cudaMalloc its memory again.
"""
from __future__ import annotations

import dataclasses

import contextlib
import logging
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from custom_ops import AttentionMetadata, RuntimeMode

logger = logging.getLogger("engine")


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    """The backend's capture-loop guards: survivors frozen, collection paused while recording."""
    from compile_backend.pool import gc_frozen, gc_paused  # lazy: compile_backend is slow to import
    with gc_frozen(), gc_paused():
        yield


def free_memory_gib(device: torch.device) -> float:
    return torch.cuda.mem_get_info(device)[0] / 2**30


@dataclass
class CaptureRun:
    """One capture loop's progress bar, and after it the loop's seconds and the memory its graphs hold."""
    show_progress: bool
    bar: Any = None
    seconds: float = 0.0
    graph_bytes: int = 0

    def tick(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def report(self, line: str) -> None:
        if self.show_progress:
            print(line, file=sys.stderr)
        logger.info(line)


@contextlib.contextmanager
def capture_run(device: torch.device, total: int, desc: str, show_progress: bool) -> Iterator[CaptureRun]:
    """The guards and the accounting every capture loop shares: garbage collection frozen and paused,
    a progress bar of `total` graphs, and (once the loop ended without an error) its time and the
    device memory it took."""
    torch.cuda.synchronize(device)
    free_before = torch.cuda.mem_get_info(device)[0]
    start = time.perf_counter()
    run = CaptureRun(show_progress)
    if show_progress:
        from tqdm import tqdm
        run.bar = tqdm(total=total, desc=desc, unit="graph", file=sys.stderr, leave=False)
    try:
        with frozen_gc():
            yield run
    finally:
        if run.bar is not None:
            run.bar.close()
    torch.cuda.synchronize(device)
    run.seconds = time.perf_counter() - start
    run.graph_bytes = max(0, free_before - torch.cuda.mem_get_info(device)[0])


class DecodeGraphs:
    def __init__(self, runner, pool, store_first: bool = False) -> None:
        """runner: engine.worker.model_runner.ModelRunner; pool: a handle. `store_first`: the graphs of
        speculative decoding's verify steps, whose rows may share a sequence (AttentionMetadata.store_first)."""
        from compile_backend.pool import capture_stream
        self.runner = runner
        self.pool = pool
        self.store_first = store_first
        self.kind = "verify graphs" if store_first else "decode graphs"
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None
        # Where the LM head's kernel stores per-tile argmax keys (CausalLM.argmax_key_tiles): batch size ->
        # keys per row, and one flat buffer, outside the pool like the logits, that each size views.
        self.key_tiles: dict[int, int] = {}
        self._keys: torch.Tensor | None = None
        self.capture_seconds = 0.0
        self.graph_bytes = 0
        self.replays = 0
        self.replays_by_size: Counter[int] = Counter()
        # The backend's one capture stream per device (capture is illegal on the default stream):
        # a new stream per engine would also get a new cuBLAS workspace that outlives the engine.
        with torch.cuda.device(runner.device):
            self.stream = capture_stream()

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.graphs))

    def _metadata(self, batch_sizes: list[int]) -> dict[int, AttentionMetadata]:
        """Dummy decode metadata per size, from ONE load at the largest size (block 0 only)."""
        runner, largest = self.runner, max(batch_sizes)
        runner.load_dummy(largest, largest, uniform_decode=True)
        metas = {b: runner.buffers.metadata(b, b, b, 1, runner.max_model_len, True) for b in batch_sizes}
        if self.store_first:
            metas = {b: dataclasses.replace(m, store_first=True) for b, m in metas.items()}
        return metas

    def _forward(self, meta: AttentionMetadata, batch_size: int) -> torch.Tensor:
        """The forward and the LM head into the static logits (and argmax keys, where stored)."""
        hidden = self.runner.run_forward(meta, RuntimeMode.FULL, batch_size)
        keys = self.keys_view(batch_size)
        out = self.logits[:batch_size]
        if keys is None:
            return self.runner.model.compute_logits(hidden, out=out)
        return self.runner.model.compute_logits(hidden, out=out, keys=keys)

    def keys_view(self, batch_size: int) -> torch.Tensor | None:
        """The argmax keys [batch_size, tiles] of the size's graph, or None if its LM head stores none."""
        tiles = self.key_tiles.get(batch_size)
        if tiles is None or self._keys is None:
            return None
        return self._keys[:batch_size * tiles].view(batch_size, tiles)

    def _key_tiles_of(self, batch_size: int) -> int | None:
        tiles_of = getattr(self.runner.model, "argmax_key_tiles", None)  # a models.base.CausalLM's
        return tiles_of(batch_size) if tiles_of is not None else None

    def _allocate_outputs(self, logits: torch.Tensor) -> None:
        """The static logits [max batch, V] (shaped like an eager forward's `logits`) and a keys buffer
        for the most any batch size stores. Allocated once: a graph keeps the addresses it recorded."""
        max_seqs = self.runner.max_seqs
        self.logits = torch.empty((max_seqs, logits.shape[-1]), dtype=logits.dtype, device=logits.device)
        words = max(((self._key_tiles_of(b) or 0) * b for b in range(2, max_seqs + 1)), default=0)
        self._keys = torch.empty(words, dtype=torch.int64, device=logits.device) if words else None

    def _warm_up(self, metas: dict[int, AttentionMetadata]) -> None:
        """One eager forward per size, queued on the capture stream without waiting in between (the
        first size's also once without the static outputs, which it sizes)."""
        self.stream.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(self.stream):
            if self.logits is None:
                batch_size, meta = next(iter(metas.items()))
                hidden = self.runner.run_forward(meta, RuntimeMode.FULL, batch_size)
                self._allocate_outputs(self.runner.model.compute_logits(hidden))
                del hidden
            for batch_size, meta in metas.items():
                tiles = self._key_tiles_of(batch_size)
                if tiles is None or self._keys is None or batch_size * tiles > self._keys.numel():
                    self.key_tiles.pop(batch_size, None)
                else:
                    self.key_tiles[batch_size] = tiles
                self._forward(meta, batch_size)
        self.stream.synchronize()

    def _record(self, meta: AttentionMetadata, batch_size: int) -> torch.cuda.CUDAGraph:
        from compile_backend.pool import new_graph
        graph = new_graph()
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=self.pool)
            try:
                # The LM head writes the static logits itself: no copy pass over the vocabulary.
                self._forward(meta, batch_size)
            finally:
                graph.capture_end()
        return graph

    def measure(self, batch_size: int) -> int:
        """Bytes a capture of batch_size takes and gives back when dropped, from a throwaway capture.

        Run before the KV pool exists (the real graphs must record the pool's address); what the
        throwaway capture keeps cached stays counted by the free-memory probe, so only what it gave
        back has to be reserved.
        """
        device = self.runner.device
        metas = self._metadata([batch_size])
        with frozen_gc():
            self._warm_up(metas)
            graph = self._record(metas[batch_size], batch_size)
        torch.cuda.synchronize(device)
        free_captured = torch.cuda.mem_get_info(device)[0]
        del graph
        self.logits = self._keys = None
        self.key_tiles.clear()
        torch.cuda.empty_cache()
        return max(0, torch.cuda.mem_get_info(device)[0] - free_captured)

    def capture(self, sizes: tuple[int, ...], show_progress: bool) -> None:
        device = self.runner.device
        ordered = sorted(sizes, reverse=True)  # largest first: smaller graphs reuse its pool memory
        with capture_run(device, len(ordered), self.kind, show_progress) as run:
            metas = self._metadata(ordered)
            self._warm_up(metas)
            for batch_size in ordered:
                self.graphs[batch_size] = self._record(metas[batch_size], batch_size)
                run.tick()
        self.capture_seconds, self.graph_bytes = run.seconds, run.graph_bytes
        run.report(f"captured {len(self.graphs)} {self.kind} (batch {ordered[-1]}..{ordered[0]}) in "
                   f"{self.capture_seconds:.2f} s ({self.capture_seconds / len(ordered) * 1e3:.0f} ms each), "
                   f"graph memory {self.graph_bytes / 2**20:.1f} MiB, {free_memory_gib(device):.2f} GiB free")

    def release(self) -> None:
        self.graphs.clear()
        self.logits = self._keys = None
        self.key_tiles.clear()

    def replay(self, batch_size: int, num_real: int) -> torch.Tensor:
        """Replay the bucket's graph (the step's values are already in the static buffers)."""
        self.graphs[batch_size].replay()
        self.replays += 1
        self.replays_by_size[batch_size] += 1
        return self.logits[:num_real]

    def argmax_keys(self, batch_size: int, num_real: int) -> torch.Tensor | None:
        """The last replay's argmax keys of its first num_real rows (custom_ops.triton_argmax), or None."""
        keys = self.keys_view(batch_size)
        return None if keys is None else keys[:num_real]
