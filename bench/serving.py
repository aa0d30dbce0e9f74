"""Suite `serving`: a seeded workload through engine.LLM, graphs off / decode graphs / decode + prefill graphs.

Requests arrive on a Poisson clock (seeded), each with a random prompt and output length
(ignore_eos, so every run generates exactly the same tokens). The driver adds each request when
its arrival time has passed and steps the engine; TTFT is arrival -> first token, ITL the gaps
between a request's tokens. Every configuration compiles with the infer_graphs backend on CUDA
(the engine's default; each row says so); they differ only in which CUDA graphs they use.
"""
from __future__ import annotations

import time

import torch

from bench.common import build_model, free_device_memory
from bench.measure import Report
from bench.workload import make_workload, summarize

CONFIGS = {
    "graphs off": dict(cuda_graphs=False, prefill_graphs=False),
    "decode graphs": dict(cuda_graphs=True, prefill_graphs=False),
    "decode + prefill graphs": dict(cuda_graphs=True, prefill_graphs=True),
}
BLOCK_SIZE, MAX_NUM_BATCHED_TOKENS = 16, 1024  # passed to every LLM, so the report's note states what ran
COLUMNS = ["config", "requests", "output_tokens", "makespan_s", "output_tok_per_s", "ttft_p50_ms", "ttft_p99_ms",
           "itl_p50_ms", "itl_p99_ms", "mode_counts", "compiled"]


def drive(llm, specs) -> dict:
    """Run the workload in real time against `llm`; the summary of its latencies."""
    from engine import SamplingParams
    pending = list(specs)
    last: dict[str, object] = {}
    start = time.perf_counter()
    next_index = 0
    while next_index < len(pending) or llm.has_unfinished_requests():
        now = time.perf_counter() - start
        while next_index < len(pending) and pending[next_index].arrival_s <= now:
            spec = pending[next_index]
            llm.add_request(list(spec.prompt_ids), SamplingParams(max_tokens=spec.output_len, ignore_eos=True),
                            request_id=f"r{next_index}")
            next_index += 1
        if not llm.has_unfinished_requests():
            time.sleep(max(0.0, pending[next_index].arrival_s - (time.perf_counter() - start)))
            continue
        for out in llm.step():
            last[out.request_id] = out
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    makespan = time.perf_counter() - start
    outs = list(last.values())
    ttfts = [o.ttft_s for o in outs if o.ttft_s is not None]
    itls = [x for o in outs for x in o.inter_token_latencies_s]
    tokens = sum(len(o.token_ids) for o in outs)
    return summarize(ttfts, itls, tokens, makespan, sum(s.prompt_len for s in specs))


def run(model: str, requests: int | None = None, rate: float | None = None, configs=None, **_: object) -> Report:
    from engine import LLM, SamplingParams

    on_cuda = torch.cuda.is_available()
    num_requests = int(requests or (128 if on_cuda else 6))
    rate = float(rate or (16.0 if on_cuda else 50.0))
    prompt_len, output_len = ((64, 768), (32, 256)) if on_cuda else ((8, 40), (4, 12))
    max_num_seqs = 32 if on_cuda else 4
    net = build_model(model)
    specs = make_workload(num_requests, rate, prompt_len, output_len, net.config.vocab_size, seed=0)
    max_model_len = prompt_len[1] + output_len[1] + 16
    blocks = 1 + max_num_seqs * -(-max_model_len // BLOCK_SIZE)
    report = Report("serving", model, torch.cuda.get_device_name() if on_cuda else "cpu", COLUMNS)
    report.notes.append(
        f"{num_requests} requests, Poisson arrivals at {rate:g}/s (seed 0), prompt {prompt_len[0]}-{prompt_len[1]} "
        f"tokens, output {output_len[0]}-{output_len[1]} tokens (ignore_eos), max_num_seqs={max_num_seqs}, "
        f"max_num_batched_tokens={MAX_NUM_BATCHED_TOKENS}, {blocks} KV blocks of {BLOCK_SIZE}; each measured run follows a warm-up run of the same requests")
    chosen = list(configs or CONFIGS)
    for name in chosen:
        llm = LLM(net, max_num_seqs=max_num_seqs, num_gpu_blocks=blocks, block_size=BLOCK_SIZE,
                  max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, show_progress=False,
                  max_model_len=max_model_len, **CONFIGS[name])
        # warm-up: the same requests all at once, so first-use work (Triton specializations of new
        # shapes, allocator growth) stays out of the measured run
        llm.generate([list(s.prompt_ids) for s in specs], [SamplingParams(max_tokens=s.output_len, ignore_eos=True)
                                                           for s in specs])
        llm.runtime.block_pool.reset_prefix_cache()  # the measured run must not hit the warm-up's prompts
        stats_before = dict(llm.runtime.runner.dispatcher.mode_counts)
        row = drive(llm, specs)
        modes = {k: v - stats_before.get(k, 0) for k, v in llm.runtime.runner.dispatcher.mode_counts.items()}
        report.add(config=name, mode_counts=" ".join(f"{k}:{v}" for k, v in sorted(modes.items())), **row)
        report.rows[-1]["fallbacks"] = llm.runtime.runner.dispatcher.fallbacks
        report.rows[-1]["compiled"] = llm.config.compile  # the engine's default: on for CUDA only
        llm.runtime.kv_cache.release()
        del llm
        torch._dynamo.reset()
        free_device_memory()
    return report
