"""GraphPool, the one graph-memory policy, and the hygiene every capture needs.

The rule: every owner of graphs (an engine, or an InferGraphsBackend used on its own) captures all
its graphs into ONE GraphPool of its own, which lives exactly as long as the owner. An engine makes
one and hands it to its backend, so its piecewise and decode graphs share it; a backend given none
makes its own. Within a pool a graph's intermediates and (weakly held) outputs are free blocks once
its capture ends, so the next capture (smaller sizes come later) reuses them instead of growing
memory; this is safe because one owner's graphs replay one at a time, in step order. No pool is
process-wide: a closed engine's graph memory goes back to the allocator with its pool.
"""
from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Any, Iterator

import torch

_capture_streams: dict[int, torch.cuda.Stream] = {}
_live_graphs: weakref.WeakSet[torch.cuda.CUDAGraph] = weakref.WeakSet()


def new_graph() -> torch.cuda.CUDAGraph:
    """A CUDA graph counted by `live_graphs()` until it is freed. Every graph this project captures
    is made here: NCCL cannot leave a communicator while a graph that captured one of its collectives
    lives (engine.distributed.rank_loop.leave_process_group), so a closed engine must be seen to hold none."""
    graph = torch.cuda.CUDAGraph()
    _live_graphs.add(graph)
    return graph


def live_graphs() -> int:
    """How many graphs made by `new_graph()` this process still holds (a graph in a reference cycle
    counts until a collection frees it)."""
    return len(_live_graphs)


class GraphPool:
    """A private CUDA graph memory pool that stays valid for as long as this object lives.

    A handle from `graph_pool_handle()` alone does not keep its pool alive: once every graph captured
    into it is freed (a failed capture dropped, a measurement thrown away), the allocator retires the
    pool and the next capture with that handle fails an internal assert (`use_count > 0`, measured on
    torch 2.11). A tiny graph captured into it at creation and held here keeps it valid; it records
    one kernel on a 4-byte tensor allocated outside the pool, so it costs the pool no memory. Drop
    the object (or `release()`) and the pool goes once its last graph is gone."""

    def __init__(self) -> None:
        self.handle: Any = torch.cuda.graph_pool_handle()
        self._flag = torch.zeros(1, device="cuda")
        self._keepalive: torch.cuda.CUDAGraph | None = new_graph()
        stream = capture_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._flag.add_(1)  # warm-up: the kernel is loaded before the capture, not inside it
        with torch.cuda.stream(stream), gc_paused():
            self._keepalive.capture_begin(pool=self.handle)
            try:
                self._flag.add_(1)
            finally:
                self._keepalive.capture_end()
        torch.cuda.current_stream().wait_stream(stream)

    def release(self) -> None:
        self._keepalive = None


def pool_handle(pool: Any) -> Any:
    """The allocator's handle of a GraphPool (a raw handle passes through)."""
    return pool.handle if isinstance(pool, GraphPool) else pool


def capture_stream() -> torch.cuda.Stream:
    """One side stream per device for captures (capture is illegal on the legacy default stream);
    warm-ups run on it too so lazily created per-stream state (cuBLAS workspaces) exists before capture."""
    device = torch.cuda.current_device()
    stream = _capture_streams.get(device)
    if stream is None:
        stream = _capture_streams[device] = torch.cuda.Stream(device)
    return stream


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No garbage collection inside a capture: a collected cycle may free a tensor whose block the
    capture already recorded, and the graph would then read or write memory someone else owns."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


_frozen_depth = 0


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """For a loop of captures: collect, then freeze the survivors so collections that still run
    between captures skip them (a capture loop makes many short-lived objects).

    Nestable: inside an outer freeze the collection only visits what was made since (a full one of a
    process that has traced a model costs ~0.15-0.2 s), and only the outermost exit unfreezes. An
    engine holds one from its first capture (or, without graphs, the end of its compile) until it
    closes, so a serving step never pays for a collection over the compiled model (engine.worker.startup)."""
    global _frozen_depth
    gc.collect()
    gc.freeze()
    _frozen_depth += 1
    try:
        yield
    finally:
        _frozen_depth -= 1
        if _frozen_depth == 0:
            gc.unfreeze()


def reserved_bytes() -> int:
    """The caching allocator's reserved bytes on the current device. `torch.cuda.memory_reserved()`
    reads the same number after flattening every allocator statistic into a sorted dict in Python
    (~0.3 ms); a piecewise start-up asks twice per piece capture, ~2,800 times."""
    stats = torch.cuda.memory_stats_as_nested_dict()
    return stats.get("reserved_bytes", {}).get("all", {}).get("current", 0)


def pool_bytes(pool: Any) -> int:
    """Bytes of device memory reserved by `pool` (a GraphPool or a handle), from the allocator's
    segment list. Costs a memory snapshot: for reports, not for the step path."""
    if not torch.cuda.is_available() or pool is None:
        return 0
    handle = tuple(pool_handle(pool))
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", ())) == handle)


def weak_tensor(t: torch.Tensor) -> torch.Tensor:
    """A tensor over the same memory that does not own it, so a piece output captured for one size
    does not pin its block: later captures may reuse it; replays rewrite it before anyone reads it."""
    storage = t.untyped_storage()
    meta = {
        "nbytes": storage.nbytes(), "data_ptr": storage.data_ptr(), "size": t.shape,
        "stride": t.stride(), "dtype": t.dtype, "device": t.device, "storage_offset": t.storage_offset(),
    }
    weak_storage = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    return torch._C._construct_CUDA_Tensor_From_Storage_And_Metadata(meta, weak_storage)
