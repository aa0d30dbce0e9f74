"""Suite `prefix`: prefix caching on vs off through engine.LLM, and what its bookkeeping costs.

Workloads (seeded, ignore_eos so every run generates the same tokens):
- shared: every request is one 1,024-token system prompt + its own 64-token question, 64 output tokens;
- unique: the same lengths with no shared prefix at all (caching can only cost here).
Each runs twice per setting: "poisson" arrivals (TTFT: prefill time plus a little queueing) and
"all at once" (throughput with the engine saturated). A warm-up run with another system prompt and
other questions first compiles and captures what the measured run needs, without priming its cache.

Host rows: the scheduler + block pool + step preparation alone (no model) over the unique workload,
caching on vs off (the bookkeeping at 0% hits), and one decode step's `_prepare` at batch 64 with
short and long contexts (persistent block tables: the host cost must not grow with context), and
the block pool's admit + publish + release per block, caching on vs off.
"""
from __future__ import annotations

import random
import statistics
import time

import torch

from bench.common import build_model, free_device_memory
from bench.measure import Report
from bench.workload import RequestSpec, drive

BLOCK_SIZE, MAX_NUM_BATCHED_TOKENS = 16, 1024
COLUMNS = ["workload", "caching", "arrivals", "requests", "output_tok_per_s", "ttft_p50_ms", "ttft_p99_ms",
           "itl_p50_ms", "hit_rate", "mode_counts", "host_us_per_step", "host_us_per_block"]


def make_specs(num_requests: int, system_len: int, question_len: int, output_len: int, vocab_size: int,
               shared: bool, rate_per_s: float | None, seed: int) -> list[RequestSpec]:
    """Requests behind one shared system prompt (or each with its own, shared=False); arrivals Poisson
    at rate_per_s, or all at 0 (None)."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(n)]  # clear of bos/eos-like ids

    system = tokens(system_len)
    specs, t = [], 0.0
    for _ in range(num_requests):
        prompt = (system if shared else tokens(system_len)) + tokens(question_len)
        specs.append(RequestSpec(t, len(prompt), output_len, tuple(prompt)))
        if rate_per_s is not None:
            t += rng.expovariate(rate_per_s)
    return specs


def host_us_per_step(specs: list[RequestSpec], caching: bool, max_num_seqs: int, max_model_len: int) -> float:
    """Host microseconds per step of schedule + _prepare + update (no model, CPU buffers)."""
    from engine.core.scheduler import Scheduler
    from engine.kv.block_pool import BlockPool
    from engine.params import SamplingParams
    from engine.request import Request
    from engine.worker.model_runner import ModelRunner

    blocks = 1 + max_num_seqs * -(-max_model_len // BLOCK_SIZE)
    scheduler = Scheduler(BlockPool(blocks, BLOCK_SIZE, debug_checks=False), max_num_seqs, MAX_NUM_BATCHED_TOKENS,
                          max_model_len, enable_prefix_caching=caching)
    runner = ModelRunner(None, None, BLOCK_SIZE, max_model_len, MAX_NUM_BATCHED_TOKENS, max_num_seqs,
                         torch.device("cpu"))
    for i, spec in enumerate(specs):
        scheduler.add(Request(f"h{i}", list(spec.prompt_ids), SamplingParams(max_tokens=spec.output_len,
                                                                              ignore_eos=True)))
    steps, start = 0, time.perf_counter()
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        runner._prepare(out, scheduler.pool, out.num_tokens, False)
        scheduler.update(out, [7] * sum(c.samples for c in out.chunks), 0.0)
        steps += 1
    return (time.perf_counter() - start) / steps * 1e6


def bookkeeping_us_per_block(caching: bool, num_requests: int = 200, blocks_per_request: int = 64) -> float:
    """Host microseconds per block of admit + publish + release, every prompt unique (0% hits), the pool
    full of cached blocks (so with caching every new block also evicts one). Best of three, CPU time."""
    from engine.kv.block_pool import BlockPool

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(blocks_per_request * BLOCK_SIZE)] for _ in range(num_requests)]
    best = float("inf")
    for _ in range(3):
        pool = BlockPool(1 + 4 * blocks_per_request, BLOCK_SIZE, debug_checks=False)
        if caching:
            pool.enable_prefix_caching()
        start = time.process_time()
        for i, prompt in enumerate(prompts):
            rid = str(i)
            if not pool.admit(rid, pool.match_prefix(prompt), len(prompt)):
                raise RuntimeError(f"bookkeeping benchmark: request {rid} did not fit")
            pool.publish(rid, prompt, len(prompt))
            pool.free(rid)
        best = min(best, (time.process_time() - start) / (num_requests * blocks_per_request) * 1e6)
    return best


def prepare_us(batch: int, context: int, steps: int = 200) -> float:
    """Host microseconds (median) of one decode step's _prepare at `batch` sequences of `context` tokens."""
    from engine.core.scheduler import Scheduler
    from engine.kv.block_pool import BlockPool
    from engine.params import SamplingParams
    from engine.request import Request
    from engine.worker.model_runner import ModelRunner

    max_model_len = context + steps + BLOCK_SIZE
    blocks = 1 + batch * -(-max_model_len // BLOCK_SIZE)
    scheduler = Scheduler(BlockPool(blocks, BLOCK_SIZE, debug_checks=False), batch, batch * max_model_len,
                          max_model_len)
    runner = ModelRunner(None, None, BLOCK_SIZE, max_model_len, batch * max_model_len, batch, torch.device("cpu"))
    for i in range(batch):
        scheduler.add(Request(str(i), [3 + (i + j) % 200 for j in range(context)],
                              SamplingParams(max_tokens=steps + 2, ignore_eos=True)))
    out = scheduler.schedule()  # the prefill
    runner._prepare(out, scheduler.pool, out.num_tokens, False)
    scheduler.update(out, [7] * batch, 0.0)
    samples = []
    for _ in range(steps):
        out = scheduler.schedule()
        start = time.perf_counter()
        runner._prepare(out, scheduler.pool, out.num_tokens, False)
        samples.append(time.perf_counter() - start)
        scheduler.update(out, [7] * batch, 0.0)
    return statistics.median(samples) * 1e6


def run(model: str, requests: int | None = None, rate: float | None = None, host_rows: bool = True,
        **_: object) -> Report:
    from engine import LLM, SamplingParams

    on_cuda = torch.cuda.is_available()
    num_requests = int(requests or (64 if on_cuda else 4))
    rate = float(rate or (8.0 if on_cuda else 50.0))
    system_len, question_len, output_len = (1024, 64, 64) if on_cuda else (64, 8, 4)
    max_num_seqs = 32 if on_cuda else 4
    max_model_len = system_len + question_len + output_len + BLOCK_SIZE
    # every running request's blocks, and as many again to keep prefixes cached
    blocks = 1 + 2 * max_num_seqs * -(-max_model_len // BLOCK_SIZE)
    net = build_model(model)
    vocab = net.config.vocab_size
    report = Report("prefix", model, torch.cuda.get_device_name() if on_cuda else "cpu", COLUMNS)
    report.notes.append(
        f"{num_requests} requests: a {system_len}-token prompt (shared: one system prompt for all; unique: each "
        f"its own) + a {question_len}-token question, {output_len} output tokens (ignore_eos); poisson arrivals at "
        f"{rate:g}/s, or all at once; max_num_seqs={max_num_seqs}, max_num_batched_tokens={MAX_NUM_BATCHED_TOKENS}, "
        f"{blocks} KV blocks of {BLOCK_SIZE}, decode graphs and prefill graphs on where CUDA is; each setting "
        "warms up on another system prompt and other questions first")
    greedy = SamplingParams(max_tokens=output_len, ignore_eos=True)
    for caching in (False, True):
        llm = LLM(net, max_num_seqs=max_num_seqs, num_gpu_blocks=blocks, block_size=BLOCK_SIZE,
                  max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_model_len=max_model_len, show_progress=False,
                  prefill_graphs=on_cuda, enable_prefix_caching=caching)
        warm = make_specs(min(num_requests, 2 * max_num_seqs), system_len, question_len, output_len, vocab,
                          True, None, seed=99)
        llm.generate([list(s.prompt_ids) for s in warm], greedy)
        llm.runtime.block_pool.reset_prefix_cache()
        for shared in (True, False):
            for arrivals, arrival_rate in (("poisson", rate), ("all at once", None)):
                specs = make_specs(num_requests, system_len, question_len, output_len, vocab, shared, arrival_rate,
                                   seed=1 if shared else 2)
                modes_before = dict(llm.runtime.runner.dispatcher.mode_counts)
                cache_before = llm.stats()["prefix_cache"]
                row = drive(llm, specs)
                cache = llm.stats()["prefix_cache"]
                queried = cache["query_tokens"] - cache_before["query_tokens"]
                modes = {k: v - modes_before.get(k, 0) for k, v in llm.runtime.runner.dispatcher.mode_counts.items()}
                report.add(workload="shared" if shared else "unique", caching="on" if caching else "off",
                           arrivals=arrivals, requests=row["requests"], output_tok_per_s=row["output_tok_per_s"],
                           ttft_p50_ms=row["ttft_p50_ms"], ttft_p99_ms=row["ttft_p99_ms"], itl_p50_ms=row["itl_p50_ms"],
                           hit_rate=(cache["hit_tokens"] - cache_before["hit_tokens"]) / queried if queried else None,
                           mode_counts=" ".join(f"{k}:{v}" for k, v in sorted(modes.items())))
                # A shared run leaves its prefix cached: the next shared run would hit the first request too.
                llm.runtime.block_pool.reset_prefix_cache()
        llm.close()
        del llm
        torch._dynamo.reset()
        free_device_memory()
    if not host_rows:
        return report
    unique = make_specs(max(num_requests, 64), 1024, 64, 64, 32000, False, None, seed=3)
    for caching in (False, True):
        report.add(workload="unique", caching="on" if caching else "off", arrivals="host only (no model)",
                   requests=len(unique), host_us_per_step=host_us_per_step(unique, caching, 32, 1024 + 64 + 64 + 16))
    for caching in (False, True):
        report.add(workload="unique", caching="on" if caching else "off", arrivals="block pool only",
                   host_us_per_block=bookkeeping_us_per_block(caching))
    for context in (128, 2048, 8192):
        report.add(workload=f"decode batch 64, context {context}", caching="off", arrivals="host _prepare only",
                   host_us_per_step=prepare_us(64, context))
    report.notes.append("host rows time the CPU bookkeeping alone (schedule + _prepare + update, or _prepare), "
                        "on this machine's host")
    return report

