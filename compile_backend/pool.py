"""The process-wide CUDA graph memory pool (a backend's default) and the hygiene every capture needs.

The graphs of one owner capture into ONE private pool: a graph's intermediates and (weakly held)
outputs are free blocks of that pool once its capture ends, so the next capture (smaller sizes come
later) reuses them instead of growing memory. This is safe because those graphs replay one at a
time, in step order. A backend given no pool uses the process-wide one; an engine passes a pool of
its own, shared by its piecewise and decode graphs (engine/runtime.py says why).
"""
from __future__ import annotations

import contextlib
import gc
from typing import Any, Iterator

import torch

_pool: Any = None
_pool_keepalive: list[Any] = []   # a tiny graph captured into the pool, never released
_capture_streams: dict[int, torch.cuda.Stream] = {}


def graph_pool() -> Any:
    """The process-wide graph pool handle: the default pool of an InferGraphsBackend given none.

    A handle from `graph_pool_handle()` does not keep its pool alive: once every graph captured into
    it is freed (a backend dropped, `torch._dynamo.reset()`), the allocator retires the pool and the
    next capture with that handle fails an internal assert. One tiny graph captured into it at
    creation and held for the life of the process keeps the shared pool valid for everyone."""
    global _pool
    if _pool is None:
        handle = torch.cuda.graph_pool_handle()
        flag = torch.zeros(1, device="cuda")
        keepalive = torch.cuda.CUDAGraph()
        with torch.cuda.graph(keepalive, pool=handle):
            flag.add_(1)
        _pool_keepalive.extend((keepalive, flag))
        _pool = handle
    return _pool


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


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """For a loop of captures: collect once, then freeze the survivors so collections that still
    run between captures skip them (a capture loop makes many short-lived objects)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def pool_bytes(pool: Any = None) -> int:
    """Bytes of device memory reserved by `pool` (default: the process-wide one), from the allocator's
    segment list. Costs a memory snapshot: for reports, not for the step path."""
    if not torch.cuda.is_available():
        return 0
    pool = graph_pool() if pool is None else pool
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", ())) == tuple(pool))


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
