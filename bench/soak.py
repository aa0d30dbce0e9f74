"""Suite `soak`: a seeded traffic mix against the server, then overload; nothing may be lost or leak.

    python -m bench soak --url http://127.0.0.1:8000 [--duration 600] [--clients 48] [--seed 0] [--out F.json]
    python -m bench soak --model DIR_OR_NAME [--server-args="..."] [--max-waiting-requests N] ...

`--model` starts a server on 127.0.0.1 and a free port (a model directory: `python -m engine serve`; a
benchmark config: the `serving` suite's random-weight server) with --max-waiting-requests (default
--clients), and stops it with SIGTERM at the end. Phases: warm-up, steady (2/3 of --duration, closed
loop), overload (1/3, open loop at 3x the steady rate), idle. docs/server.md describes the mix, the
outcomes (completed, rejected, aborted, invalid, failed) and what makes a run ok. Every loop is bounded
by a count as well as by time.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

from bench import REPO_ROOT, repo_env
from bench.server_process import ServerProcess
from bench.soak_requests import REQUEST_TIMEOUT_S, Outcome, Target, send
from bench.workload import percentile

HEALTH_PERIOD_S = 0.1
FINISH_SLACK_S = 10.0          # past a request's own timeout, before a task still running counts as hung
WARMUP_MIX_S = 30.0           # the whole mix runs this long (at most duration / 20) before memory's baseline
MEMORY_PERIOD_S = 30.0
IDLE_TIMEOUT_S = 60.0
MAX_REQUESTS_PER_CLIENT = 100_000
OVERLOAD_FACTOR = 3.0
TTFT_GROWTH_LIMIT = 1.25
PRA = "infer_graphs_"
LOOP_LAG = PRA + "event_loop_lag_seconds"  # the server's own: how late its event loop ran a 0.1 s tick


async def closed_loop(client: Any, t: Target, rng: random.Random, end_s: float, outcomes: list[Outcome]) -> None:
    for _ in range(MAX_REQUESTS_PER_CLIENT):
        if time.perf_counter() >= end_s:
            return
        outcomes.append(out := await send(client, t, rng))
        if out.kind == "rejected":  # as a well-behaved client does
            await asyncio.sleep(max(0.0, min(out.retry_after_s, end_s - time.perf_counter())))


async def open_loop(client: Any, t: Target, rng: random.Random, rate: float, duration_s: float, cap: int,
                    outcomes: list[Outcome]) -> int:
    """Poisson arrivals at `rate` for `duration_s`, at most `cap` outstanding; returns the arrivals
    not sent because `cap` were outstanding (a client-side bound, reported)."""
    tasks: list[asyncio.Task] = []
    outstanding: set[asyncio.Task] = set()
    start = arrival = time.perf_counter()
    not_sent = 0
    for _ in range(int(rate * duration_s * 2) + 10):
        arrival += rng.expovariate(rate)
        if arrival >= start + duration_s:
            break
        await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
        if len(outstanding) >= cap:
            not_sent += 1
            continue
        tasks.append(task := asyncio.create_task(send(client, t, random.Random(rng.random()))))
        outstanding.add(task)
        task.add_done_callback(outstanding.discard)
    await _finish(tasks, outcomes)
    return not_sent


async def _finish(tasks: list[asyncio.Task], outcomes: list[Outcome], until_s: float | None = None) -> None:
    """Wait for every task, until `until_s` (perf_counter; closed loops run to their phase's end) plus
    a request's timeout; one still running then is a hung request: failed."""
    if tasks:
        phase_left = max(0.0, (until_s or 0.0) - time.perf_counter())
        await asyncio.wait(tasks, timeout=phase_left + REQUEST_TIMEOUT_S + FINISH_SLACK_S)
    for task in tasks:
        if task.done() and not task.cancelled():
            if task.result() is not None:  # a closed-loop client returns None, its requests' outcomes went before
                outcomes.append(task.result())
        else:
            task.cancel()
            outcomes.append(Outcome(error="the request did not finish"))


def health_probe(url: str, out_path: str, period_s: str) -> None:
    """The /health poller, run in a process of its own (HealthProbe): a poller on the load's event loop
    times that loop's lag as well as the server's (the first H100 soak read 323 ms p99 that way).
    A new connection each time, as an orchestrator's probe makes; one line per probe:
    `wall-clock start, seconds, 1 if 200`."""
    import http.client
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    with open(out_path, "a", buffering=1) as out:
        for _ in range(int(1e7)):  # ended by HealthProbe.stop (SIGTERM)
            start, begun = time.time(), time.perf_counter()
            try:
                conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=5.0)
                conn.request("GET", "/health")
                ok = conn.getresponse().status == 200
                conn.close()
            except Exception:
                ok = False
            seconds = time.perf_counter() - begun
            out.write(f"{start:.6f} {seconds:.6f} {int(ok)}\n")
            time.sleep(max(0.0, float(period_s) - seconds))


class HealthProbe:
    """`health_probe` in a child process; `samples(start, end)` the probes begun in that wall-clock span."""

    def __init__(self, url: str) -> None:
        self.path = tempfile.mkstemp(prefix="bench-soak-health-", suffix=".txt")[1]
        self.proc = subprocess.Popen([sys.executable, "-c", "import sys; from bench.soak import health_probe; "
                                      "health_probe(*sys.argv[1:])", url, self.path, str(HEALTH_PERIOD_S)],
                                     env=repo_env(), cwd=REPO_ROOT, stdin=subprocess.DEVNULL)
        self._rows: list[tuple[float, float, bool]] | None = None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(30)
        with open(self.path) as f:
            rows = [line.split() for line in f]
        os.unlink(self.path)
        self._rows = [(float(t), float(s), ok == "1") for t, s, ok in (r for r in rows if len(r) == 3)]

    def samples(self, start: float, end: float) -> list[tuple[float, bool]]:
        return [(s, ok) for t, s, ok in self._rows or () if start <= t < end]


def parse_metrics(text: str) -> dict[str, float]:
    """A Prometheus text page as {'name' or 'name{label=value,...}' (labels sorted): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


async def read_metrics(client: Any, url: str) -> dict[str, float]:
    return parse_metrics((await client.get(f"{url}/metrics", timeout=60.0)).text)


async def discover(client: Any, url: str) -> Target:
    """The served model, its max_model_len, and whether text prompts / chat work (probed)."""
    models = (await client.get(f"{url}/v1/models", timeout=60.0)).json()["data"][0]
    name, length = models["id"], int(models.get("max_model_len") or 2048)
    probe = {"model": name, "max_tokens": 1}
    text = (await client.post(f"{url}/v1/completions", json={**probe, "prompt": "hello", "stop": ["x"]},
                              timeout=REQUEST_TIMEOUT_S)).status_code == 200
    chat = text and (await client.post(f"{url}/v1/chat/completions", timeout=REQUEST_TIMEOUT_S, json={
        **probe, "messages": [{"role": "user", "content": "hello"}]})).status_code == 200
    return Target(url, name, length, text, chat)


def summarize(outcomes: list[Outcome], seconds: float) -> dict[str, Any]:
    """A phase's outcomes (its /health samples are added once the probe has stopped: _health)."""
    kinds = Counter(o.kind for o in outcomes)
    ttfts = [o.ttft_s for o in outcomes if o.kind == "completed" and o.ttft_s is not None]
    itls = [x for o in outcomes if o.kind == "completed" for x in o.itls_s]
    ms = lambda v: None if v is None else round(v * 1e3, 3)  # noqa: E731
    return {"seconds": round(seconds, 2), "sent": len(outcomes), "completed": kinds["completed"],
            "rejected_503": kinds["rejected"], "aborted_by_client": kinds["aborted"],
            "invalid_4xx": kinds["invalid"], "failed": kinds["failed"],
            "completed_per_s": round(kinds["completed"] / seconds, 3) if seconds else None,
            "ttft_p50_ms": ms(percentile(ttfts, 50)), "ttft_p99_ms": ms(percentile(ttfts, 99)),
            "itl_p50_ms": ms(percentile(itls, 50)), "itl_p99_ms": ms(percentile(itls, 99)),
            "errors": sorted({o.error for o in outcomes if o.kind == "failed" and o.error})[:5]}


async def soak(url: str, duration_s: float, clients: int, seed: int, api_key: str | None) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0)
    probe = HealthProbe(url)
    marks: dict[str, float] = {}  # phase -> wall-clock start, for the probe's samples
    try:
        async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
            t = await discover(client, url)
            rng, phases = random.Random(seed), {}
            marks["warmup"], start, warm = time.time(), time.perf_counter(), []
            # every code path of the mix runs once before the baseline of memory is read: first the
            # plain requests, then the whole mix (streams, n > 1, chat, logprobs, bad bodies, disconnects)
            await _finish([asyncio.create_task(send(client, t, random.Random(rng.random()), plain=True))
                           for _ in range(clients)], warm)
            end = time.perf_counter() + min(WARMUP_MIX_S, duration_s / 20)
            await _finish([asyncio.create_task(closed_loop(client, t, random.Random(rng.random()), end, warm))
                           for _ in range(clients)], warm, end)
            phases["warmup"] = summarize(warm, time.perf_counter() - start)
            warm_metrics = await read_metrics(client, url)
            memory = [_memory_row(0.0, warm_metrics)]
            sampler = asyncio.create_task(_sample_memory(client, url, memory))

            marks["steady"], steady, start = time.time(), [], time.perf_counter()
            end = start + duration_s * 2 / 3
            await _finish([asyncio.create_task(closed_loop(client, t, random.Random(rng.random()), end, steady))
                           for _ in range(clients)], steady, end)
            phases["steady"] = summarize(steady, time.perf_counter() - start)
            steady_metrics = await read_metrics(client, url)
            phases["steady"]["server_loop_lag_p99_ms"] = _histogram_p99_ms(warm_metrics, steady_metrics, LOOP_LAG)
            served = (phases["steady"]["completed"] + phases["steady"]["aborted_by_client"]) / phases["steady"]["seconds"]

            marks["overload"], overload, start = time.time(), [], time.perf_counter()
            rate = max(1.0, OVERLOAD_FACTOR * served)
            not_sent = await open_loop(client, t, rng, rate, duration_s / 3, max(64, 8 * clients), overload)
            phases["overload"] = summarize(overload, time.perf_counter() - start)
            phases["overload"].update(rate_per_s=round(rate, 3), not_sent_at_client_cap=not_sent,
                                      ttft_p99_ms_by_half=_ttft_p99_by_half(overload))
            phases["overload"]["server_loop_lag_p99_ms"] = _histogram_p99_ms(
                steady_metrics, await read_metrics(client, url), LOOP_LAG)

            marks["idle"], start = time.time(), time.perf_counter()
            for _ in range(int(IDLE_TIMEOUT_S / 0.5) + 1):
                end_metrics = await read_metrics(client, url)
                if all(end_metrics.get(PRA + k, 0) == 0 for k in ("requests_running", "requests_waiting",
                                                                    "requests_admitting", "kv_blocks_used")):
                    break
                await asyncio.sleep(0.5)
            idle_s = time.perf_counter() - start
            marks["end"] = time.time()
            sampler.cancel()
            memory.append(_memory_row(time.time() - marks["steady"], end_metrics))
    finally:
        probe.stop()
    names = list(marks)
    for name, next_name in zip(names, names[1:]):
        health = probe.samples(marks[name], marks[next_name])
        if name == "idle":
            idle_health = _health(health)["health_p99_ms"]
        else:
            phases[name].update(_health(health))
    return {"target": vars(t), "phases": phases, "end": _end_state(warm_metrics, end_metrics, idle_s),
            "health_p99_ms_idle": idle_health, "memory_mib": memory}


def _health(samples: list[tuple[float, bool]]) -> dict[str, Any]:
    p99 = percentile([s for s, _ in samples], 99)
    return {"health_p99_ms": None if p99 is None else round(p99 * 1e3, 3), "health_probes": len(samples),
            "health_not_200": sum(not ok for _, ok in samples)}


def _histogram_p99_ms(before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    """The p99 of what a server histogram observed between two scrapes, as the upper bound of its
    bucket (None: the server does not export it, or observed nothing)."""
    bounds = sorted((float(key.split("le=")[1].rstrip("}")), key) for key in after
                    if key.startswith(name + "_bucket{"))
    if not bounds:
        return None
    counts = [(le, after[key] - before.get(key, 0.0)) for le, key in bounds]
    total = counts[-1][1]
    if total <= 0:
        return None
    le = next(le for le, count in counts if count >= 0.99 * total)
    return None if le == float("inf") else round(le * 1e3, 3)


RSS_TOTAL = "rss_total_bytes"  # the server's RSS and, with serve --engine-process, its engine process's


def _with_rss_total(metrics: dict[str, float]) -> dict[str, float]:
    if "process_resident_memory_bytes" not in metrics:
        return metrics
    return {**metrics, RSS_TOTAL: metrics["process_resident_memory_bytes"]
            + metrics.get(PRA + "engine_process_resident_memory_bytes", 0.0)}


def _memory_row(seconds: float, metrics: dict[str, float]) -> list[float]:
    """[seconds since steady began, RSS MiB (the engine process's included), CUDA allocated MiB, CUDA
    reserved MiB] (None: not exported)."""
    metrics = _with_rss_total(metrics)
    mib = lambda name: None if name not in metrics else round(metrics[name] / 2**20, 1)  # noqa: E731
    return [round(seconds, 1), mib(RSS_TOTAL), mib(PRA + "cuda_memory_allocated_bytes"),
            mib(PRA + "cuda_memory_reserved_bytes")]


async def _sample_memory(client: Any, url: str, rows: list[list[float]]) -> None:
    """The server's memory every MEMORY_PERIOD_S until cancelled: a leak grows steadily, a warm-up
    effect once (the goal compares the end with after warm-up; this says which it was)."""
    start = time.time()
    for _ in range(100_000):
        await asyncio.sleep(MEMORY_PERIOD_S)
        try:
            rows.append(_memory_row(time.time() - start, await read_metrics(client, url)))
        except Exception:  # a scrape lost under overload is a gap in the series, not a failure
            continue


def _ttft_p99_by_half(outcomes: list[Outcome]) -> list[float | None]:
    """TTFT p99 of the requests sent in the first and in the second half of a phase: bounded by the
    waiting queue, the second is no worse than the first; without a bound it grows with time."""
    done = sorted((o.sent_s, o.ttft_s) for o in outcomes if o.kind == "completed" and o.ttft_s is not None)
    if not done:
        return [None, None]
    middle = (done[0][0] + done[-1][0]) / 2
    halves = [[t for sent, t in done if sent < middle], [t for sent, t in done if sent >= middle]]
    return [None if (p := percentile(h, 99)) is None else round(p * 1e3, 3) for h in halves]


def _end_state(warm: dict[str, float], end: dict[str, float], idle_s: float) -> dict[str, Any]:
    warm, end = _with_rss_total(warm), _with_rss_total(end)

    def growth(name: str) -> dict[str, Any] | None:
        if name not in warm or name not in end:
            return None
        pct = 100.0 * (end[name] - warm[name]) / warm[name] if warm[name] else None
        return {"after_warmup": warm[name], "end": end[name], "growth_pct": None if pct is None else round(pct, 3),
                "within_2pct": pct is not None and abs(pct) <= 2.0}

    return {"seconds_to_idle": round(idle_s, 2),
            **{k: end.get(PRA + k) for k in ("kv_blocks_used", "requests_running", "requests_waiting",
                                               "requests_admitting", "preemptions_total")},
            "server_rejected_503": end.get(PRA + "requests_rejected_total{reason=queue_full}"),
            "rss_bytes": growth(RSS_TOTAL),
            "cuda_allocated_bytes": growth(PRA + "cuda_memory_allocated_bytes"),
            "cuda_reserved_bytes": growth(PRA + "cuda_memory_reserved_bytes"),
            "prefix_cache": {k[len(PRA + "prefix_cache_"):]: v for k, v in end.items()
                             if k.startswith(PRA + "prefix_cache_")}}


def problems(result: dict[str, Any]) -> list[str]:
    found = [f"{name}: {p['failed']} failed ({'; '.join(p['errors'])})" for name, p in result["phases"].items()
             if p["failed"]]
    found += [f"{name}: /health answered {p['health_not_200']} times without 200"
              for name, p in result["phases"].items() if p["health_not_200"]]
    end = result["end"]
    found += [f"once idle, {k} = {end[k]} (must be 0)" for k in ("kv_blocks_used", "requests_running",
                                                                 "requests_waiting") if end[k] != 0]
    server = result.get("server")
    if server and (server["exit_status"] != 0 or not server["stopped_line"]):
        found.append(f"the server did not stop cleanly on SIGTERM: exit status {server['exit_status']}, "
                     f"'server stopped' logged: {server['stopped_line']}")
    return found


def goals(result: dict[str, Any]) -> dict[str, Any]:
    """Issue 43's goals for a run on a GPU (a short CPU run is judged by `problems` only): each with
    its figure. TTFT p99 in overload is bounded by the queue when its second half is no more than
    TTFT_GROWTH_LIMIT x its first (a queue without a bound grows with time)."""
    phases, end = result["phases"], result["end"]
    health = max((p["health_p99_ms"] for p in phases.values() if p.get("health_p99_ms") is not None), default=None)
    first, second = phases["overload"]["ttft_p99_ms_by_half"]
    growth = lambda k: (end[k] or {}).get("within_2pct")  # noqa: E731
    found = {"no_problems": not problems(result), "health_p99_under_100ms": health is not None and health < 100,
             "rss_within_2pct": growth("rss_bytes"), "cuda_allocated_within_2pct": growth("cuda_allocated_bytes"),
             "overload_ttft_p99_bounded": None if not (first and second) else second <= TTFT_GROWTH_LIMIT * first}
    return {**found, "health_p99_ms_max": health, "met": all(v is not False for v in found.values())}


def main(args: Any) -> int:
    """`python -m bench soak` with the shared parser's arguments (bench/__main__.py, which also gives
    `out` its default directory); --out names the JSON file, or a directory to write soak.json in."""
    duration, clients, seed = args.duration or 600.0, args.clients or 48, args.seed or 0
    if duration <= 0 or clients < 1:
        print(f"python -m bench soak: --duration ({duration}) must be > 0 and --clients ({clients}) >= 1",
              file=sys.stderr)
        return 2
    server = None
    if args.url is None:
        flags = shlex.split(args.server_args or "")
        if "--max-waiting-requests" not in flags:
            flags += ["--max-waiting-requests", str(args.max_waiting_requests or clients)]
        if not (os.path.isdir(args.model) or args.model.endswith(".gguf")):  # random weights: the benchmarks' tokenizer
            from bench.frontend import tokenizer_dir
            path = tokenizer_dir(args.tokenizer)
            flags = [*(["--tokenizer", str(path)] if path else []), *flags]
        server = ServerProcess(args.model, flags)
    api_key = args.api_key or os.environ.get("INFER_GRAPHS_API_KEY")
    try:
        result = asyncio.run(soak(args.url or server.url, duration, clients, seed, api_key))
    finally:
        stopped = server.stop() if server else None
    result = {"args": {"url": args.url, "model": None if args.url else args.model, "duration_s": duration,
                       "clients": clients, "seed": seed, "server_args": args.server_args}, **result}
    if stopped:
        result["server"] = stopped
    result["problems"] = problems(result)
    result["ok"] = not result["problems"]
    result["goals"] = goals(result)
    out = args.out
    if not out.endswith(".json"):
        out = os.path.join(out, "soak.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("phases", "end", "memory_mib", "problems", "goals")}, indent=1))
    print("wrote", out, file=sys.stderr)
    return 0 if result["ok"] else 1
