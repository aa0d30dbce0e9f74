"""engine.sample.staging: the pinned ring never hands out bytes whose copy may still be in flight, waits only
when the copies in flight fill it, and (on a GPU) stages values behind queued work without waiting."""
from __future__ import annotations

import collections
import random
import threading

import pytest
import torch

from engine.sample.staging import PinnedRing, host_to_device


class FakeEvent:
    """A copy's completion: done when the test says so; synchronize() completes it (and counts)."""

    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


def _cpu_ring(capacity: int) -> PinnedRing:
    ring = PinnedRing.__new__(PinnedRing)  # the reservation logic alone: no pinned buffer, no CUDA
    ring.capacity, ring.head, ring.waits = capacity, 0, 0
    ring.in_flight = collections.deque()
    ring._lock = threading.Lock()
    return ring


def _take(ring: PinnedRing, size: int) -> tuple[int, int, FakeEvent]:
    start = ring._reserve(size)
    event = FakeEvent()
    ring.in_flight.append((start, start + size, event))
    ring.head = start + size
    return start, start + size, event


def test_ring_slices_never_overlap_a_copy_in_flight_and_wait_only_when_full():
    rng = random.Random(0)
    ring = _cpu_ring(1024)
    live: list[tuple[int, int, FakeEvent]] = []
    for _ in range(2000):
        while live and rng.random() < 0.45:  # copies on one stream complete in order
            next(item for item in live if not item[2].done)[2].done = True
            live = [item for item in live if not item[2].done]
        size = rng.choice([16, 32, 48, 128, 256])
        in_flight_before = sum(e - s for s, e, ev in live if not ev.done)
        start, end, event = _take(ring, size)
        assert 0 <= start and end <= ring.capacity
        for s, e, ev in live:
            if not ev.done:
                assert end <= s or e <= start, f"slice [{start}, {end}) overwrites [{s}, {e}) still in flight"
        if any(ev.waited for _, _, ev in live):
            # a wait is allowed only when the bytes in flight left no room for this slice
            assert in_flight_before + size > ring.capacity - 256 - 16
            for _, _, ev in live:
                ev.waited = False
        live = [item for item in live if not item[2].done] + [(start, end, event)]
    assert ring.waits > 0  # the full ring was exercised too


def test_ring_reuses_the_space_of_completed_copies_without_waiting():
    ring = _cpu_ring(256)
    for _ in range(100):
        _, _, event = _take(ring, 48)
        event.done = True  # each copy ran before the next is staged
    assert ring.waits == 0


def test_ring_waits_for_the_oldest_copy_when_full():
    ring = _cpu_ring(128)
    events = [_take(ring, 64)[2] for _ in range(2)]
    start, _, _ = _take(ring, 64)
    assert ring.waits == 1 and events[0].waited and not events[1].waited
    assert start == 0


def test_host_to_device_off_cuda_is_a_plain_tensor():
    out = host_to_device([3, 1, 2], torch.int64, torch.device("cpu"))
    assert out.tolist() == [3, 1, 2] and out.dtype == torch.int64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_values_staged_behind_queued_work_arrive_and_the_host_never_waits():
    device = torch.device("cuda", torch.cuda.current_device())
    host_to_device([0], torch.int64, device)  # the ring exists before the measured part
    from engine.sample.staging import ring_for
    ring = ring_for(device)
    waits = ring.waits
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued ahead of every copy below
    rng = random.Random(1)
    sent = [[rng.randrange(-2**40, 2**40) for _ in range(rng.randrange(1, 300))] for _ in range(200)]
    sent.append(list(range(40_000)))  # larger than a quarter of the ring: torch's pinned path
    outs = [host_to_device(values, torch.int64, device) for values in sent]
    floats = host_to_device([0.5, -1.25, 3.0], torch.float32, device)
    done = torch.cuda.Event()
    done.record()
    assert not done.query(), "staging waited for the device"
    assert ring.waits == waits
    torch.cuda.synchronize()
    assert [o.tolist() for o in outs] == sent
    assert floats.tolist() == [0.5, -1.25, 3.0]
