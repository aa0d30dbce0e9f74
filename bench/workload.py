"""A seeded serving workload and the latency statistics of its run (pure Python: tested on CPU)."""
from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestSpec:
    arrival_s: float          # offset from the start of the run
    prompt_len: int
    output_len: int
    prompt_ids: tuple[int, ...]
    stop: tuple[str, ...] = ()  # stop strings (SamplingParams.stop / the OpenAI body's "stop")


def make_workload(num_requests: int, rate_per_s: float, prompt_len: tuple[int, int], output_len: tuple[int, int],
                  vocab_size: int, seed: int = 0) -> list[RequestSpec]:
    """Poisson arrivals (exponential gaps at `rate_per_s`; inf: all at 0), uniform lengths in [lo, hi]."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if rate_per_s <= 0:
        raise ValueError(f"rate_per_s must be > 0 (inf for all at once), got {rate_per_s}")
    rng = random.Random(seed)
    t = 0.0
    specs = []
    for _ in range(num_requests):
        n_prompt = rng.randint(*prompt_len)
        n_out = rng.randint(*output_len)
        ids = tuple(rng.randrange(3, vocab_size) for _ in range(n_prompt))  # clear of bos/eos-like ids
        specs.append(RequestSpec(t, n_prompt, n_out, ids))
        if not math.isinf(rate_per_s):
            t += rng.expovariate(rate_per_s)
    return specs


def with_stops(specs: list[RequestSpec], stop: tuple[str, ...], share: float, seed: int = 0) -> list[RequestSpec]:
    """The same requests, round(share * n) of them (chosen by a seeded draw) carrying the stop strings."""
    if not 0 <= share <= 1:
        raise ValueError(f"share must be in [0, 1], got {share}")
    if not stop or share == 0:
        return list(specs)
    chosen = set(random.Random(seed).sample(range(len(specs)), round(share * len(specs))))
    return [dataclasses.replace(s, stop=tuple(stop)) if i in chosen else s for i, s in enumerate(specs)]


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(ttfts_s: list[float], itls_s: list[float], output_tokens: int, makespan_s: float,
              prompt_tokens: int = 0) -> dict:
    return {
        "requests": len(ttfts_s),
        "output_tokens": output_tokens,
        "makespan_s": makespan_s,
        "output_tok_per_s": output_tokens / makespan_s if makespan_s > 0 else None,
        "total_tok_per_s": (output_tokens + prompt_tokens) / makespan_s if makespan_s > 0 else None,
        "ttft_p50_ms": _ms(percentile(ttfts_s, 50)),
        "ttft_p99_ms": _ms(percentile(ttfts_s, 99)),
        "itl_p50_ms": _ms(percentile(itls_s, 50)),
        "itl_p99_ms": _ms(percentile(itls_s, 99)),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def drive(llm, specs: list[RequestSpec]) -> dict:
    """Run a workload in real time against an in-process `engine.LLM`: each request is added when its
    arrival time has passed, the engine steps while work exists; the summary of its latencies."""
    import time

    import torch

    from engine import SamplingParams
    last: dict[str, object] = {}
    start = time.perf_counter()
    next_index = 0
    while next_index < len(specs) or llm.has_unfinished_requests():
        now = time.perf_counter() - start
        while next_index < len(specs) and specs[next_index].arrival_s <= now:
            spec = specs[next_index]
            llm.add_request(list(spec.prompt_ids), SamplingParams(max_tokens=spec.output_len, ignore_eos=True,
                                                                  stop=spec.stop),
                            request_id=f"r{next_index}")
            next_index += 1
        if not llm.has_unfinished_requests():
            time.sleep(max(0.0, specs[next_index].arrival_s - (time.perf_counter() - start)))
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
