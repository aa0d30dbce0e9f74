"""GPU idle time between kernels, from a torch.profiler trace (used by the profiling notebook).

Within a step's window (first kernel start to last kernel end) the GPU is busy where at least one
kernel runs; the rest is idle: launch gaps the CPU could not fill. A step replayed from a CUDA
graph should be near 0; an eager decode step is mostly idle.
"""
from __future__ import annotations

from typing import Iterable


def merge_intervals(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if end < start:
            raise ValueError(f"interval ends before it starts: ({start}, {end})")
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def idle_fraction(intervals: Iterable[tuple[float, float]]) -> float:
    """1 - busy / span over the kernels' window; 0.0 for no kernels."""
    merged = merge_intervals(intervals)
    if not merged:
        return 0.0
    span = merged[-1][1] - merged[0][0]
    if span <= 0:
        return 0.0
    busy = sum(b - a for a, b in merged)
    return 1.0 - busy / span


def kernel_intervals(prof) -> list[tuple[float, float]]:
    """(start_us, end_us) of every device kernel in a finished torch.profiler.profile."""
    from torch.autograd import DeviceType
    out = []
    for event in prof.events():
        if event.device_type == DeviceType.CUDA and event.time_range.end > event.time_range.start:
            out.append((float(event.time_range.start), float(event.time_range.end)))
    return out


def per_step_idle(intervals: list[tuple[float, float]], num_steps: int) -> list[float]:
    """Split a trace of num_steps equal steps (kernels sorted by start) into steps; idle per step.

    Steps are cut at the num_steps - 1 largest gaps between kernels, which is where one step ends
    and the next begins when steps are separated by a synchronize."""
    ordered = sorted(intervals)
    if num_steps <= 1 or len(ordered) < num_steps:
        return [idle_fraction(ordered)]
    gaps = sorted(range(1, len(ordered)), key=lambda i: ordered[i][0] - ordered[i - 1][1], reverse=True)
    cuts = sorted(gaps[:num_steps - 1])
    bounds = [0, *cuts, len(ordered)]
    return [idle_fraction(ordered[a:b]) for a, b in zip(bounds, bounds[1:])]
