"""StartupTimeline: where an engine's start-up time and memory go, phase by phase.

Each phase (load, tokenizer, setup, compile cache: the compiled graph loaded or looked up, buffers,
compile: Dynamo and the backend at the first step unless the graph was loaded, warm-up, gc freeze:
one collection before the capture phases, piecewise capture, decode-graph measure, KV pool, decode
capture) is timed with perf_counter and, on CUDA, ends with a synchronize so that asynchronous work is
charged to the phase that queued it; its line at INFO gives the seconds and the device memory allocated when it ended. `as_dict()`
is `LLM.stats()["startup"]`: the phases in order, their sum and the total measured from the start of
`LLM(...)` to ready, so time that no phase accounts for shows as the difference, and the start-up's
notes (`compile_cache`, `dynamo_traced`, `compile_cache_saved`: engine/worker/warm_start.py).
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch

logger = logging.getLogger("engine")


@dataclass
class Phase:
    name: str
    seconds: float
    allocated_bytes: int   # device memory allocated when the phase ended (0 on CPU)
    delta_bytes: int       # change over the phase


class StartupTimeline:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.phases: list[Phase] = []
        self.total_seconds: float | None = None
        self.device: torch.device | None = None  # set once known; memory is read on CUDA only
        self.notes: dict[str, Any] = {}  # facts of this start-up (compile_cache, dynamo_traced), in as_dict

    def _allocated(self) -> int:
        if self.device is None or self.device.type != "cuda":
            return 0
        return torch.cuda.memory_allocated(self.device)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        before = self._allocated()
        start = time.perf_counter()
        yield
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        after = self._allocated()
        self.phases.append(Phase(name, seconds, after, after - before))
        logger.info("start-up: %-18s %7.2f s   allocated %8.1f MiB (%+.1f)", name, seconds, after / 2**20,
                    (after - before) / 2**20)

    def finish(self) -> None:
        self.total_seconds = time.perf_counter() - self.start
        accounted = sum(p.seconds for p in self.phases)
        logger.info("start-up: ready in %.2f s (%.2f s in the phases above)", self.total_seconds, accounted)

    def as_dict(self) -> dict[str, Any]:
        return {
            "phases": [{"name": p.name, "seconds": p.seconds, "allocated_bytes": p.allocated_bytes,
                        "delta_bytes": p.delta_bytes} for p in self.phases],
            "phases_seconds": sum(p.seconds for p in self.phases),
            "total_seconds": self.total_seconds,
            **self.notes,
        }
