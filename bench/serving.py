"""Suite `serving`: the seed's server workloads over real HTTP, graphs off / decode graphs / decode + prefill graphs.

For each configuration the suite starts `python -m bench.serving --serve MODEL ...` (the engine's own
server, `engine.entrypoints.server.serve_llm`, over the benchmark model with random weights: they time like real
ones) on 127.0.0.1, or uses a running server given by `--url`. An async HTTP client (httpx) sends each
workload as streamed /v1/completions with token-id prompts and ignore_eos, so every run generates the
same tokens; requests arrive on a seeded Poisson clock, except `baseline` (one request at a time).
As users run it, the server holds a real tokenizer (the Gemma 3 one, bench.frontend; `--tokenizer DIR`,
default bench/.tokenizer written by `python -m bench tokenizer`; `--tokenizer none` for none), so it
detokenizes and streams text, and STOP_SHARE of each workload's requests carry the two stop strings
bench.frontend.STOP_STRINGS (never matched by random text: lengths stay fixed, the scan runs every step).

Workloads (the phase-9 design's benchmark plan):
- baseline:            one request at a time (the per-request latency floor of the server)
- continuous_batching: mixed prompt and output lengths, Poisson arrivals
- chunked_prefill:     long prompts arriving among many decode-heavy requests
- prefix_caching:      every prompt starts with one shared system prompt (with --enable-prefix-caching
                       when the engine has that option)
Per row: requests sent and completed side by side, output throughput, TTFT / ITL / end-to-end P50 and
P99 as the client sees them, and the graph memory the server reports on /metrics. Each measured run
follows an unmeasured warm-up run of the same workload (first-use compilation stays out of it).
A "(in-process LLM)" row runs the baseline through LLM.add_request / step in this process with the
same options: the difference to the HTTP baseline row is what serving adds.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.server_process import ServerProcess
from bench.e2e import _graph_replays
from bench.frontend import STOP_STRINGS, load_tokenizer, tokenizer_dir
from bench.measure import Report, ratio
from bench.workload import RequestSpec, make_workload, percentile, with_stops

CONFIGS = {
    "graphs off": ["--no-cuda-graphs"],
    "decode graphs": [],
    "decode + prefill graphs": ["--prefill-graphs"],
}
CONFIG_ALIASES = {"off": "graphs off", "decode": "decode graphs", "prefill": "decode + prefill graphs"}
WORKLOADS = ("baseline", "continuous_batching", "chunked_prefill", "prefix_caching")
# On request only (--workloads batch_16,...): N requests sent at once, e2e's shape (512-token prompts,
# 128 tokens out on CUDA), every one with the stop strings; each has an in-process row (LLM.generate
# of the same requests, same options): issue 38's "through the server within 5% of in-process".
BATCH_PREFIX = "batch_"
BLOCK_SIZE, MAX_NUM_BATCHED_TOKENS = 16, 1024  # passed to every server, so the report's note states what ran
COLUMNS = ["config", "workload", "sent", "completed", "output_tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
           "itl_p99_ms", "tpot_p50_ms", "e2e_p50_ms", "e2e_p99_ms", "graph_mib", "makespan_s", "graph_replay_ms", "itl_x_replay"]
REPLAY_ITERS = 30  # replays timed for an in-process batch row's graph_replay_ms (as bench e2e's default)
STOP_SHARE = 0.5  # of each workload's requests, with the stop strings (when the server has a tokenizer)


@dataclass
class Sizes:
    """Workload sizes: realistic on CUDA, tiny for the CPU smoke run."""
    requests: int
    rate: float
    prompt: tuple[int, int]
    output: tuple[int, int]
    long_prompt: tuple[int, int]
    system_prompt: int
    max_num_seqs: int

    @property
    def max_model_len(self) -> int:
        return max(self.long_prompt[1], self.system_prompt + self.prompt[1]) + self.output[1] + 16


def sizes_for(on_cuda: bool, requests: int | None, rate: float | None) -> Sizes:
    if on_cuda:
        return Sizes(requests or 128, rate or 16.0, (64, 768), (32, 256), (1536, 3072), 1024, 32)
    return Sizes(requests or 6, rate or 50.0, (8, 24), (4, 10), (48, 64), 32, 4)


def make(workload: str, s: Sizes, vocab_size: int, warm_up: bool = False,
         stop: tuple[str, ...] = ()) -> tuple[list[RequestSpec], int | None]:
    """The requests of a workload and its concurrency limit (None: arrivals decide); STOP_SHARE of them
    carry the `stop` strings.

    `warm_up`: the same shapes with other random prompts (the shared system prompt stays the same), so
    a prefix cache warmed by the warm-up run holds what a long-running server would, not the measured
    run's own prompts."""
    specs, concurrency = _make(workload, s, vocab_size, warm_up)
    share = 1.0 if batch_size(workload) is not None else STOP_SHARE
    return with_stops(specs, stop, share, seed=len(specs)), concurrency


def batch_size(workload: str) -> int | None:
    """N of a `batch_N` workload; None for the others."""
    if not workload.startswith(BATCH_PREFIX):
        return None
    n = workload[len(BATCH_PREFIX):]
    if not n.isdigit() or int(n) < 1:
        raise ValueError(f"workload {workload!r}: {BATCH_PREFIX}N takes a batch size N >= 1")
    return int(n)


def _make(workload: str, s: Sizes, vocab_size: int, warm_up: bool) -> tuple[list[RequestSpec], int | None]:
    shift = 100 if warm_up else 0
    if (n := batch_size(workload)) is not None:
        prompt = 512 if s.prompt[1] >= 512 else s.prompt[1]
        output = 128 if s.output[1] >= 128 else s.output[1]
        return make_workload(n, float("inf"), (prompt, prompt), (output, output), vocab_size, seed=6 + n + shift), n
    if workload == "baseline":
        n = max(2, s.requests // 8)
        prompt = 512 if s.prompt[1] >= 512 else s.prompt[1]
        return make_workload(n, float("inf"), (prompt, prompt), (s.output[1] // 2,) * 2, vocab_size,
                             seed=1 + shift), 1
    if workload == "continuous_batching":
        return make_workload(s.requests, s.rate, s.prompt, s.output, vocab_size, seed=0 + shift), None
    if workload == "chunked_prefill":
        short = make_workload(s.requests, s.rate, (s.prompt[0], s.prompt[0] * 2), s.output, vocab_size,
                              seed=2 + shift)
        long = make_workload(max(2, s.requests // 16), s.rate / 16, s.long_prompt, (8, 16), vocab_size,
                             seed=3 + shift)
        return sorted(short + long, key=lambda r: r.arrival_s), None
    if workload == "prefix_caching":
        rng = random.Random(4)
        system = tuple(rng.randrange(3, vocab_size) for _ in range(s.system_prompt))
        specs = make_workload(s.requests, s.rate, (s.prompt[0], s.prompt[0] * 2), s.output, vocab_size,
                              seed=5 + shift)
        return [RequestSpec(r.arrival_s, len(system) + r.prompt_len, r.output_len, system + r.prompt_ids)
                for r in specs], None
    raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")


@dataclass
class Result:
    sent_s: float
    token_times: list[tuple[float, int]] = field(default_factory=list)  # (arrival of a chunk, its tokens)
    tokens: int = 0
    text_chars: int = 0  # streamed text (none without a tokenizer)
    error: str | None = None


async def _one(client, url: str, model: str, spec: RequestSpec) -> Result:
    result = Result(time.perf_counter())
    body = {"model": model, "prompt": list(spec.prompt_ids), "max_tokens": spec.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    if spec.stop:
        body["stop"] = list(spec.stop)
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    continue
                k = sum(len(c.get("token_ids") or []) for c in chunk["choices"])
                result.text_chars += sum(len(c.get("text") or "") for c in chunk["choices"])
                if k:
                    result.token_times.append((time.perf_counter(), k))
                    result.tokens += k
    except Exception as exc:  # a lost request is reported, never hides the others
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def send_workload(url: str, model: str, specs: list[RequestSpec], concurrency: int | None) -> tuple[list[Result], float]:
    """Send every request (at its arrival time, or `concurrency` at a time); (results, makespan)."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter()
        if concurrency == 1:
            results = [await _one(client, url, model, spec) for spec in specs]
        else:
            async def at_arrival(spec):
                await asyncio.sleep(max(0.0, start + spec.arrival_s - time.perf_counter()))
                return await _one(client, url, model, spec)
            results = await asyncio.gather(*(at_arrival(spec) for spec in specs))
        return list(results), time.perf_counter() - start


def summarize(specs: list[RequestSpec], results: list[Result], makespan_s: float) -> dict:
    done = [r for r, s in zip(results, specs) if r.error is None and r.tokens == s.output_len]
    ttfts = [r.token_times[0][0] - r.sent_s for r in done]
    e2es = [r.token_times[-1][0] - r.sent_s for r in done]
    itls = [(b - a) / k for r in done for (a, _), (b, k) in zip(r.token_times, r.token_times[1:]) for _ in range(k)]
    # time per output token after the first, per request (vLLM's TPOT): unlike the ITL percentiles it
    # does not depend on how the client's reads group the stream's events
    tpots = [(r.token_times[-1][0] - r.token_times[0][0]) / (r.tokens - 1) for r in done if r.tokens > 1]
    tokens = sum(r.tokens for r in done)
    ms = lambda v: None if v is None else v * 1e3  # noqa: E731
    return {"sent": len(specs), "completed": len(done), "output_tok_per_s": tokens / makespan_s,
            "ttft_p50_ms": ms(percentile(ttfts, 50)), "ttft_p99_ms": ms(percentile(ttfts, 99)),
            "itl_p50_ms": ms(percentile(itls, 50)), "itl_p99_ms": ms(percentile(itls, 99)),
            "tpot_p50_ms": ms(percentile(tpots, 50)), "e2e_p50_ms": ms(percentile(e2es, 50)), "e2e_p99_ms": ms(percentile(e2es, 99)), "makespan_s": makespan_s,
            "errors": sorted({r.error for r in results if r.error})[:3]}


def _metric(url: str, name: str) -> float:
    import httpx
    match = re.search(rf"^{name} (\S+)$", httpx.get(f"{url}/metrics", timeout=60).text, re.M)
    return float(match.group(1)) if match else 0.0


def run(model: str, requests: int | None = None, rate: float | None = None, configs=None, workloads=None,
        url: str | None = None, tokenizer: str | None = None, servers: str | None = None, **_: object) -> Report:
    """tokenizer: the directory of the tokenizer the servers hold (default bench/.tokenizer; "none": none,
    and no stop strings). With `url`, the running server's own tokenizer is whatever it was given.
    servers: "process" (default: the engine in a process of its own, serve's default), "thread"
    (--no-engine-process: the engine loop a thread of the server) or both, comma-separated: each
    configuration's workloads run against each, the config column saying which ("/engine_thread")."""
    from bench.configs import load_config
    from engine.entrypoints.cli_args import ENGINE_OPTIONS

    on_cuda = torch.cuda.is_available()
    s = sizes_for(on_cuda, requests, rate)
    vocab = load_config(model)["vocab_size"]
    tok_dir = tokenizer_dir(tokenizer)  # fails early, with how to make it, when the directory is missing
    if tok_dir is not None:
        load_tokenizer(tok_dir, vocab)  # checks it covers the vocabulary before any server starts
    stop = STOP_STRINGS if tok_dir is not None else ()
    chosen = [w.strip() for w in workloads.split(",")] if isinstance(workloads, str) else list(workloads or WORKLOADS)
    batches = [n for w in chosen if (n := batch_size(w)) is not None]
    if batches:  # every request of the largest batch runs at once
        s.max_num_seqs = max(s.max_num_seqs, *batches)
    blocks = 1 + s.max_num_seqs * -(-s.max_model_len // BLOCK_SIZE)
    engine_flags = ["--max-num-seqs", str(s.max_num_seqs), "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
                    "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks", str(blocks), "--max-model-len",
                    str(s.max_model_len), "--no-progress"]
    report = Report("serving", model, torch.cuda.get_device_name() if on_cuda else "cpu", COLUMNS)
    report.notes.append(
        f"over HTTP (httpx, streamed /v1/completions, token-id prompts, ignore_eos); {s.requests} requests per "
        f"Poisson workload at {s.rate:g}/s, prompt {s.prompt[0]}-{s.prompt[1]}, output {s.output[0]}-{s.output[1]}, "
        f"long prompts {s.long_prompt[0]}-{s.long_prompt[1]}, shared system prompt {s.system_prompt} tokens; "
        f"max_num_seqs={s.max_num_seqs}, max_num_batched_tokens={MAX_NUM_BATCHED_TOKENS}, {blocks} KV blocks of "
        f"{BLOCK_SIZE}; each measured run follows a warm-up run of the same shapes with other prompts (the same system prompt)")
    report.notes.append(
        f"front end: the engine holds the tokenizer in {tok_dir} (it detokenizes and streams text); {STOP_SHARE:.0%} of "
        f"each workload's requests carry the stop strings {list(stop)} (never in random text, so lengths stay fixed)"
        if tok_dir is not None else "front end: NO tokenizer (--tokenizer none): no text, no stop strings (not what "
                                    "users run)")
    report.meta.update(tokenizer=str(tok_dir) if tok_dir else None, stop=list(stop), stop_share=STOP_SHARE)
    tok_flags = ["--tokenizer", str(tok_dir)] if tok_dir is not None else []
    prefix_flag = "--enable-prefix-caching" in ENGINE_OPTIONS
    if "prefix_caching" in chosen and not prefix_flag:
        report.notes.append("prefix_caching ran WITHOUT a prefix cache: this engine has no --enable-prefix-caching")
    kinds = parse_servers(servers)
    targets = {"external": (None, [])} if url else {
        name + SERVER_SUFFIX[kind]: (name, [*CONFIGS[name], *SERVER_FLAGS[kind]])
        for name in config_names(configs) for kind in kinds}
    measured_in_process: set[str | None] = set()
    for name, (config, flags) in targets.items():
        # one server per configuration; prefix_caching gets its own, started with the prefix cache on
        # (the others run without it: their prompts share nothing, so it would only add bookkeeping)
        groups = [[w for w in chosen if w != "prefix_caching"], [w for w in chosen if w == "prefix_caching"]]
        no_cache = ["--no-prefix-caching"] if prefix_flag else []
        for group, extra in zip(groups, (no_cache, ["--enable-prefix-caching"] if prefix_flag else [])):
            if not group:
                continue
            server = None if url else ServerProcess(model, [*engine_flags, *flags, *extra, *tok_flags])
            try:
                for workload in group:
                    _measure(report, name, workload, url or server.url, *make(workload, s, vocab, stop=stop),
                             warm_up=make(workload, s, vocab, warm_up=True, stop=stop)[0])
            finally:
                if server is not None:
                    server.stop()
        in_process = [w for w in chosen if w == "baseline" or batch_size(w) is not None] if not url else []
        if config in measured_in_process:  # the in-process rows do not depend on the server's kind
            in_process = []
        measured_in_process.add(config)
        if in_process:
            _measure_in_process(report, config, model, [*engine_flags, *CONFIGS[config], *no_cache],
                                {w: (make(w, s, vocab, stop=stop)[0], make(w, s, vocab, warm_up=True, stop=stop)[0])
                                 for w in in_process}, tok_dir)
    return report


SERVER_FLAGS = {"thread": ["--no-engine-process"], "process": ["--engine-process"]}
SERVER_SUFFIX = {"thread": "/engine_thread", "process": ""}  # serve's default, the engine process, unmarked


def parse_servers(servers: str | None) -> list[str]:
    """`--servers thread,process` -> the kinds of server to start, in the order given."""
    kinds = [k.strip() for k in (servers or "process").split(",")]
    unknown = [k for k in kinds if k not in SERVER_FLAGS]
    if unknown:
        raise ValueError(f"--servers: unknown {unknown}; choose from {sorted(SERVER_FLAGS)}")
    return kinds


def config_names(configs: str | list[str] | None) -> list[str]:
    """`--configs off,decode,prefill` (or the full names) -> the CONFIGS keys, in the order given."""
    if configs is None:
        return list(CONFIGS)
    names = [c.strip() for c in configs.split(",")] if isinstance(configs, str) else list(configs)
    unknown = [n for n in names if n not in CONFIGS and n not in CONFIG_ALIASES]
    if unknown:
        raise ValueError(f"--configs: unknown {unknown}; choose from {sorted(CONFIG_ALIASES)} or {sorted(CONFIGS)}")
    return [CONFIG_ALIASES.get(n, n) for n in names]


def _progress(row: dict) -> None:
    # the suite writes its report at the end; a run cut short by a time limit still leaves its rows in the log
    print("row", json.dumps(row, default=str), file=sys.stderr, flush=True)


def _measure(report: Report, config: str, workload: str, url: str, specs: list[RequestSpec],
             concurrency: int | None, warm_up: list[RequestSpec]) -> None:
    import httpx
    served = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
    asyncio.run(send_workload(url, served, warm_up, concurrency))
    results, makespan = asyncio.run(send_workload(url, served, specs, concurrency))
    graph_bytes = _metric(url, "infer_graphs_decode_graph_bytes") + _metric(url, "infer_graphs_piecewise_graph_bytes")
    row = summarize(specs, results, makespan)
    errors = row.pop("errors")
    if report.meta.get("tokenizer") and not any(r.text_chars for r in results):
        errors = [*errors, "no text streamed: the server did not detokenize"]
    report.add(config=config, workload=workload, graph_mib=graph_bytes / 2**20, **row)
    _progress(report.rows[-1])
    if errors:
        report.notes.append(f"{config} / {workload}: errors {errors}")


def _measure_in_process(report: Report, config: str, model: str, flags: list[str],
                        workloads: dict[str, tuple[list[RequestSpec], list[RequestSpec]]],
                        tok_dir: Path | None = None) -> None:
    """Each workload (its requests, its warm-up's) in this process with the same engine options and
    tokenizer: the reference the HTTP rows are compared with (what HTTP, JSON, SSE and the engine loop
    add). One engine serves them in turn, as one server does. The baseline runs through
    LLM.add_request / step one request at a time, a batch_N workload as one LLM.generate, whose row
    also times the decode graph alone at the batch's mid-generation context (e2e's graph_replay_ms:
    issue 38's other reference, so one run gives ITL over replay and HTTP over in-process)."""
    from bench.common import build_model, free_device_memory
    from engine import LLM, SamplingParams
    from engine.entrypoints.cli_args import OneLineErrorParser, add_engine_args, engine_config_fields

    parser = OneLineErrorParser(prog="bench.serving")
    add_engine_args(parser)
    net = build_model(model)
    tok = load_tokenizer(tok_dir, net.config.vocab_size) if tok_dir is not None else None
    fields = engine_config_fields(parser.parse_args(flags))
    fields.pop("tokenizer", None)  # the tokenizer object is passed itself
    llm = LLM(net, tokenizer=tok, **fields)

    def params(spec):
        return SamplingParams(max_tokens=spec.output_len, ignore_eos=True, stop=spec.stop)

    def one_at_a_time(specs):
        outs, start = [], time.perf_counter()
        for spec in specs:
            rid = llm.add_request(list(spec.prompt_ids), params(spec))
            while llm.has_unfinished_requests():
                outs += [o for o in llm.step() if o.finished and o.request_id == rid]
        return outs, time.perf_counter() - start

    def all_at_once(specs):
        start = time.perf_counter()
        outs = llm.generate([list(spec.prompt_ids) for spec in specs], [params(spec) for spec in specs])
        return outs, time.perf_counter() - start

    try:
        for workload, (specs, warm_up) in workloads.items():
            run_all = one_at_a_time if workload == "baseline" else all_at_once
            run_all(warm_up)
            outs, makespan = run_all(specs)
            replay = None
            if (n := batch_size(workload)) is not None and torch.cuda.is_available():
                times, _ = _graph_replays(llm, [n], net.config.vocab_size,
                                          specs[0].prompt_len + specs[0].output_len // 2, REPLAY_ITERS)
                replay = times.get(n)
            _add_in_process_row(report, config, workload, specs, outs, makespan, replay)
    finally:
        llm.close()
        del llm, net
        torch._dynamo.reset()
        free_device_memory()


def _add_in_process_row(report: Report, config: str, workload: str, specs: list[RequestSpec], outs: list,
                        makespan: float, replay: float | None) -> None:
    ttfts = [o.ttft_s for o in outs]
    e2es = [o.ttft_s + sum(o.inter_token_latencies_s) for o in outs]
    itls = [x for o in outs for x in o.inter_token_latencies_s]
    tpots = [sum(o.inter_token_latencies_s) / len(o.inter_token_latencies_s) for o in outs if o.inter_token_latencies_s]
    ms = lambda v: None if v is None else v * 1e3  # noqa: E731
    report.add(config=f"{config} (in-process LLM)", workload=workload, sent=len(specs), completed=len(outs),
               output_tok_per_s=sum(len(o.token_ids) for o in outs) / makespan,
               ttft_p50_ms=ms(percentile(ttfts, 50)), ttft_p99_ms=ms(percentile(ttfts, 99)),
               itl_p50_ms=ms(percentile(itls, 50)), itl_p99_ms=ms(percentile(itls, 99)),
               tpot_p50_ms=ms(percentile(tpots, 50)),
               e2e_p50_ms=ms(percentile(e2es, 50)), e2e_p99_ms=ms(percentile(e2es, 99)), graph_mib=None,
               makespan_s=makespan, graph_replay_ms=replay,
               itl_x_replay=ratio(ms(percentile(itls, 50)), replay) if replay else None)
    _progress(report.rows[-1])


def _serve_main(argv: list[str]) -> int:
    """The server child: the benchmark model (random weights) built in-process, served by the engine."""
    import functools
    import logging

    from engine.entrypoints.cli_args import OneLineErrorParser, add_engine_args, engine_config_fields
    from engine.entrypoints.server import serve_engine_process, serve_llm

    parser = OneLineErrorParser(prog="python -m bench.serving --serve")
    add_engine_args(parser)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                        help="the engine in a process of its own (serve's default)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    fields = engine_config_fields(args)
    fields.pop("tokenizer", None)
    build = functools.partial(build_served_llm, args.model, getattr(args, "tokenizer", None), fields)
    if args.engine_process:
        return serve_engine_process(build, args.model, port=args.port)
    return serve_llm(build(), args.model, port=args.port)


def build_served_llm(model: str, tokenizer: str | None, fields: dict) -> Any:
    """The served engine: the benchmark model with random weights. `tokenizer` is a directory
    bench/tokenizer.py wrote (no config.json): loaded here and handed to the engine as an object,
    LLM(..., tokenizer=...), as the in-process reference does. Module-level: the engine process builds it."""
    from bench.common import build_model
    from engine import LLM

    net = build_model(model)
    tok = load_tokenizer(tokenizer, net.config.vocab_size) if tokenizer else None
    return LLM(net, tokenizer=tok, **fields)


if __name__ == "__main__":
    if sys.argv[1:2] != ["--serve"]:
        sys.exit("usage: python -m bench.serving --serve --model NAME [engine options] (run the suite with "
                 "python -m bench serving)")
    sys.exit(_serve_main(sys.argv[2:]))
