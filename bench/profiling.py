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


# ---- kernel census: how many kernels of which kind one step launches -------------------------------

# (kind, substrings of the lower-cased kernel name), first match wins. Inductor's kernels are named
# triton_{poi,per,red}_fused_<aten ops> (triton_tem_ for its matmul templates), so a norm is an Inductor
# kernel with rsqrt in it; our own Triton kernels carry their Python names (custom_ops/triton_*.py).
# cuBLAS: nvjet_* (Hopper), *gemm*/*gemv*, cutlass/xmma, and splitKreduce_kernel after a split-K GEMM.
_KIND_PATTERNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention_merge", ("merge_splits",)),
    ("attention", ("_decode_kernel", "_prefill_kernel", "flash", "fmha", "attention")),
    ("kv_store", ("store_kv",)),
    ("rope", ("_qk_norm_rope",)),
    ("gemm", ("triton_tem_", "_gemv_kernel", "_gemv_rope_kernel", "_skinny_kernel", "_splitk_gemv")),
    ("norm", ("_add_rms_norm",)),  # ours, and below: an Inductor kernel with rsqrt or a norm in its name
    ("fused_elementwise", ()),  # decided below: any other Inductor kernel
    ("gemm_splitk_reduce", ("splitkreduce",)),
    ("gemm", ("nvjet", "gemm", "gemv", "cutlass", "xmma", "cublas")),
    ("copy", ("memcpy", "memset", "copy_kernel", "catarraybatchedcopy")),
    ("reduce", ("reduce_kernel", "argmax", "argmin", "softmax", "sort", "scan", "topk")),
    ("elementwise", ("elementwise_kernel",)),
)
# Display order: the matmuls, attention, then the small kernels fusion is about.
KERNEL_KINDS: tuple[str, ...] = ("gemm", "gemm_splitk_reduce", "attention", "attention_merge", "kv_store", "rope", "norm",
                                 "fused_elementwise", "copy", "reduce", "elementwise", "other")
_INDUCTOR_PREFIXES = ("triton_poi_", "triton_per_", "triton_red_", "triton_for_")


def classify_kernel(name: str) -> str:
    """The kind of one GPU kernel (one of KERNEL_KINDS) from its name as the profiler reports it."""
    low = name.lower()
    inductor = low.startswith(_INDUCTOR_PREFIXES)
    for kind, patterns in _KIND_PATTERNS:
        if kind == "norm":
            if (inductor and ("rsqrt" in low or "norm" in low)) or any(p in low for p in patterns):
                return kind
        elif kind == "fused_elementwise":
            if inductor:
                return kind
        elif any(p in low for p in patterns):
            return kind
    return "other"


def kernel_events(prof) -> list[tuple[str, float]]:
    """(name, duration_us) of every device kernel, memcpy and memset in a finished torch.profiler.profile."""
    from torch.autograd import DeviceType
    return [(event.name, float(event.time_range.end - event.time_range.start))
            for event in prof.events() if event.device_type == DeviceType.CUDA]


def kernel_census(events: Iterable[tuple[str, float]], num_steps: int, num_layers: int) -> list[dict]:
    """Kernels per step and per layer, and GPU microseconds per step, by kind, from the device events
    of `num_steps` identical steps of a model with `num_layers` decoder layers.

    One row per kind that occurs (in KERNEL_KINDS order), then a "total" row. `per_layer` is the
    per-step count over the layers: a kind launched once per layer reads 1.0, one launched once per
    step (the LM head, the sampler) 1 / num_layers. `names` lists the distinct kernel names of the
    kind (shortened), so a reader sees what was counted."""
    if num_steps < 1 or num_layers < 1:
        raise ValueError(f"kernel_census needs num_steps >= 1 and num_layers >= 1, got {num_steps}, {num_layers}")
    counts: dict[str, int] = {}
    micros: dict[str, float] = {}
    names: dict[str, dict[str, None]] = {}
    for name, duration_us in events:
        kind = classify_kernel(name)
        counts[kind] = counts.get(kind, 0) + 1
        micros[kind] = micros.get(kind, 0.0) + duration_us
        names.setdefault(kind, {})[short_kernel_name(name)] = None
    rows = []
    for kind in KERNEL_KINDS:
        if kind in counts:
            rows.append(dict(kind=kind, per_step=counts[kind] / num_steps,
                             per_layer=counts[kind] / num_steps / num_layers,
                             us_per_step=micros[kind] / num_steps, names=", ".join(list(names[kind])[:4])))
    total = sum(counts.values())
    rows.append(dict(kind="total", per_step=total / num_steps, per_layer=total / num_steps / num_layers,
                     us_per_step=sum(micros.values()) / num_steps, names=""))
    return rows


def short_kernel_name(name: str, width: int = 48) -> str:
    """A kernel name without its C++ return type and template arguments, cut to `width` characters."""
    base = name.split("<", 1)[0].split("(", 1)[0].strip()
    if base.startswith("void "):
        base = base[5:]
    return base if len(base) <= width else base[:width - 3] + "..."


def cprofiled(fn, prefix: str, sort: str | tuple[str, ...] = ("cumulative",), top: int = 80):
    """fn() under cProfile: the raw profile at prefix.prof, and at prefix.txt the top functions for each
    order in `sort` ("cumulative": where a start-up's phases go; "tottime": which functions a step
    loop's own time is in)."""
    import cProfile
    import io
    import pstats
    profile = cProfile.Profile()
    try:
        return profile.runcall(fn)
    finally:
        profile.dump_stats(prefix + ".prof")
        text = io.StringIO()
        for order in ((sort,) if isinstance(sort, str) else sort):
            pstats.Stats(profile, stream=text).sort_stats(order).print_stats(top)
        with open(prefix + ".txt", "w") as f:
            f.write(text.getvalue())
