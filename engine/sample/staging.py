"""host_to_device: small host lists onto the device without the host waiting for the device.

The sampler and the overlapped loop send a few per-row values every step (row indices, penalties,
top-k / top-p, a new request's prompt ids). A pageable copy to CUDA synchronizes with the stream,
so it would wait for the step's forward; a pinned copy does not, but taking a fresh pinned block
from torch's caching host allocator when none is free calls cudaHostAlloc, which may wait for the
device too (the blocks of the in-flight step stay taken until their copies have run, so a step
that stages one value more than any step before needs a new block).

So each device stages through one pinned ring buffer, allocated once: a copy takes the next slice,
and a slice is written again only after the event recorded behind its copy has completed. The host
waits only when the copies still in flight fill the whole ring (1 MiB: thousands of steps' worth of
per-row values); a value larger than a quarter of the ring takes torch's pinned path.
"""
from __future__ import annotations

import collections
import threading

import torch

RING_BYTES = 1 << 20
_ALIGN = 16  # any dtype's view of a slice starts aligned


class PinnedRing:
    """One device's staging ring: `to_device(host tensor)` -> the device copy, queued, never waited for."""

    def __init__(self, device: torch.device, capacity: int = RING_BYTES) -> None:
        self.device = device
        self.capacity = capacity
        self.buffer = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
        self.head = 0  # where the next slice starts
        self.in_flight: collections.deque[tuple[int, int, torch.cuda.Event]] = collections.deque()
        self.waits = 0  # times the ring was full and the host waited for the oldest copy
        self._lock = threading.Lock()  # engines on other threads may share the device

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        size = -(-host.numel() * host.element_size() // _ALIGN) * _ALIGN
        if size > self.capacity // 4:
            return host.pin_memory().to(self.device, non_blocking=True)
        with self._lock:
            start = self._reserve(size)
            staged = self.buffer[start:start + host.numel() * host.element_size()].view(host.dtype).view(host.shape)
            staged.copy_(host)
            out = staged.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self.in_flight.append((start, start + size, event))
            self.head = start + size
        return out

    def _reserve(self, size: int) -> int:
        """The start of `size` free bytes, in ring order after the copies still in flight."""
        while self.in_flight and self.in_flight[0][2].query():
            self.in_flight.popleft()
        while True:
            if not self.in_flight:
                return self.head if self.head + size <= self.capacity else 0
            oldest = self.in_flight[0][0]
            if self.head > oldest:  # free: [head, capacity) and [0, oldest)
                if self.head + size <= self.capacity:
                    return self.head
                if size <= oldest:
                    return 0
            elif self.head < oldest and self.head + size <= oldest:  # free: [head, oldest)
                return self.head
            # head == oldest with copies in flight: full. Wait for the oldest one.
            self.waits += 1
            self.in_flight.popleft()[2].synchronize()


_rings: dict[torch.device, PinnedRing] = {}
_rings_lock = threading.Lock()


def ring_for(device: torch.device) -> PinnedRing:
    device = torch.device(device.type, device.index if device.index is not None else torch.cuda.current_device())
    with _rings_lock:
        ring = _rings.get(device)
        if ring is None:
            ring = _rings[device] = PinnedRing(device)
        return ring


def host_to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on `device`, its copy queued behind the work already queued there, the host
    never waiting (on CUDA through the device's PinnedRing; elsewhere a plain copy)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda" or not values:
        return host.to(device)
    return ring_for(device).to_device(host)
