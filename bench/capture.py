"""Suite `capture`: what the engine's default graphs cost to get: seconds and memory per size.

The engine's start-up order is replayed size by size with its own parts (compile_model, ModelRunner,
DecodeGraphs): compile (first forward), then the piecewise graphs for every default prefill size,
largest first, then the full-decode graphs for every default decode batch, largest first, all in the
one shared graph pool. Memory per size is the growth of that pool (piecewise) or of used device
memory (decode; it also holds each graph's executable). Each run is a fresh subprocess: "cold" with
empty Inductor and Triton caches, "warm" again with the caches the cold run filled.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from bench.measure import Report

COLUMNS = ["cache", "kind", "size", "capture_s", "graph_mib"]


def _require_cuda() -> None:
    # Without CUDA nothing is captured: every capture time and graph size would be a 0 never measured.
    if not torch.cuda.is_available():
        raise RuntimeError("the capture suite needs a CUDA device: graphs are captured only there")


def measure(model: str, max_num_seqs: int = 32, max_num_batched_tokens: int = 1024) -> dict:
    """Run in THIS process: compile + capture every default size; per-size seconds and bytes."""
    _require_cuda()
    from compile_backend import pool_bytes
    from custom_ops import RuntimeMode
    from engine.compile import compile_model
    from engine.config import EngineConfig
    from engine.decode_graphs import DecodeGraphs
    from engine.kv_cache import KVCache
    from engine.model_runner import ModelRunner

    from bench.common import build_model

    start = time.perf_counter()
    net = build_model(model)
    build_s = time.perf_counter() - start
    config = EngineConfig(model=model, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          prefill_graphs=True, show_progress=False).resolve(net.config.max_position_embeddings)
    device = torch.device(config.device)
    cuda = device.type == "cuda"
    forward, mark, backend = compile_model(net, config)
    runner = ModelRunner(net, forward, config.block_size, config.max_model_len,
                         max(config.max_num_batched_tokens, config.max_num_seqs), config.max_num_seqs, device, mark)
    kv = KVCache(net.attention_layer_names, config.block_size, config.torch_dtype, device)
    kv.allocate(2)  # dummy steps touch only the scratch block
    runner.kv_caches = kv.by_layer

    def seqs(n: int) -> int:
        return min(n, max(1, -(-n // config.max_model_len)))

    result: dict = {"model": model, "build_s": build_s, "piecewise": [], "decode": [],
                    "prefill_sizes": list(config.prefill_graph_sizes),
                    "decode_sizes": list(config.decode_graph_sizes)}
    with torch.inference_mode():
        t0 = time.perf_counter()
        n = config.max_num_batched_tokens
        runner.run_forward(runner.load_dummy(n, seqs(n), False), RuntimeMode.NONE, n)
        if cuda:
            torch.cuda.synchronize()
        result["compile_s"] = time.perf_counter() - t0
        result["backend_compile_s"] = backend.stats.compile_seconds

        def fwd(num_tokens: int) -> None:
            ids, positions = runner.buffers.input_ids[:num_tokens], runner.buffers.positions[:num_tokens]
            runner.mark_dynamic(ids, positions)
            runner.forward(ids, positions)

        pool = backend.pool if cuda else None  # the backend's own pool; the decode graphs share it
        t0 = time.perf_counter()
        for size in sorted(config.prefill_graph_sizes, reverse=True):
            before = pool_bytes(pool) if cuda else 0
            backend.capture(fwd, [size], lambda k: runner.load_dummy(k, seqs(k), False), kv_caches=runner.kv_caches)
            seconds = backend.stats.capture_seconds.get(size, 0.0)
            result["piecewise"].append({"size": size, "capture_s": seconds,
                                        "graph_bytes": (pool_bytes(pool) - before) if cuda else 0})
        result["piecewise_total_s"] = time.perf_counter() - t0
        result["piecewise_pool_bytes"] = pool_bytes(pool) if cuda else 0
        if cuda:
            graphs = DecodeGraphs(runner, pool)
            t0 = time.perf_counter()
            for size in sorted(config.decode_graph_sizes, reverse=True):
                graphs.capture((size,), False)
                result["decode"].append({"size": size, "capture_s": graphs.capture_seconds,
                                         "graph_bytes": graphs.graph_bytes})
            result["decode_total_s"] = time.perf_counter() - t0
            result["pool_bytes"] = pool_bytes(pool)
        else:
            result["decode_total_s"] = 0.0
            result["pool_bytes"] = 0
    result["device"] = torch.cuda.get_device_name() if cuda else "cpu"
    return result


def _child(model: str, cache_dir: str, timeout_s: float) -> dict:
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, "inductor")
    env["TRITON_CACHE_DIR"] = os.path.join(cache_dir, "triton")
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        cmd = [sys.executable, "-m", "bench.capture", model, out.name]
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, timeout=timeout_s, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"capture child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        data = json.load(open(out.name))
        data["process_s"] = time.perf_counter() - start
        return data


def run(model: str, timeout_s: float = 400, **_: object) -> Report:
    _require_cuda()
    runs = {}
    with tempfile.TemporaryDirectory(prefix="bench-capture-") as cache_dir:
        runs["cold"] = _child(model, cache_dir, timeout_s)
        runs["warm"] = _child(model, cache_dir, timeout_s)
    device = runs["warm"]["device"]
    report = Report("capture", model, device, COLUMNS + ["note"])
    report.meta["runs"] = runs
    for cache, data in runs.items():
        for kind in ("piecewise", "decode"):
            for row in data[kind]:
                report.add(cache=cache, kind=kind, size=row["size"], capture_s=row["capture_s"],
                           graph_mib=row["graph_bytes"] / 2**20)
    for cache, data in runs.items():
        pw = sum(r["capture_s"] for r in data["piecewise"])
        dec = data["decode_total_s"]
        report.add(cache=cache, kind="compile (first forward)", size="-", capture_s=data["compile_s"],
                   graph_mib=None)
        report.add(cache=cache, kind="piecewise total", size=len(data["piecewise"]), capture_s=pw,
                   graph_mib=data["piecewise_pool_bytes"] / 2**20)
        report.add(cache=cache, kind="decode total", size=len(data["decode"]), capture_s=dec,
                   graph_mib=sum(r["graph_bytes"] for r in data["decode"]) / 2**20)
        report.add(cache=cache, kind="all graphs", size=len(data["piecewise"]) + len(data["decode"]),
                   capture_s=pw + dec, graph_mib=data["pool_bytes"] / 2**20,
                   note=f"compile + all graphs {data['compile_s'] + pw + dec:.1f} s; "
                        f"process {data['process_s']:.1f} s")
    report.notes.append("engine defaults: max_num_seqs=32 (decode batches "
                        f"{runs['warm']['decode_sizes']}), max_num_batched_tokens=1024 (piecewise sizes "
                        f"{runs['warm']['prefill_sizes'][0]}..{runs['warm']['prefill_sizes'][-1]}, "
                        f"{len(runs['warm']['prefill_sizes'])} sizes)")
    report.notes.append("graph_mib: piecewise = growth of the shared graph pool; decode = device memory the "
                        "capture took (engine's measure); 'all graphs' = the shared pool at the end")
    report.plots.append(("per-size", plot_capture))
    return report


def plot_capture(report: Report):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for cache, style in (("cold", "o--"), ("warm", "o-")):
        for kind in ("piecewise", "decode"):
            rows = sorted((r["size"], r["capture_s"], r["graph_mib"]) for r in report.rows
                          if r["cache"] == cache and r["kind"] == kind)
            if not rows:
                continue
            axes[0].plot([r[0] for r in rows], [r[1] * 1e3 for r in rows], style, ms=3, label=f"{kind} ({cache})")
            if cache == "warm":
                axes[1].plot([r[0] for r in rows], [r[2] for r in rows], "o-", ms=3, label=kind)
    axes[0].set_ylabel("capture ms")
    axes[1].set_ylabel("graph memory MiB")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens (piecewise) / batch (decode)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"capture cost per size, {report.model}")
    return fig


if __name__ == "__main__":
    data = measure(sys.argv[1])
    with open(sys.argv[2], "w") as f:
        json.dump(data, f)
