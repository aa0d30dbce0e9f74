"""Suite `e2e`: what a user sees through `LLM.generate`, next to what the GPU alone could do.

Per batch size B and front-end variant (bench.frontend: `plain` no tokenizer, `tokenizer` the engine
holds the Gemma 3 tokenizer and detokenizes every step, `stop` that + 2 stop strings scanned every step
that never match random text; the row's `tokenizer` and `stop_strings` columns), one engine per
tokenizer setting, each built as a user builds it (the engine's defaults: on CUDA compile, decode graphs
and piecewise prefill graphs; max_num_seqs = the largest B):
  ttft_ms        median time to first token over the B requests of one `generate` call (all arrive
                 together, so with prefill chunked under the token budget it grows with B; max too)
  itl_ms         median inter-token latency once every request of the call decodes (steps of B
                 decodes: the graph replay's step); the intervals of the earlier, mixed steps are left
                 out, and counted in itl_all_ms
  output_tok_per_s  B * output tokens over the wall time of one generate call (its prefill included)
  graph_replay_ms  the engine's decode graph for B replayed alone at the mid-generation context
                 (bench.decode.graph_replay_ms, the decode suite's full_graph row): the step without
                 the host around it
  floor_ms       (weights + B * K/V attended) / copy bandwidth at that context (bench.floors)
  weights        the model dtype's name, or "fp8" for the rows of `--quantization fp8`: the same model
                 with FP8 weights (EngineConfig.quantization), its floor from its own weight bytes
  hf_static_compiled_ms  transformers' generate(cache_implementation="static") with its
                 torch.compile(mode="reduce-overhead") decode step, per step at that context
                 (bench.hf_peers; one compile per batch, so only at --peer-batches)
Every `generate` gets fresh random prompts, so a prefix cache never serves one from another.

Cost on an H100 (expected, llama-3.2-3b, defaults): engine start-up ~35-55 s (warm/cold compile
cache) for the engine without a tokenizer and ~15-35 s more for the one with it (warm cache), the
generate calls ~15 s per variant, the peer ~60 s (one compile): about 3.5 minutes; `--time-budget S`
skips the peer when less than PEER_SECONDS is left of S, `--batches`, `--variants` and `--peers none`
cut further. The variants with a tokenizer need its directory (`python -m bench tokenizer`, see
bench/frontend.py); `--tokenizer none` runs the plain variant only.
"""
from __future__ import annotations

import logging
import statistics
import time
import zlib

import torch

from bench.common import Deadline, build_model, free_device_memory, parse_ints
from bench.configs import load_config
from bench.decode import decode_blocks_needed, graph_replay_ms
from bench.floors import decode_floor_ms, model_cost
from bench.frontend import (STOP_STRINGS, Variant, engines, load_tokenizer, parse_variants, sampling_params,
                            tokenizer_dir)
from bench.measure import Report, measure_ceilings, ratio
from bench.paged import BLOCK_SIZE

BATCHES = (1, 16, 64)
PROMPT_LEN = 512
OUTPUT_LEN = 128
PEER_BATCHES = (1,)      # each costs one full-model compile of transformers' static-cache decode
PEER_SECONDS = 90        # what one such peer point needs on an H100 (compile + 8 timed generates)
PEER_LENGTHS = {"short": 8, "long": 40}
WARMUP_TOKENS = 8

COLUMNS = ["batch", "weights", "tokenizer", "stop_strings", "prompt_len", "context", "ttft_ms", "ttft_max_ms", "itl_ms",
           "itl_all_ms", "output_tok_per_s", "graph_replay_ms", "floor_ms", "itl_x_floor", "replay_x_floor",
           "itl_x_replay", "hf_static_compiled_ms"]

logger = logging.getLogger("bench")


def latencies(outputs) -> dict[str, float | None]:
    """TTFT and inter-token latencies (ms) of the RequestOutputs of one generate call.

    itl_ms: median of the intervals that start after the last request's first token (every request
    decoding); itl_all_ms: median of all intervals."""
    ttfts = [o.ttft_s for o in outputs if o.ttft_s is not None]
    steady, every = [], []
    # Token times rebuilt from what the outputs carry, relative to each request's arrival (the
    # requests of one generate call arrive together, microseconds apart).
    last_first = max(ttfts) if ttfts else 0.0
    for o in outputs:
        if o.ttft_s is None:
            continue
        t = o.ttft_s
        for gap in o.inter_token_latencies_s:
            every.append(gap)
            if t >= last_first - 1e-9:
                steady.append(gap)
            t += gap

    def median_ms(values):
        return statistics.median(values) * 1e3 if values else None
    return {"ttft_ms": median_ms(ttfts), "ttft_max_ms": max(ttfts) * 1e3 if ttfts else None,
            "itl_ms": median_ms(steady), "itl_all_ms": median_ms(every), "steady_intervals": len(steady)}


def run(model: str, batches=None, prompt_len: int | None = None, output_len: int | None = None,
        peers: str | None = None, peer_batches=None, time_budget_s: float | None = None, repeats: int = 2,
        iters: int = 30, tokenizer: str | None = None, variants=None, quantization: str | None = None,
        **_: object) -> Report:
    """peers: "all" (default: transformers static + compile at peer_batches) or "none"/"eager" (none).
    tokenizer: the directory of the tokenizer the engine holds (default bench/.tokenizer; "none": none);
    variants: of bench.frontend.VARIANTS (default plain, tokenizer, stop). quantization "fp8": after
    the rows of the model as built, the same rows from engines over the same model with FP8 weights."""
    from engine import LLM
    from models import QUANTIZATIONS, quantize_fp8

    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"e2e: quantization {quantization!r} is not one of {QUANTIZATIONS}")
    batches = parse_ints(batches, BATCHES)
    peer_batches = parse_ints(peer_batches, PEER_BATCHES)
    prompt_len = int(prompt_len or PROMPT_LEN)
    output_len = int(output_len or OUTPUT_LEN)
    if output_len < 2:
        raise ValueError(f"e2e needs output_len >= 2 (inter-token latencies), got {output_len}")
    chosen = parse_variants(variants, tokenizer)
    peers = peers or "all"
    deadline = Deadline(time_budget_s)
    on_cuda = torch.cuda.is_available()
    vocab = load_config(model)["vocab_size"]
    tok_dir = tokenizer_dir(tokenizer) if any(v.tokenizer for v in chosen) else None  # fails early, clearly
    tok = load_tokenizer(tok_dir, vocab) if tok_dir is not None else None
    ceilings = measure_ceilings() if on_cuda else None
    bw = ceilings.copy_bytes_per_s if ceilings else None
    context = prompt_len + output_len // 2  # mid-generation: the replay, floor and peer are timed here
    net = build_model(model)
    cost = model_cost(net)
    report = Report("e2e", model, ceilings.device_name if ceilings else "cpu", COLUMNS)
    report.meta.update(weight_bytes=cost.weight_bytes, copy_bytes_per_s=bw, torch=torch.__version__,
                       batches=batches, prompt_len=prompt_len, output_len=output_len, repeats=repeats,
                       variants=[v.name for v in chosen], tokenizer=str(tok_dir) if tok_dir else None,
                       stop=list(STOP_STRINGS))
    max_batch = max(batches)
    engine_options = dict(max_num_seqs=max_batch, max_model_len=prompt_len + output_len + BLOCK_SIZE,
                          block_size=BLOCK_SIZE, show_progress=False)  # graphs and compile: the engine's defaults
    if (sizes := decode_graph_sizes(max_batch, batches)) is not None:
        engine_options["decode_graph_sizes"] = sizes
    rows: dict[tuple[int, str, str], dict] = {}
    replay: dict[tuple[int, str], float] = {}
    costs = {}
    timed: set[str] = set()
    replay_note = None
    dtype_name = str(net.config.dtype).removeprefix("torch.")
    for weights in (dtype_name,) + ((quantization,) if quantization else ()):
        if weights == "fp8":
            quantize_fp8(net)  # in place: the bf16 engines are closed
            report.meta["fp8_weight_bytes"] = model_cost(net).weight_bytes
        costs[weights] = model_cost(net)
        options = dict(engine_options, **({"quantization": weights} if weights == "fp8" else {}))
        for llm, group in engines(lambda t: LLM(net, tokenizer=t, **options), chosen, tok):
            for b in batches:
                for v in group:
                    rows[b, v.name, weights] = measure_generate(llm, v, b, prompt_len, output_len, repeats, vocab)
            stats = llm.stats()
            key = ("tokenizer" if group[0].tokenizer else "plain") + ("" if weights == dtype_name else f"_{weights}")
            report.meta.setdefault("engine_stats", {})[key] = {k: v for k, v in stats.items() if k != "backend"}
            if weights not in timed:  # the graphs are the same in every engine over one set of weights
                timed.add(weights)
                times, note = _graph_replays(llm, batches, vocab, context, iters)
                replay.update({(b, weights): ms for b, ms in times.items()})
                if replay_note is None:
                    replay_note = note
                    cfg = llm.config
                    report.notes.append(
                        f"{repeats} measured generate calls per batch size and variant (medians of their medians) "
                        f"after one warm-up call; prompts of {prompt_len} random tokens, {output_len} tokens out "
                        f"(ignore_eos); engine: compile {getattr(cfg, 'compile', '?')}, decode graphs {note[1]}, "
                        f"prefill graphs {'on' if getattr(cfg, 'prefill_graphs', None) else 'off'}, "
                        f"max_num_batched_tokens {getattr(cfg, 'max_num_batched_tokens', '?')}; steps by mode "
                        f"{stats.get('modes')}, fallbacks {stats.get('fallbacks')}")
                    if note[0]:
                        report.notes.append(note[0])
    if quantization:
        report.notes.append(f"weights {quantization}: the same model with EngineConfig.quantization={quantization!r} "
                            f"({report.meta['fp8_weight_bytes'] / 1e9:.3f} GB of weights against "
                            f"{cost.weight_bytes / 1e9:.3f}); its floor_ms from those bytes")
    report.notes.append(frontend_note(chosen, tok_dir, tok))
    del net
    torch._dynamo.reset()
    free_device_memory()

    hf_ms = _hf_static_peer(report, model, [b for b in batches if b in peer_batches], context, peers, deadline)
    for weights, weights_cost in costs.items():
        for b in batches:
            for v in chosen:
                r = rows[b, v.name, weights]
                floor = decode_floor_ms(weights_cost, b, context + 1, bw) if bw else None
                step = replay.get((b, weights))
                report.add(batch=b, weights=weights, **v.row(), prompt_len=prompt_len, context=context,
                           ttft_ms=r["ttft_ms"], ttft_max_ms=r["ttft_max_ms"], itl_ms=r["itl_ms"],
                           itl_all_ms=r["itl_all_ms"], output_tok_per_s=r["output_tok_per_s"], graph_replay_ms=step,
                           floor_ms=floor, itl_x_floor=ratio(r["itl_ms"], floor), replay_x_floor=ratio(step, floor),
                           itl_x_replay=ratio(r["itl_ms"], step),
                           hf_static_compiled_ms=hf_ms.get(b) if v is chosen[0] and weights == dtype_name else None)
    return report


def decode_graph_sizes(max_batch: int, batches) -> tuple[int, ...] | None:
    """The engine's default decode graph buckets plus every measured batch (each replays its own graph);
    None (the engine's default) where the engine no longer exposes its default rule."""
    try:
        from engine.config import default_decode_graph_sizes
    except ImportError:
        return None
    return tuple(sorted(set(default_decode_graph_sizes(max_batch)) | set(batches)))


def measure_generate(llm, variant: Variant, batch: int, prompt_len: int, output_len: int, repeats: int,
                     vocab: int) -> dict[str, float | None]:
    """One warm-up `generate` and `repeats` measured ones of `batch` fresh random prompts with the
    variant's SamplingParams: the medians of their latencies() and their output tokens per second."""
    # seeded per variant and batch: variants sharing an engine never see each other's prompts
    generator = torch.Generator().manual_seed(zlib.crc32(variant.name.encode()) * 1_000_003 + batch)

    def prompts() -> list[list[int]]:
        # fresh every call: a prefix cache must not turn a measured prefill into a cache hit
        return torch.randint(0, vocab, (batch, prompt_len), generator=generator).tolist()

    llm.generate(prompts(), sampling_params(variant, WARMUP_TOKENS))
    measured = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts(), sampling_params(variant, output_len))
        wall = time.perf_counter() - start
        bad = [o.request_id for o in outs if len(o.token_ids) != output_len]
        if bad:
            raise RuntimeError(f"requests {bad} did not generate {output_len} tokens (ignore_eos is set, and the "
                               f"stop strings {variant.stop} never match random text)")
        if variant.tokenizer and not any(o.text for o in outs):
            raise RuntimeError(f"variant {variant.name}: the engine returned no text, so it did not detokenize")
        measured.append({**latencies(outs), "output_tok_per_s": batch * output_len / wall})
    return {k: statistics.median(m[k] for m in measured) if measured[0][k] is not None else None
            for k in measured[0]}


def _graph_replays(llm, batches, vocab: int, context: int, iters: int) -> tuple[dict[int, float], tuple]:
    """The engine's decode graph per batch replayed alone (bench.decode.graph_replay_ms), and (a note,
    the captured sizes). It reaches into the engine's runner (not public API): if that moved, the
    replay column stays empty and the note says why, while the rows through LLM.generate remain."""
    runtime = getattr(llm, "runtime", None)
    runner = getattr(runtime, "runner", None)
    graphs = getattr(runner, "decode_graphs", None)
    pool = getattr(runtime, "block_pool", None)
    if runner is None or pool is None:
        return {}, ("no graph_replay_ms: the engine's runner is not at llm.runtime.runner (engine internals "
                    "moved; bench.e2e._graph_replays needs updating)", "unknown")
    if graphs is None:
        return {}, ("no graph_replay_ms: the engine captures decode graphs on CUDA only", "none")
    out, skipped = {}, []
    with torch.inference_mode():  # the engine made its pool and buffers in inference mode
        for b in batches:
            need = decode_blocks_needed(b, context)
            if need > pool.num_blocks:
                skipped.append(f"graph replay bs{b} skipped: needs {need} KV blocks, the pool has {pool.num_blocks}")
                continue
            out[b] = graph_replay_ms(runner, vocab, b, context, iters)
    return out, ("; ".join(skipped) or None, list(graphs.sizes))


def frontend_note(chosen: list[Variant], tok_dir, tok) -> str:
    parts = []
    for v in chosen:
        what = "no tokenizer" if not v.tokenizer else "the engine holds the tokenizer (LLM(..., tokenizer=...))"
        if v.stop:
            what += f" + stop strings {list(v.stop)} (never in random text)"
        parts.append(f"{v.name}: {what}")
    where = f"; tokenizer {type(tok).__name__} ({len(tok)} tokens) from {tok_dir}" if tok is not None else ""
    return "front-end variants: " + "; ".join(parts) + where + \
        "; one engine per tokenizer setting, the same configuration, in this process"


def _hf_static_peer(report: Report, model: str, batches: list[int], context: int, peers: str,
                    deadline: Deadline) -> dict[int, float]:
    """transformers static cache + compile, per step at `context` (its prompt is shorter by the
    middle of its two generation lengths, so its steps straddle the same context)."""
    if peers != "all" or not batches:
        return {}
    if not torch.cuda.is_available():
        report.notes.append("no hf_static_compiled_ms: transformers' reduce-overhead compile needs CUDA")
        return {}
    from bench import hf_peers
    hf = hf_peers.hf_model(load_config(model))
    prompt = max(1, context - (PEER_LENGTHS["short"] + PEER_LENGTHS["long"]) // 2)
    out = {}
    with torch.no_grad():
        for b in batches:
            if not deadline.allows(PEER_SECONDS):
                report.notes.append(f"hf_static_compiled bs{b} skipped: time budget")
                continue
            torch._dynamo.reset()
            try:
                out[b] = hf_peers.decode_static_generate_ms(hf, b, prompt, **PEER_LENGTHS)
            except Exception as exc:  # a peer failing must not lose our rows
                report.notes.append(f"hf_static_compiled bs{b} failed: {type(exc).__name__}: "
                                    f"{str(exc).splitlines()[0][:200]}")
                logger.exception("hf_static_compiled failed")
            free_device_memory()
    del hf
    torch._dynamo.reset()
    free_device_memory()
    return out
