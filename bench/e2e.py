"""Suite `e2e`: what a user sees through `LLM.generate`, next to what the GPU alone could do.

Per batch size B (one engine for all, built as a user builds it: compile, decode graphs and
piecewise prefill graphs; max_num_seqs = the largest B):
  ttft_ms        median time to first token over the B requests of one `generate` call (all arrive
                 together, so with prefill chunked under the token budget it grows with B; max too)
  itl_ms         median inter-token latency once every request of the call decodes (steps of B
                 decodes: the graph replay's step); the intervals of the earlier, mixed steps are left
                 out, and counted in itl_all_ms
  graph_replay_ms  the engine's decode graph for B replayed alone at the mid-generation context
                 (bench.decode.graph_replay_ms, the decode suite's full_graph row): the step without
                 the host around it
  floor_ms       (weights + B * K/V attended) / copy bandwidth at that context (bench.floors)
  hf_static_compiled_ms  transformers' generate(cache_implementation="static") with its
                 torch.compile(mode="reduce-overhead") decode step, per step at that context
                 (bench.hf_peers; one compile per batch, so only at --peer-batches)
Every `generate` gets fresh random prompts, so a prefix cache never serves one from another.

Cost on an H100 (expected, llama-3.2-3b, defaults): engine start-up ~35-55 s (warm/cold compile
cache), the generate calls ~15 s, the peer ~60 s (one compile): about 2.5 minutes; `--time-budget S`
skips the peer when less than PEER_SECONDS is left of S, `--batches` and `--peers none` cut further.
"""
from __future__ import annotations

import logging
import statistics

import torch

from bench.common import Deadline, build_model, free_device_memory, parse_ints
from bench.configs import load_config
from bench.decode import decode_blocks_needed, graph_replay_ms
from bench.floors import decode_floor_ms, model_cost
from bench.measure import Report, measure_ceilings, ratio
from bench.paged import BLOCK_SIZE

BATCHES = (1, 16, 64)
PROMPT_LEN = 512
OUTPUT_LEN = 128
PEER_BATCHES = (1,)      # each costs one full-model compile of transformers' static-cache decode
PEER_SECONDS = 90        # what one such peer point needs on an H100 (compile + 8 timed generates)
PEER_LENGTHS = {"short": 8, "long": 40}
WARMUP_TOKENS = 8

COLUMNS = ["batch", "prompt_len", "context", "ttft_ms", "ttft_max_ms", "itl_ms", "itl_all_ms", "graph_replay_ms",
           "floor_ms", "itl_x_floor", "replay_x_floor", "itl_x_replay", "hf_static_compiled_ms"]

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
        iters: int = 30, **_: object) -> Report:
    """peers: "all" (default: transformers static + compile at peer_batches) or "none"/"eager" (none)."""
    from engine import LLM, SamplingParams
    from engine.config import default_decode_graph_sizes

    batches = parse_ints(batches, BATCHES)
    peer_batches = parse_ints(peer_batches, PEER_BATCHES)
    prompt_len = int(prompt_len or PROMPT_LEN)
    output_len = int(output_len or OUTPUT_LEN)
    if output_len < 2:
        raise ValueError(f"e2e needs output_len >= 2 (inter-token latencies), got {output_len}")
    peers = peers or "all"
    deadline = Deadline(time_budget_s)
    on_cuda = torch.cuda.is_available()
    ceilings = measure_ceilings() if on_cuda else None
    bw = ceilings.copy_bytes_per_s if ceilings else None
    context = prompt_len + output_len // 2  # mid-generation: the replay, floor and peer are timed here
    net = build_model(model)
    cost = model_cost(net)
    vocab = net.config.vocab_size
    report = Report("e2e", model, ceilings.device_name if ceilings else "cpu", COLUMNS)
    report.meta.update(weight_bytes=cost.weight_bytes, copy_bytes_per_s=bw, torch=torch.__version__,
                       batches=batches, prompt_len=prompt_len, output_len=output_len, repeats=repeats)
    max_batch = max(batches)
    llm = LLM(net, max_num_seqs=max_batch, max_model_len=prompt_len + output_len + BLOCK_SIZE,
              block_size=BLOCK_SIZE, prefill_graphs=on_cuda, show_progress=False,
              decode_graph_sizes=tuple(sorted(set(default_decode_graph_sizes(max_batch)) | set(batches))))
    generator = torch.Generator().manual_seed(0)

    def prompts(b: int) -> list[list[int]]:
        # fresh every call: a prefix cache must not turn a measured prefill into a cache hit
        return torch.randint(0, vocab, (b, prompt_len), generator=generator).tolist()

    rows = {}
    for b in batches:
        llm.generate(prompts(b), SamplingParams(max_tokens=WARMUP_TOKENS, ignore_eos=True))
        outputs = []
        for _ in range(repeats):
            outs = llm.generate(prompts(b), SamplingParams(max_tokens=output_len, ignore_eos=True))
            bad = [o.request_id for o in outs if len(o.token_ids) != output_len]
            if bad:
                raise RuntimeError(f"requests {bad} did not generate {output_len} tokens (ignore_eos is set)")
            outputs.append(latencies(outs))
        rows[b] = {k: statistics.median(o[k] for o in outputs) if outputs[0][k] is not None else None
                   for k in outputs[0]}
    stats = llm.stats()
    report.meta["engine_stats"] = {k: v for k, v in stats.items() if k != "backend"}
    cfg, graphs = llm.config, llm.runtime.runner.decode_graphs
    report.notes.append(
        f"{repeats} measured generate calls per batch size (medians of their medians) after one warm-up call; "
        f"prompts of {prompt_len} random tokens, {output_len} tokens out (ignore_eos); engine: compile "
        f"{cfg.compile}, decode graphs {list(graphs.sizes) if graphs else 'none'}, prefill graphs "
        f"{'on' if cfg.prefill_graphs else 'off'}, max_num_batched_tokens {cfg.max_num_batched_tokens}; "
        f"steps by mode {stats['modes']}, fallbacks {stats['fallbacks']}")

    replay: dict[int, float] = {}
    if graphs is None:
        report.notes.append("no graph_replay_ms: the engine captures decode graphs on CUDA only")
    else:
        with torch.inference_mode():  # the engine made its pool and buffers in inference mode
            for b in batches:
                need = decode_blocks_needed(b, context)
                if need > llm.runtime.block_pool.num_blocks:
                    report.notes.append(f"graph replay bs{b} skipped: needs {need} KV blocks, the pool has "
                                        f"{llm.runtime.block_pool.num_blocks}")
                    continue
                replay[b] = graph_replay_ms(llm.runtime.runner, vocab, b, context, iters)
    llm.close()
    del llm, net, graphs
    torch._dynamo.reset()
    free_device_memory()

    hf_ms = _hf_static_peer(report, model, [b for b in batches if b in peer_batches], context, peers, deadline)
    for b in batches:
        r = rows[b]
        floor = decode_floor_ms(cost, b, context + 1, bw) if bw else None
        report.add(batch=b, prompt_len=prompt_len, context=context, ttft_ms=r["ttft_ms"],
                   ttft_max_ms=r["ttft_max_ms"], itl_ms=r["itl_ms"], itl_all_ms=r["itl_all_ms"],
                   graph_replay_ms=replay.get(b), floor_ms=floor, itl_x_floor=ratio(r["itl_ms"], floor),
                   replay_x_floor=ratio(replay.get(b), floor), itl_x_replay=ratio(r["itl_ms"], replay.get(b)),
                   hf_static_compiled_ms=hf_ms.get(b))
    return report


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
