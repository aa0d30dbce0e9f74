"""Where a step's time goes on a timeline: one call under torch.profiler, with the engine's stages marked.

`profile_stages(fn, prefix, stages)` runs fn() under torch.profiler (CPU and, where present, CUDA), each
(owner, method name, label) of `stages` wrapped for the call in a record_function range of that label,
and writes prefix.json.gz (a chrome trace: chrome://tracing or ui.perfetto.dev) and prefix.txt:
- each stage's CPU time per call (median, p90, count);
- the GPU's idle gaps between kernels (median, p90, how many, their sum per step where a "step" stage is
  marked): time the device waited for the host;
- the exposed host chain: from the end of each "wait" range (the host has read the step before) to the
  next cudaGraphLaunch, and to the first kernel that starts after it: the host work that nothing hides;
- the top kernels and CPU ops by total time.
Used by bench spec (BENCH_SPEC_PROFILE): a verify step waits for the step before it, so its host work is
on the device's critical path, unlike a plain decode step's.
"""
from __future__ import annotations

import contextlib
import gzip
import os
import shutil
import statistics
from typing import Callable, Iterable

import torch

from bench.profiling import merge_intervals


@contextlib.contextmanager
def marked(stages: Iterable[tuple[object, str, str]]):
    """Each (owner, name, label): owner.name wrapped in record_function(label) inside the block."""
    undo = []
    try:
        for owner, name, label in stages:
            original, own = getattr(owner, name), name in vars(owner)  # before the wrapper shadows it

            def wrapper(*args, __original=original, __label=label, **kwargs):
                with torch.profiler.record_function(__label):
                    return __original(*args, **kwargs)
            setattr(owner, name, wrapper)
            undo.append((owner, name, original, own))
        yield
    finally:
        for owner, name, original, own in reversed(undo):
            if not own and not isinstance(owner, type):
                delattr(owner, name)  # the wrapper shadowed a method of the instance's class
            else:
                setattr(owner, name, original)


def _quantiles(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return (f"median {statistics.median(ordered):8.1f} us  p90 {ordered[int(0.9 * (len(ordered) - 1))]:8.1f} us  "
            f"n {len(ordered)}")


def summarize(events, labels: list[str]) -> str:
    from torch.autograd import DeviceType
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    kernels = sorted((float(e.time_range.start), float(e.time_range.end), e.name) for e in events
                     if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    lines = ["## stages (CPU time per call)"]
    ranges = {label: sorted((float(e.time_range.start), float(e.time_range.end)) for e in cpu if e.name == label)
              for label in labels}
    for label in labels:
        lines.append(f"{label:>14}: {_quantiles([b - a for a, b in ranges[label]])}")
    steps = len(ranges.get("step", [])) or 1
    busy = merge_intervals((start, stop) for start, stop, _ in kernels)
    big = [b[0] - a[1] for a, b in zip(busy, busy[1:]) if b[0] - a[1] > 5.0]
    lines += ["", "## GPU idle gaps between kernels (> 5 us)", _quantiles(big),
              f"sum {sum(big) / steps:.1f} us per step over {steps} steps; kernels {len(kernels)} "
              f"({len(kernels) / steps:.1f} per step)"]
    launches = sorted(float(e.time_range.start) for e in cpu if e.name == "cudaGraphLaunch")
    to_launch, to_kernel = [], []
    for _, wait_end in ranges.get("wait", []):
        nxt = next((t for t in launches if t >= wait_end), None)
        if nxt is not None:
            to_launch.append(nxt - wait_end)
        first = next((s for s, _, _ in kernels if s >= wait_end), None)
        if first is not None:
            to_kernel.append(first - wait_end)
    lines += ["", "## exposed host chain: from a wait's end (the step before read) to",
              f"   the next cudaGraphLaunch: {_quantiles(to_launch)}",
              f"   the next kernel's start:  {_quantiles(to_kernel)}"]
    return "\n".join(lines)


def profile_stages(fn: Callable[[], object], prefix: str, stages: list[tuple[object, str, str]]) -> object:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with marked(stages), torch.profiler.profile(activities=activities) as prof:
        result = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    prof.export_chrome_trace(prefix + ".json")
    with open(prefix + ".json", "rb") as src, gzip.open(prefix + ".json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(prefix + ".json")
    averages = prof.key_averages()
    text = [summarize(prof.events(), [label for _, _, label in stages]), "",
            "## top CPU ops by self time", averages.table(sort_by="self_cpu_time_total", row_limit=25)]
    if torch.cuda.is_available():
        text += ["", "## top kernels by device time", averages.table(sort_by="self_cuda_time_total", row_limit=25)]
    with open(prefix + ".txt", "w") as f:
        f.write("\n".join(text) + "\n")
    return result
