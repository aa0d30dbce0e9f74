"""Suite `capture`: what the engine's default graphs cost to get, as a user builds the engine.

Each run is a fresh subprocess that builds `engine.LLM` on the model (engine defaults, prefill graphs
on) and reads what the engine reports of its own start-up, `llm.stats()`: the start-up timeline
(`stats["startup"]`: phases with seconds and memory) when the engine has one, else its capture
seconds and memory keys, and the backend's per-size piecewise capture seconds. Nothing here replays
the engine's start-up order itself. "cold" runs with an empty cache root (INFER_GRAPHS_CACHE: the
engine's graph store and argmax choices; Inductor and Triton caches), "warm" again with what the cold
run filled: the warm engine loads its compiled graph (`compile_cache` "hit", `dynamo_traced` False:
engine/worker/warm_start.py). Each run's process time, from its start to the JSON written, is
`process_s`. Then the server's start-up, cold and warm over the same caches: `serve` (bench.serving
--serve: the model with random weights, serve's defaults, its engine in a process of its own) from its
process start to its "ready: serving" line, the "serve to ready" rows.

Both runs see Python bytecode as an installed torch has it (pip writes .pyc files at install). An
image whose site-packages hold no .pyc and that forbids writing them (PYTHONDONTWRITEBYTECODE, as the
H100 image of 2026-11-23 did) compiles ~1,400 of torch's modules from source in every process: 4.1 of
a warm start-up's 6.2 s "setup" phase in a cProfile there
(bench/results/h100-2026-11-23/startup-setup-phase-cprofile-warm.log). There the children get a
bytecode cache of their own (PYTHONPYCACHEPREFIX), filled by one import-only child first; the report
notes which case it was.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

from bench.measure import Report
from bench.profiling import cprofiled

COLUMNS = ["cache", "kind", "size", "capture_s", "graph_mib"]
MEMORY_KEYS = ("activation_peak_bytes", "decode_graph_reserve_bytes", "free_bytes_before_pool", "kv_pool_bytes",
               "decode_graph_bytes")


# set to a directory, `python -m bench capture` profiles each start-up (cold, warm) with cProfile there
PROFILE_ENV = "BENCH_CAPTURE_PROFILE"
PROFILE_CHILD_ENV = "BENCH_CAPTURE_PROFILE_TO"  # the child's own path prefix (set by _child)


def _require_cuda() -> None:
    # Without CUDA nothing is captured: every capture time and graph size would be a 0 never measured.
    if not torch.cuda.is_available():
        raise RuntimeError("the capture suite needs a CUDA device: graphs are captured only there")


def measure(model: str, max_num_seqs: int = 32, max_num_batched_tokens: int = 1024) -> dict:
    """Run in THIS process: build the engine with every default graph; what its stats say it cost."""
    _require_cuda()
    from engine import LLM

    from bench.common import build_model

    start = time.perf_counter()
    net = build_model(model)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    llm = LLM(net, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, prefill_graphs=True,
              show_progress=False)
    ready_s = time.perf_counter() - start
    from engine import SamplingParams
    # the same greedy continuation cold and warm: a loaded graph computes what the traced one did
    greedy = llm.generate([list(range(1, 17))], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
    stats = llm.stats()
    backend = stats.get("backend") or {}
    graphs = llm.runtime.runner.decode_graphs
    result = {
        "model": model, "device": torch.cuda.get_device_name(), "build_s": build_s, "ready_s": ready_s,
        "prefill_sizes": sorted(llm.config.prefill_graph_sizes),
        "decode_sizes": list(graphs.sizes) if graphs else [],
        "piecewise": [{"size": int(size), "capture_s": seconds}
                      for size, seconds in sorted(backend.get("capture_seconds", {}).items(), reverse=True)],
        "compile_s": backend.get("compile_seconds"),
        "piecewise_total_s": stats.get("piecewise_capture_seconds", 0.0),
        "piecewise_pool_bytes": backend.get("graph_pool_bytes", 0),
        "decode_total_s": stats.get("decode_graph_capture_seconds", 0.0),
        "startup": stats.get("startup"),
        "greedy_tokens": list(greedy),
        **{key: stats[key] for key in MEMORY_KEYS if key in stats},
    }
    llm.close()
    return result


def startup_phases(startup) -> list[tuple[str, float, float | None]]:
    """(phase, seconds, bytes or None) from the engine's start-up timeline: a list of phase dicts
    (named by "name" or "phase"), or a dict of phases by name (each a dict or plain seconds), either
    alone or under "phases". A phase's memory is its first numeric key naming bytes."""
    if not startup:
        return []
    phases = startup.get("phases", startup) if isinstance(startup, dict) else startup
    items = phases.items() if isinstance(phases, dict) else [(p.get("name", p.get("phase")), p) for p in phases]
    out = []
    for name, phase in items:
        if isinstance(phase, (int, float)) and not isinstance(phase, bool):
            out.append((str(name), float(phase), None))
        elif isinstance(phase, dict) and isinstance(phase.get("seconds", phase.get("s")), (int, float)):
            memory = next((v for k, v in phase.items() if "bytes" in k and isinstance(v, (int, float))), None)
            out.append((str(name), float(phase.get("seconds", phase.get("s"))), memory))
    return out


# What an engine's start-up imports (the rest comes in the cold run, whose bytecode the warm run reuses).
_PRIMING_IMPORTS = "import torch._dynamo, torch._inductor.compile_fx, torch.distributed.fsdp, engine, bench.common"


def has_cached_bytecode(module_file: str) -> bool:
    """Whether Python would load `module_file` from a cached .pyc (beside it, or under the pycache prefix)."""
    try:
        return os.path.exists(importlib.util.cache_from_source(module_file))
    except (NotImplementedError, ValueError):
        return False


def bytecode_env(env: dict, cache_dir: str) -> tuple[dict, bool, str]:
    """(env for the children, whether to prime it, a note): bytecode caching as an installed torch has
    it. Where torch's own modules have no .pyc (an image built without them), the children write theirs
    (under PYTHONPYCACHEPREFIX: the caller's, else one in cache_dir), after an import-only child
    fills it."""
    env = dict(env)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    import torch._dynamo
    if has_cached_bytecode(torch._dynamo.__file__):
        return env, False, "python bytecode: cached .pyc files of torch were found (as an installed torch has)"
    env.setdefault("PYTHONPYCACHEPREFIX", os.path.join(cache_dir, "pycache"))
    return env, True, ("python bytecode: this image had no .pyc for torch; the children cache theirs under "
                       "PYTHONPYCACHEPREFIX, filled by an import-only child before the cold run (as pip's "
                       "install would have)")


def _cache_env(env: dict, cache_dir: str) -> dict:
    """`env` with every cache a start-up reads or writes in cache_dir (its graph store, argmax choices,
    Inductor's and Triton's caches)."""
    env = dict(env)
    env["INFER_GRAPHS_CACHE"] = os.path.join(cache_dir, "root")
    env.pop("INFER_GRAPHS_CACHE_DIR", None)
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, "inductor")
    env["TRITON_CACHE_DIR"] = os.path.join(cache_dir, "triton")
    return env


def _server_start(model: str, cache_dir: str, env: dict, timeout_s: float, flags: tuple[str, ...] = ()) -> dict:
    """`serve` from its process start to its ready line (bench.serving --serve: the model with random
    weights, serve's defaults, the engine in a process of its own, the benchmarks' tokenizer where
    bench/.tokenizer holds it; `flags`: more of serve's options) over cache_dir's caches; then its drain."""
    from bench.frontend import TokenizerMissing, tokenizer_dir
    from bench.server_process import ServerProcess
    try:
        tokenizer = ["--tokenizer", str(tokenizer_dir(None))]
    except TokenizerMissing:
        tokenizer = []
    server = ServerProcess(model, [*tokenizer, *flags], env=_cache_env(env, cache_dir), poll_s=0.05,
                           timeout_s=timeout_s)
    log = server.log.read_text()
    server.stop()
    found = re.search(r"compile cache: (hit|miss[^\n(]*|off[^\n]*)", log)
    return {"ready_s": server.ready_s, "tokenizer": bool(tokenizer),
            "compile_cache": found.group(1).strip()[:100] if found else "?"}


def _child(model: str, cache_dir: str, timeout_s: float, env: dict | None = None,
           profile_to: str | None = None) -> dict:
    """One start-up in a fresh process; `profile_to`: a path prefix for its cProfile (.prof, and .txt,
    the top functions by cumulative time)."""
    env = _cache_env(os.environ if env is None else env, cache_dir)
    env.pop(PROFILE_CHILD_ENV, None)
    if profile_to:
        env[PROFILE_CHILD_ENV] = profile_to
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
    """Cold then warm start-up of `model`, each in a fresh process over one cache directory; then the
    server's (`serve` to ready), cold then warm, over the same caches."""
    _require_cuda()
    runs, servers = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench-capture-") as cache_dir:
        env, prime, bytecode_note = bytecode_env(dict(os.environ), cache_dir)
        if prime:
            subprocess.run([sys.executable, "-c", _PRIMING_IMPORTS], env=env, timeout=timeout_s, check=True,
                           capture_output=True)
        profile = os.environ.get(PROFILE_ENV)  # a directory: each start-up's profile goes there
        if profile:
            os.makedirs(profile, exist_ok=True)
        for cache in ("cold", "warm"):
            runs[cache] = _child(model, cache_dir, timeout_s, env,
                                 profile and os.path.join(profile, f"startup-{cache}"))
        for cache in ("cold", "warm"):  # the server's engine options differ: its own key in the store
            servers[cache] = _server_start(model, cache_dir, env, timeout_s)
    report = build_report(model, runs, servers)
    report.notes.append(bytecode_note)
    return report


def build_report(model: str, runs: dict[str, dict], servers: dict[str, dict] | None = None) -> Report:
    """The capture report from the child runs' `measure` results, by cache state, and the server's
    start-ups (`_server_start`) where given."""
    any_run = next(iter(runs.values()))
    report = Report("capture", model, any_run["device"], COLUMNS + ["note"])
    report.meta["runs"] = runs

    def mib(value):
        return None if value is None else value / 2**20
    for cache, data in runs.items():
        for row in data["piecewise"]:
            report.add(cache=cache, kind="piecewise", size=row["size"], capture_s=row["capture_s"], graph_mib=None)
    for cache, data in runs.items():
        pw, dec = data["piecewise_total_s"], data["decode_total_s"]
        n_pw, n_dec = len(data["prefill_sizes"]), len(data["decode_sizes"])
        for name, seconds, memory in startup_phases(data.get("startup")):
            report.add(cache=cache, kind=f"startup: {name}", size="-", capture_s=seconds, graph_mib=mib(memory))
        if data.get("compile_s") is not None:
            report.add(cache=cache, kind="compile", size="-", capture_s=data["compile_s"], graph_mib=None,
                       note="the backend's split + piece compilation (Dynamo's trace not included)")
        report.add(cache=cache, kind="piecewise total", size=n_pw, capture_s=pw,
                   graph_mib=mib(data["piecewise_pool_bytes"]))
        report.add(cache=cache, kind="decode total", size=n_dec, capture_s=dec,
                   graph_mib=mib(data.get("decode_graph_bytes")), note=f"{dec / n_dec:.3f} s per graph" if n_dec else None)
        report.add(cache=cache, kind="all graphs", size=n_pw + n_dec, capture_s=pw + dec,
                   graph_mib=mib(data["piecewise_pool_bytes"] + (data.get("decode_graph_bytes") or 0)))
        startup = data.get("startup") if isinstance(data.get("startup"), dict) else {}  # older reports: a list
        report.add(cache=cache, kind="ready", size="-", capture_s=data["ready_s"],
                   graph_mib=mib(data.get("kv_pool_bytes")),
                   note=f"LLM(...) built from a loaded model; KV pool in graph_mib; process {data['process_s']:.1f} s; "
                        f"compile cache {startup.get('compile_cache', '?')}, dynamo traced {startup.get('dynamo_traced', '?')}")
        report.add(cache=cache, kind="process", size="-", capture_s=data["process_s"], graph_mib=None,
                   note="the child process from its start to its result (imports, model build, engine, close)")
    for cache, server in (servers or {}).items():
        tokenizer = "the benchmarks' tokenizer" if server["tokenizer"] else "no tokenizer"
        report.add(cache=cache, kind="serve to ready", size="-", capture_s=server["ready_s"], graph_mib=None,
                   note=f"python -m bench.serving --serve: process start to its ready line, serve's defaults, the "
                        f"engine in its own process, {tokenizer}; compile cache {server['compile_cache']}")
    warm = runs.get("warm", any_run)
    report.notes.append(f"engine defaults: max_num_seqs=32 (decode batches {warm['decode_sizes']}), "
                        f"max_num_batched_tokens=1024 (piecewise sizes {warm['prefill_sizes'][0]}.."
                        f"{warm['prefill_sizes'][-1]}, {len(warm['prefill_sizes'])} sizes), prefill graphs on")
    report.notes.append("from the engine's own stats: 'startup: ...' rows are its start-up timeline (when it has "
                        "one); graph_mib: piecewise = the backend's graph pool growth, decode = device memory the "
                        "decode captures took, 'ready' = the KV pool")
    if "cold" in runs and "warm" in runs and "greedy_tokens" in runs["cold"]:
        same = runs["cold"]["greedy_tokens"] == runs["warm"].get("greedy_tokens")
        report.notes.append(f"greedy tokens after start-up (16 from a 16-token prompt): warm equals cold: {same}")
    report.plots.append(("per-size", plot_capture))
    return report


def plot_capture(report: Report):
    """Left: capture ms per size (piecewise; decode too in reports that timed each decode graph).
    Right: seconds of each start-up part, cold and warm."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for cache, style in (("cold", "o--"), ("warm", "o-")):
        for kind in ("piecewise", "decode"):
            rows = sorted((r["size"], r["capture_s"]) for r in report.rows if r["cache"] == cache and r["kind"] == kind)
            if rows:
                axes[0].plot([r[0] for r in rows], [r[1] * 1e3 for r in rows], style, ms=3, label=f"{kind} ({cache})")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("tokens (piecewise) / batch (decode)")
    axes[0].set_ylabel("capture ms")
    parts = [r for r in report.rows if r["kind"] not in ("piecewise", "decode")]
    kinds = list(dict.fromkeys(r["kind"] for r in parts))
    for i, cache in enumerate(("cold", "warm")):
        seconds = {r["kind"]: r["capture_s"] for r in parts if r["cache"] == cache}
        axes[1].barh([k + (i - 0.5) * 0.4 for k in range(len(kinds))], [seconds.get(k, 0.0) for k in kinds],
                     height=0.4, label=cache)
    axes[1].set_yticks(range(len(kinds)), kinds, fontsize=8)
    axes[1].set_xlabel("seconds")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"start-up cost, {report.model}")
    return fig



if __name__ == "__main__":
    run_child = lambda: measure(sys.argv[1])  # noqa: E731
    prefix = os.environ.get(PROFILE_CHILD_ENV)
    data = cprofiled(run_child, prefix, sort="cumulative") if prefix else run_child()
    with open(sys.argv[2], "w") as f:
        json.dump(data, f, default=str)  # a timeline value JSON has no type for is kept as its text
