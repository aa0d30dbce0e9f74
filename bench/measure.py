"""Timing and the two ceilings every floor is built from (copy bandwidth, bf16 matmul rate).

Times are medians of per-iteration CUDA-event intervals after a warm-up; host-side timers are used
only on the CPU, where there is no asynchrony to hide.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch


def median_ms(fn: Callable[[], object], warmup: int = 5, iters: int = 30) -> float:
    """Median milliseconds of one call of fn, measured call by call."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        samples = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def host_speed_us(rounds: int = 7) -> float:
    """The median time of one fixed piece of pure-Python work (dict and list traffic, attribute reads,
    small loops: the kind of work a host step does), in us. Printed beside host-bound rows: the lent
    machines' hosts ran one suite ~1.4x slower than the next (bench/results/h100-2026-12-07/
    host-check-2/), and a row read on a slowed host reads slower here too."""
    class Item:
        __slots__ = ("key", "value")

        def __init__(self, key: int, value: int) -> None:
            self.key, self.value = key, value

    def work() -> int:
        table: dict[int, Item] = {}
        for i in range(2000):
            table[i] = Item(i, i * 7)
        out = [item.value + 1 for item in table.values() if item.key % 3]
        return sum(out) + len({v % 97 for v in out})

    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        work()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def gpu_ms_host_ahead(fn: Callable[[], object], iters: int = 10, sleep_cycles: int = 500_000_000,
                      attempts: int = 3) -> float:
    """Mean GPU milliseconds of one call of fn with the host far ahead: the GPU sleeps while the host
    enqueues `iters` calls, then runs them back to back, so no host time (Python, launches) sits between
    them. Next to `median_ms`, which a caller waits for, it says whether a row is host-bound. A try
    whose enqueueing outlasted the sleep is repeated with twice the sleep (that time would include host
    gaps). CUDA only: fn must be warm (compiled and captured) already."""
    for _ in range(attempts):
        torch.cuda.synchronize()
        asleep, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        asleep.record()
        torch.cuda._sleep(sleep_cycles)
        start.record()
        began = time.perf_counter()
        for _ in range(iters):
            fn()
        enqueue_ms = (time.perf_counter() - began) * 1e3
        end.record()
        torch.cuda.synchronize()
        if enqueue_ms < asleep.elapsed_time(start):
            return start.elapsed_time(end) / iters
        sleep_cycles *= 2
    raise RuntimeError(f"gpu_ms_host_ahead: enqueueing {iters} calls took {enqueue_ms:.1f} ms, longer than the "
                       f"GPU slept in {attempts} tries; the GPU time would include host gaps")


@dataclass(frozen=True)
class Ceilings:
    copy_bytes_per_s: float    # device-to-device copy, bytes read + bytes written per second
    matmul_flops_per_s: float  # bf16 dense matmul
    device_name: str


def measure_ceilings(device: str = "cuda") -> Ceilings:
    if not torch.cuda.is_available():
        raise RuntimeError("the floor suite needs a CUDA device: ceilings are the GPU's")
    nbytes = 2 << 30  # 2 GiB: far beyond L2, so the copy measures HBM
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).uniform_(-1, 1)
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), warmup=3, iters=20)
    del src, dst
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)  # random, never zeros: zeros run faster
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    mm_ms = median_ms(lambda: a @ b, warmup=3, iters=20)
    return Ceilings(
        copy_bytes_per_s=2 * nbytes / (copy_ms * 1e-3),
        matmul_flops_per_s=2 * n ** 3 / (mm_ms * 1e-3),
        device_name=torch.cuda.get_device_name(),
    )


@dataclass
class Report:
    """One suite's results: rows of flat dicts, written as JSON and as a Markdown table."""

    suite: str
    model: str
    device: str
    columns: list[str]
    rows: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)        # ceilings, grid, versions: written to the JSON
    plots: list = field(default_factory=list)       # (name, fn(report) -> matplotlib Figure)

    def add(self, **row) -> None:
        self.rows.append(row)

    def markdown(self) -> str:
        def fmt(value):
            if value is None:
                return "-"
            return f"{value:.3f}" if isinstance(value, float) else str(value)
        lines = [f"# {self.suite} — {self.model} on {self.device}", ""]
        lines += [f"- {note}" for note in self.notes]
        if self.notes:
            lines.append("")
        lines.append("| " + " | ".join(self.columns) + " |")
        lines.append("|" + "---|" * len(self.columns))
        for row in self.rows:
            lines.append("| " + " | ".join(fmt(row.get(c, "")) for c in self.columns) + " |")
        return "\n".join(lines) + "\n"

    def write(self, out_dir: str) -> tuple[str, ...]:
        os.makedirs(out_dir, exist_ok=True)
        # a model given as a directory is named by its last component
        stem = os.path.join(out_dir, f"{self.suite}-{os.path.basename(os.path.normpath(self.model))}")
        paths = [stem + ".json", stem + ".md"]
        images = []
        for name, make in self.plots:
            try:
                fig = make(self)
            except ImportError as exc:  # matplotlib missing: tables are the result, plots a convenience
                self.notes.append(f"plot {name} skipped: {exc}")
                continue
            path = f"{stem}-{name}.png"
            fig.savefig(path, dpi=110, bbox_inches="tight")
            import matplotlib.pyplot as plt
            plt.close(fig)
            images.append(os.path.basename(path))
            paths.append(path)
        # After the plots: a skipped plot adds a note, and the JSON must carry the same notes as the Markdown.
        with open(stem + ".json", "w") as f:
            json.dump({"suite": self.suite, "model": self.model, "device": self.device,
                       "date": time.strftime("%Y-%m-%d"), "notes": self.notes, "meta": self.meta,
                       "columns": self.columns, "rows": self.rows}, f, indent=1)
        with open(stem + ".md", "w") as f:
            f.write(self.markdown())
            for image in images:
                f.write(f"\n![{image}]({image})\n")
        return tuple(paths)

    @classmethod
    def load(cls, path: str) -> "Report":
        """A report back from its JSON (for summaries and notebooks)."""
        with open(path) as f:
            data = json.load(f)
        columns = data.get("columns") or (list(data["rows"][0]) if data["rows"] else [])
        return cls(data["suite"], data["model"], data["device"], columns, data["rows"], data.get("notes", []),
                   data.get("meta", {}))


def ratio(measured_ms: float | None, floor_ms: float | None) -> float | None:
    if measured_ms is None or not floor_ms:
        return None
    return measured_ms / floor_ms


def plot_latency_vs_floor(ax, rows: list[dict], x_key: str, xlabel: str, ylabel: str, title: str) -> None:
    """One line per variant of median_ms against x_key, the floor dashed, both axes log scale."""
    for variant in dict.fromkeys(r["variant"] for r in rows):
        pts = sorted((r[x_key], r["median_ms"]) for r in rows if r["variant"] == variant)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=variant)
    floor = sorted({(r[x_key], r["floor_ms"]) for r in rows if r.get("floor_ms")})
    if floor:
        ax.plot([p[0] for p in floor], [p[1] for p in floor], "k--", label="floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
