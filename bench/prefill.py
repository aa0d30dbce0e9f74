"""Suite `prefill`: latency of one prompt of T tokens (forward + last token's logits), one sequence.

Harness rows: bench's own bare infer_graphs backend (BackendConfig defaults, capture sizes = the measured
token counts) over bench/paged.py's metadata builder, the model called directly, no engine around it:
  eager             our model as an nn.Module (attention op through the dispatcher)
  compiled          infer_graphs backend, RuntimeMode.NONE: Inductor pieces, no graphs
  piecewise         infer_graphs backend, RuntimeMode.PIECEWISE: one graph per piece at T tokens;
                    its gpu_ms is the step's GPU time with the host far ahead (bench.measure.
                    gpu_ms_host_ahead): well under median_ms, the row is host-bound (the attention
                    launches between the pieces), not GPU-bound
  full_graph        the compiled forward captured whole as ONE native graph at T (FULL mode):
                    the no-launch-overhead ideal piecewise is compared with
  full_graph_eager  the un-compiled forward captured as one graph: launches gone, kernels unfused
  hf_eager          transformers, same config, one forward with logits_to_keep=1
Attention writes the prompt's K/V into a paged cache (as the engine's prefill does).
Engine row: what users run, through the public API only (engine.LLM, SamplingParams, llm.stats()):
  engine            LLM(model) over the same random-weight model with the engine's defaults (on CUDA:
                    compile, decode graphs, piecewise prefill graphs at the default token buckets, a
                    step budget of max_num_batched_tokens that chunks longer prompts) and prefix caching
                    off; one prompt of T fresh random tokens, SamplingParams(max_tokens=1) (greedy):
                    median_ms    the engine's step time for the prefill: add_request, then the wall time
                                 from the step() that launches it to the step() that returns its token
                                 (schedule, input staging, forward, sampling, read-back, the output)
                    ttft_ms      median RequestOutput.ttft_s of LLM.generate([prompt]) (arrival to token)
                    gpu_ms       the GPU's busy time in one such prefill (kernels and copies of a
                                 torch.profiler trace, the gaps between them left out; CUDA only): well
                                 under median_ms, the engine row is host-bound
                    engine_steps steps per prefill and the dispatcher's modes (from llm.stats())
                    host_ms      the host time of the step() that launches the prefill, with the GPU
                                 asleep (schedule, staging, every launch of the forward and of
                                 sampling): under gpu_ms, the step can run at the GPU's speed;
                                 host_us_per_layer is it over the decoder layers
                    pieces_host_us_per_layer  (engine row, where engine_full has host_ms too) the
                                 engine row's host_ms less engine_full's, over the layers: the host
                                 work between two pieces (a piece's replay and the attention call
                                 after it), the engine's own per-step work (schedule, staging,
                                 sampling), the same in both, left out
                    BENCH_PREFILL_PROFILE=DIR: one more such step per engine row at the largest T under
                    torch.profiler, the engine's stages marked: DIR/prefill-host-<mode>-<T>.txt / .json.gz
  engine_full       the same with cudagraph_mode FULL: the prefill replays one graph of the whole
                    forward (engine.worker.mixed_graphs), no launch between pieces
  engine_fp8        (--quantization fp8) the engine row over the same model with FP8 weights
                    (EngineConfig.quantization; above 64 rows the weight dequantized + cuBLAS, the
                    default), and engine_fp8_scaled_mm the same with INFER_GRAPHS_FP8_LARGE=scaled_mm
                    (torch._scaled_mm, activations quantized per token); floors from the FP8 weight
                    bytes and the bf16 matmul rate
Floor = max(weight bytes / copy bandwidth, (2 * matmul params * T + logits) / matmul rate).

Cost on an H100 (expected, qwen3-4b, --tokens 64,128,512): the harness ~1.5-2 min (one compile, captures
per T), transformers' eager peer ~20 s, the engine ~1-1.5 min (its start-up: compile, the default prefill
and decode graph captures; then a few seconds of prefills): about 3-4 minutes.
"""
from __future__ import annotations

import contextlib
import logging
import os
import statistics
import time

import torch

from bench.common import build_model, free_device_memory, parse_ints, rel_err
from bench.configs import load_config
from bench.floors import model_cost, prefill_floor_ms
from bench.measure import Report, gpu_ms_host_ahead, measure_ceilings, median_ms, plot_latency_vs_floor, ratio
from bench.paged import PagedKV, blocks_per_seq, step_inputs, step_metadata

TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048)
COLUMNS = ["variant", "tokens", "median_ms", "gpu_ms", "host_ms", "host_us_per_layer", "pieces_host_us_per_layer",
           "ttft_ms", "floor_ms", "x_floor", "x_full_graph", "tokens_per_s", "engine_steps"]
HARNESS_VARIANTS = ("eager", "compiled", "piecewise", "full_graph", "full_graph_eager")
# engine rows: the engine's default graph mode (FULL_AND_PIECEWISE on CUDA), and FULL (mixed-step graphs)
ENGINE_VARIANTS = {"engine": None, "engine_full": "FULL"}
ENGINE_WARMUP = 3     # LLM.generate calls per T before the engine row's timed ones
ENGINE_PROFILED = 5   # prefills per T in the torch.profiler trace that gives the engine row's gpu_ms
# prefills per T whose launching step() is timed for host_ms (median): five read 40 and 7.5 us a layer
# at 128 and 512 tokens on one H100 (2026-12-08), too few for a 30 us goal
HOST_TRIES = 15
ENGINE_MAX_MODEL_LEN = 4096  # the engine's default max_model_len is min(the model's limit, this)
PROFILE_ENV = "BENCH_PREFILL_PROFILE"  # a directory: one engine prefill step per engine row under torch.profiler
logger = logging.getLogger("bench")


def run(model: str, tokens=None, peers: str | None = None, iters: int = 20, quantization: str | None = None,
        **_: object) -> Report:
    from compile_backend import BackendConfig, InferGraphsBackend, mark_token_dim
    from custom_ops import RuntimeMode

    tokens = parse_ints(tokens, TOKENS)
    peers = peers or "all"
    on_cuda = torch.cuda.is_available()
    ceilings = measure_ceilings() if on_cuda else None
    net = build_model(model)
    cost = model_cost(net)
    report = Report("prefill", model, ceilings.device_name if ceilings else "cpu", COLUMNS)
    report.meta.update(weight_bytes=cost.weight_bytes, matmul_params=cost.matmul_params, tokens=tokens,
                       copy_bytes_per_s=ceilings.copy_bytes_per_s if ceilings else None,
                       matmul_flops_per_s=ceilings.matmul_flops_per_s if ceilings else None,
                       torch=torch.__version__)
    results: dict[tuple[str, int], float] = {}
    floor_costs = {}  # variant -> the ModelCost its floor reads, where it is not the model's as built

    def add(variant: str, t: int, ms: float) -> None:
        floor = prefill_floor_ms(floor_costs.get(variant, cost), t, ceilings.copy_bytes_per_s,
                                 ceilings.matmul_flops_per_s) if ceilings else None
        results[(variant, t)] = ms
        report.add(variant=variant, tokens=t, median_ms=ms, floor_ms=floor, x_floor=ratio(ms, floor),
                   tokens_per_s=t / ms * 1e3)

    kv = PagedKV.allocate(net, 1 + blocks_per_seq(max(tokens)))
    backend = InferGraphsBackend(BackendConfig(capture_sizes=tuple(tokens)))
    compiled = torch.compile(net, backend=backend, fullgraph=True)
    device = net.model.embed_tokens.weight.device
    graphs = {}
    with torch.inference_mode():
        for t in sorted(tokens, reverse=True):  # largest first: smaller graphs reuse the pool's blocks
            meta = step_metadata(1, 0, t, device)
            ids, pos = step_inputs(1, 0, t, net.config.vocab_size, device, seed=t)

            def run_model(fn, mode):
                with kv.context(meta, mode, t):
                    if fn is compiled:
                        mark_token_dim(ids, pos)
                    hidden = fn(ids, pos)
                return net.compute_logits(hidden[-1:])

            ms_eager = median_ms(lambda: run_model(net, RuntimeMode.NONE), iters=iters)
            reference = run_model(net, RuntimeMode.NONE).float()
            ms_compiled = median_ms(lambda: run_model(compiled, RuntimeMode.NONE), iters=iters)
            ms_piece = gpu_ms_piece = ms_full = ms_full_eager = None
            if on_cuda:  # on the CPU nothing is captured: a "piecewise" row would time the compiled pieces again
                ms_piece = median_ms(lambda: run_model(compiled, RuntimeMode.PIECEWISE), iters=iters)
                try:
                    gpu_ms_piece = gpu_ms_host_ahead(lambda: run_model(compiled, RuntimeMode.PIECEWISE))
                except RuntimeError as exc:  # the launch queue filled while the GPU slept: no figure
                    gpu_ms_piece = None
                    report.notes.append(f"piecewise gpu_ms at {t} tokens not measured: {exc}")
                piece_err = rel_err(run_model(compiled, RuntimeMode.PIECEWISE), reference)
                for variant, fn in (("full_graph", compiled), ("full_graph_eager", net)):
                    run_model(fn, RuntimeMode.FULL)  # warm-up outside the capture
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=backend.pool):
                        out = run_model(fn, RuntimeMode.FULL)
                    graphs[(variant, t)] = (graph, out, meta, ids, pos)
                    ms = median_ms(graph.replay, iters=iters)
                    if variant == "full_graph":
                        ms_full = ms
                    else:
                        ms_full_eager = ms
            add("eager", t, ms_eager)
            add("compiled", t, ms_compiled)
            if ms_piece is not None:
                add("piecewise", t, ms_piece)
                report.rows[-1]["piecewise_vs_eager_rel_err"] = piece_err
                report.rows[-1]["gpu_ms"] = gpu_ms_piece
            if ms_full is not None:
                add("full_graph", t, ms_full)
                add("full_graph_eager", t, ms_full_eager)
    if not on_cuda:
        report.notes.append("no piecewise or full-graph rows: graphs are captured on CUDA only")
    report.meta["backend_stats"] = {k: v for k, v in vars(backend.stats).items() if k != "capture_seconds"}
    graphs.clear()
    kv.release()
    del compiled, backend  # the model stays: the engine row runs it
    torch._dynamo.reset()
    free_device_memory()
    report.notes.append(
        f"harness rows ({', '.join(HARNESS_VARIANTS)}): bench's own bare infer_graphs backend (BackendConfig "
        f"defaults, capture sizes {list(tokens)}) over bench/paged.py's metadata builder, the model called "
        "directly: no scheduler, input staging, sampling or read-back; not what the engine runs (the engine "
        "row is)")

    if peers in ("all", "eager"):
        from bench import hf_peers
        hf = hf_peers.hf_model(load_config(model), device="cuda" if on_cuda else "cpu",
                               dtype=torch.bfloat16 if on_cuda else torch.float32)
        with torch.no_grad():
            for t in tokens:
                add("hf_eager", t, median_ms(hf_peers.prefill_eager_step(hf, t), iters=iters))
        del hf
        free_device_memory()

    # on the CPU every mode resolves to NONE: one engine row
    variants = [(variant, mode, None) for variant, mode in (ENGINE_VARIANTS if on_cuda else {"engine": None}).items()]
    if quantization:
        variants.append((f"engine_{quantization}", None, None))
        if on_cuda:  # on the CPU every FP8 matmul dequantizes: the row would repeat engine_fp8
            variants.append((f"engine_{quantization}_scaled_mm", None, "scaled_mm"))
    for variant, mode, large in variants:
        if variant.startswith("engine_fp8") and not floor_costs:
            from models import quantize_fp8
            quantize_fp8(net)  # in place, once the engines over the model as built are closed
            floor_costs.update({f"engine_{quantization}": model_cost(net),
                                f"engine_{quantization}_scaled_mm": model_cost(net)})
            report.meta["fp8_weight_bytes"] = model_cost(net).weight_bytes
        with _fp8_large(large):
            engine = engine_prefill(net, tokens, iters, report, mode,
                                    quantization if variant.startswith("engine_fp8") else None)
        torch._dynamo.reset()
        free_device_memory()
        for t, m in sorted(engine.items()):
            add(variant, t, m["step_ms"])
            report.rows[-1].update({k: m[k] for k in ("gpu_ms", "ttft_ms", "engine_steps", "host_ms",
                                                      "host_us_per_layer") if m.get(k) is not None})
    pieces_host_per_layer(report.rows, len(net.model.layers))
    del net
    torch._dynamo.reset()
    free_device_memory()
    for row in report.rows:
        full = results.get(("full_graph", row["tokens"]))
        row["x_full_graph"] = ratio(row["median_ms"], full)
        hf = results.get(("hf_eager", row["tokens"]))
        if hf is not None:
            row["speedup_vs_hf_eager"] = hf / row["median_ms"]
    report.columns = COLUMNS + ["speedup_vs_hf_eager"]
    report.rows.sort(key=lambda r: (r["tokens"], r["variant"]))
    report.plots.append(("latency", plot_prefill))
    return report


def pieces_host_per_layer(rows: list[dict], layers: int) -> None:
    """Set `pieces_host_us_per_layer` on each engine row whose token count has an engine_full row,
    both with host_ms: the piecewise step's host time less the FULL step's (one graph launch), over the
    layers."""
    full = {r["tokens"]: r.get("host_ms") for r in rows if r["variant"] == "engine_full"}
    for row in rows:
        if row["variant"] == "engine" and row.get("host_ms") is not None and full.get(row["tokens"]) is not None:
            row["pieces_host_us_per_layer"] = (row["host_ms"] - full[row["tokens"]]) * 1e3 / layers


@contextlib.contextmanager
def _fp8_large(method: str | None):
    """INFER_GRAPHS_FP8_LARGE=method inside the block (custom_ops.gemv_table.fp8_large_method)."""
    from custom_ops.gemv_table import FP8_LARGE_ENV
    previous = os.environ.get(FP8_LARGE_ENV)
    if method is not None:
        os.environ[FP8_LARGE_ENV] = method
    try:
        yield
    finally:
        if method is not None:
            if previous is None:
                os.environ.pop(FP8_LARGE_ENV, None)
            else:
                os.environ[FP8_LARGE_ENV] = previous


def engine_prefill(net, tokens, iters: int, report: Report, mode: str | None = None,
                   quantization: str | None = None) -> dict[int, dict]:
    """The engine row per token count (see the module docstring): an LLM over `net` with the engine's
    defaults (cudagraph_mode `mode` where given, EngineConfig.quantization `quantization`) and prefix
    caching off, through its public API only; closed before this returns. Token counts the engine
    refuses are left out, with a note."""
    from engine import LLM, InvalidRequestError, SamplingParams

    on_cuda = torch.cuda.is_available()
    vocab = net.config.vocab_size
    generator = torch.Generator().manual_seed(0x5EED)
    params = SamplingParams(max_tokens=1)  # greedy, one token: the prefill's own

    def prompt(t: int) -> list[int]:
        # fresh every call (and prefix caching off): no prefill is served from another's blocks
        return torch.randint(0, vocab, (t,), generator=generator).tolist()

    def one_prefill(ids: list[int]) -> float:
        """Seconds from the step() that launches the request's prefill to the one that returns its token."""
        request_id = llm.add_request(ids, params)
        start = time.perf_counter()
        while True:
            outputs = llm.step()
            if any(o.request_id == request_id and o.finished for o in outputs):
                return time.perf_counter() - start
            if not llm.has_unfinished_requests():
                raise RuntimeError(f"engine row: request {request_id} ended without an output")

    fields = dict(enable_prefix_caching=False, show_progress=False)  # the rest: the engine's defaults
    if mode is not None:
        fields["cudagraph_mode"] = mode
    if quantization is not None:
        fields["quantization"] = quantization
    if max(tokens) > ENGINE_MAX_MODEL_LEN:
        fields["max_model_len"] = max(tokens)
    llm = LLM(net, **fields)
    results: dict[int, dict] = {}
    skipped = []
    try:
        for t in sorted(tokens):
            try:
                for _ in range(ENGINE_WARMUP):
                    llm.generate([prompt(t)], params)
            except InvalidRequestError as exc:
                skipped.append(f"{t} tokens ({exc})")
                continue
            ttfts = []
            for _ in range(iters):
                (out,) = llm.generate([prompt(t)], params)
                if len(out.token_ids) != 1 or out.ttft_s is None:
                    raise RuntimeError(f"engine row: a {t}-token prompt gave {len(out.token_ids)} tokens, "
                                       f"ttft_s {out.ttft_s}; expected one token and its TTFT")
                ttfts.append(out.ttft_s)
            before = llm.stats()
            step_s = [one_prefill(prompt(t)) for _ in range(iters)]
            after = llm.stats()
            steps = (after["steps"] - before["steps"]) / iters
            modes = {mode: (n - before["modes"].get(mode, 0)) / iters for mode, n in after["modes"].items()
                     if n != before["modes"].get(mode, 0)}
            results[t] = {"step_ms": statistics.median(step_s) * 1e3, "ttft_ms": statistics.median(ttfts) * 1e3,
                          "gpu_ms": None, "engine_steps": _steps_text(steps, modes)}
        if on_cuda and results:
            layers = len(net.model.layers)
            for t in results:
                host = _engine_host_ms(llm, lambda: llm.add_request(prompt(t), params))
                results[t]["host_ms"] = host
                results[t]["host_us_per_layer"] = None if host is None else host * 1e3 / layers
            if profile_dir := os.environ.get(PROFILE_ENV):
                t = max(results)
                _profile_host_step(llm, lambda: llm.add_request(prompt(t), params),
                                   os.path.join(profile_dir, f"prefill-host-{mode or 'default'}-{t}"))
            # after every timed call: the profiler must not sit under another measurement
            for t in results:
                results[t]["gpu_ms"] = _engine_gpu_ms(lambda: one_prefill(prompt(t)))
            if any(r["gpu_ms"] is None for r in results.values()):
                report.notes.append("engine gpu_ms missing where the profiler recorded no device activity")
        stats = llm.stats()
        config = getattr(llm, "config", None)  # read for the note only; the rows need none of it
    finally:
        llm.close()
        del llm
    report.meta["engine_stats"] = {k: v for k, v in stats.items() if k != "backend"}

    def cfg(name: str):
        return getattr(config, name, "?")
    sizes = cfg("prefill_graph_sizes")
    report.notes.append(
        f"engine rows: engine.LLM over the same random-weight model, the engine's defaults (compile "
        f"{cfg('compile')}, decode graphs {cfg('cuda_graphs')}, prefill graphs {cfg('prefill_graphs')}"
        + (f" at {len(sizes)} token buckets up to {max(sizes)}" if isinstance(sizes, (tuple, list)) and sizes
           and cfg("prefill_graphs") else "")
        + f", max_num_batched_tokens {cfg('max_num_batched_tokens')}: longer prompts are chunked over several "
        f"steps, async scheduling {cfg('async_scheduling')}), prefix caching off, no tokenizer; one prompt of T "
        f"fresh random tokens, max_tokens=1, greedy; {ENGINE_WARMUP} warm-up generate calls per T, then "
        f"{iters} timed ones for ttft_ms (RequestOutput.ttft_s) and {iters} add_request + step() prefills for "
        "median_ms (launching step to token on the host)"
        + (f"; gpu_ms: the GPU's busy time in one prefill (kernels and copies of a torch.profiler trace of "
           f"{ENGINE_PROFILED} prefills, gaps left out, so it reads a little under the harness rows' "
           "back-to-back gpu_ms): far under median_ms, the engine's step is host-bound" if on_cuda else
           "; no gpu_ms on the CPU")
        + "; engine_steps: steps per prefill and the dispatcher's modes (llm.stats())")
    if skipped:
        report.notes.append("engine rows skipped: " + "; ".join(skipped))
    return results


def _profile_host_step(llm, add, prefix: str, sleep_cycles: int = 200_000_000) -> None:
    """The step() that launches a prefill, with the GPU asleep, under torch.profiler with the engine's
    stages marked (bench/step_timeline.py): where the engine row's host_ms goes."""
    from bench.step_timeline import profile_stages
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    loop, runner = llm._loop, llm.runtime.runner
    stages = [(loop, "step", "step"), (llm.scheduler, "schedule", "schedule"), (loop, "_launch", "launch"),
              (runner, "execute", "execute"), (runner, "run_staged", "run_staged"),
              (llm.runtime.sampler, "sample", "sample")]
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep_cycles)
    add()
    profile_stages(llm.step, prefix, stages)
    while llm.has_unfinished_requests():
        llm.step()
    torch.cuda.synchronize()


def _engine_host_ms(llm, add, sleep_cycles: int = 200_000_000, tries: int = HOST_TRIES) -> float | None:
    """Median host milliseconds of the step() that launches a prefill, with the GPU asleep so the host
    never waits for it: schedule, staging, and every launch of the forward (each piece's replay and
    each attention launch between them) and of sampling. The overlapped loop returns from that step()
    without reading the token (the next one does), so nothing in it waits for the GPU; a try whose
    step outlasted the sleep is dropped. None where the loop is synchronous or every try was dropped."""
    if not llm.config.async_scheduling:
        return None
    samples = []
    for _ in range(tries):
        torch.cuda.synchronize()
        asleep, awake = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        asleep.record()
        torch.cuda._sleep(sleep_cycles)
        awake.record()
        add()
        start = time.perf_counter()
        llm.step()
        host_ms = (time.perf_counter() - start) * 1e3
        while llm.has_unfinished_requests():
            llm.step()
        torch.cuda.synchronize()
        if host_ms < asleep.elapsed_time(awake):
            samples.append(host_ms)
    return statistics.median(samples) if samples else None


def _steps_text(steps: float, modes: dict[str, float]) -> str:
    """'1 piecewise', '2 piecewise', '1 none': steps per prefill and the modes they ran in."""
    def num(x: float) -> str:
        return f"{x:g}" if x == int(x) else f"{x:.2f}"
    parts = [f"{num(n)} {mode}" for mode, n in sorted(modes.items())]
    if not parts or sum(modes.values()) != steps:
        parts.insert(0, f"{num(steps)} step{'' if steps == 1 else 's'}")
    return ", ".join(parts)


def _engine_gpu_ms(prefill) -> float | None:
    """Milliseconds the GPU is busy (kernels, copies; union of their intervals) per call of prefill, from
    a torch.profiler trace of ENGINE_PROFILED calls; None if the trace holds no device activity."""
    from bench.profiling import kernel_intervals, merge_intervals
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(ENGINE_PROFILED):
            prefill()
        torch.cuda.synchronize()
    busy = merge_intervals(kernel_intervals(prof))
    if not busy:
        return None
    return sum(end - start for start, end in busy) / 1e3 / ENGINE_PROFILED


def plot_prefill(report: Report):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    plot_latency_vs_floor(ax, report.rows, "tokens", "prompt tokens", "ms per prefill", f"prefill, {report.model}")
    return fig
