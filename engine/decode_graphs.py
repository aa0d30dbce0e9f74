"""DecodeGraphs: one native CUDA graph per decode batch bucket around forward + compute_logits.

Each graph reads the runner's static buffers (sliced to its batch size) and writes its logits into
one static `[max batch, V]` buffer allocated outside the graph pool, so the pool only holds a
graph's intermediates and every smaller graph reuses the memory of the largest: capture goes
largest-first into the engine's graph pool (shared with its piecewise graphs), with garbage collection
frozen and disabled (a collection during capture could free a tensor the graph records). The model
runs under a FULL forward context, so the backend's pieces pass straight through and this capture
records everything, attention kernels included.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections import Counter
from typing import Iterator

import torch

from custom_ops import RuntimeMode

logger = logging.getLogger("engine")


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    """The backend's capture-loop guards: survivors frozen, collection paused while recording."""
    from compile_backend.pool import gc_frozen, gc_paused  # lazy: compile_backend is slow to import
    with gc_frozen(), gc_paused():
        yield


def free_memory_gib(device: torch.device) -> float:
    return torch.cuda.mem_get_info(device)[0] / 2**30


class DecodeGraphs:
    def __init__(self, runner, pool) -> None:  # runner: engine.model_runner.ModelRunner
        self.runner = runner
        self.pool = pool
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None
        self.capture_seconds = 0.0
        self.graph_bytes = 0
        self.replays = 0
        self.replays_by_size: Counter[int] = Counter()
        self.stream = torch.cuda.Stream(runner.device)  # side stream: capture is illegal on the default one

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.graphs))

    def _record(self, batch_size: int) -> torch.cuda.CUDAGraph:
        """Warm up once eagerly, then capture the decode forward for batch_size rows."""
        runner = self.runner
        meta = runner.load_dummy(batch_size, batch_size, uniform_decode=True)
        # Warm-up outside capture, on the capture stream: lazy initialisation (kernel autotuning,
        # Dynamo guards, per-stream cuBLAS workspaces) must exist before the graph, not inside it.
        self.stream.wait_stream(torch.cuda.current_stream(runner.device))
        with torch.cuda.stream(self.stream):
            hidden = runner.run_forward(meta, RuntimeMode.FULL, batch_size)
            logits = runner.model.compute_logits(hidden)
            if self.logits is None:
                self.logits = torch.empty((runner.buffers.max_seqs, logits.shape[-1]), dtype=logits.dtype,
                                          device=logits.device)
            del hidden, logits
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            hidden = runner.run_forward(meta, RuntimeMode.FULL, batch_size)
            self.logits[:batch_size].copy_(runner.model.compute_logits(hidden))
        return graph

    def measure(self, batch_size: int) -> int:
        """Bytes a capture of batch_size takes and gives back when dropped, from a throwaway capture.

        Run before the KV pool exists (the real graphs must record the pool's address); what the
        throwaway capture keeps cached stays counted by the free-memory probe, so only what it gave
        back has to be reserved.
        """
        device = self.runner.device
        torch.cuda.synchronize(device)
        with frozen_gc():
            graph = self._record(batch_size)
        torch.cuda.synchronize(device)
        free_captured = torch.cuda.mem_get_info(device)[0]
        del graph
        self.logits = None
        torch.cuda.empty_cache()
        return max(0, torch.cuda.mem_get_info(device)[0] - free_captured)

    def capture(self, sizes: tuple[int, ...], show_progress: bool) -> None:
        device = self.runner.device
        torch.cuda.synchronize(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        start = time.perf_counter()
        ordered = sorted(sizes, reverse=True)  # largest first: smaller graphs reuse its pool memory
        bar = None
        if show_progress:
            from tqdm import tqdm
            bar = tqdm(total=len(ordered), desc="decode graphs", unit="graph", file=sys.stderr, leave=False)
        try:
            with frozen_gc():
                for batch_size in ordered:
                    if bar is not None:
                        bar.set_postfix_str(f"batch {batch_size}, free {free_memory_gib(device):.2f} GiB")
                    self.graphs[batch_size] = self._record(batch_size)
                    if bar is not None:
                        bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - start
        self.graph_bytes = max(0, free_before - torch.cuda.mem_get_info(device)[0])
        line = (f"captured {len(self.graphs)} decode graphs (batch {ordered[-1]}..{ordered[0]}) in "
                f"{self.capture_seconds:.2f} s, graph memory {self.graph_bytes / 2**20:.1f} MiB")
        if show_progress:
            print(line, file=sys.stderr)
        logger.info(line)

    def release(self) -> None:
        self.graphs.clear()
        self.logits = None

    def replay(self, batch_size: int, num_real: int) -> torch.Tensor:
        """Replay the bucket's graph (the step's values are already in the static buffers)."""
        self.graphs[batch_size].replay()
        self.replays += 1
        self.replays_by_size[batch_size] += 1
        return self.logits[:num_real]
