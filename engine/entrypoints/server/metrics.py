"""Prometheus metrics: what the handlers see per request (latencies, tokens) and the engine's counters.

Latency histograms and token counters are observed by the handlers from the outputs they receive.
The engine's own totals (steps by mode, fallbacks, preemptions, KV blocks, prefix cache) are read
from the latest `LLM.stats()` snapshot the engine thread published (EngineLoop.snapshot: a scrape
never waits for a step), and exported as they are (a custom collector), so no number is counted twice.

Back-pressure and leaks are visible here too: the waiting queue's depth and bound, the requests
refused with 503 (by reason), the server process's memory (prometheus_client's process collector:
RSS, open files) and, on CUDA, the memory torch holds, which `python -m bench soak` compares with its
value after warm-up.
"""
from __future__ import annotations

import bisect
from typing import Any, Iterable

import torch
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

PREFIX = "infer_graphs"
_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2,
                      0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


class _EngineStats:
    """A prometheus collector over the latest LLM.stats() snapshot."""

    def __init__(self, device: str, max_waiting: int | None) -> None:
        self.snapshot: dict[str, Any] = {}
        self.device = torch.device(device)
        self.max_waiting = max_waiting

    def collect(self):
        s = self.snapshot
        if not s:
            return

        def gauge(name, doc, value):
            return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)

        def counter(name, doc, value):
            return CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)

        if "engine_process_rss_bytes" in s:  # serve --engine-process: the process that holds the engine
            yield gauge("engine_process_resident_memory_bytes", "resident memory of the engine's process",
                        s["engine_process_rss_bytes"])
        yield gauge("requests_running", "requests scheduled in the running batch", s["requests_running"])
        yield gauge("requests_waiting", "requests queued, waiting for a slot or KV blocks", s["requests_waiting"])
        yield gauge("requests_admitting", "requests submitted to the engine thread, not yet in its queue",
                    s.get("requests_admitting", 0))
        if self.max_waiting is not None:
            yield gauge("requests_waiting_limit", "max_waiting_requests: past it new requests get 503",
                        self.max_waiting)
        used = s["kv_blocks"] - 1 - s["kv_blocks_free"]  # block 0 is the scratch block
        yield gauge("kv_blocks_used", "KV cache blocks held by requests", used)
        yield gauge("kv_blocks_free", "KV cache blocks free", s["kv_blocks_free"])
        groups = GaugeMetricFamily(f"{PREFIX}_kv_group_blocks_free", "KV cache blocks free per KV group "
                                   "(a pool per layer kind: full, sliding_<window>)", labels=["kind"])
        for group in s.get("kv_groups", ()):
            groups.add_metric([group["kind"]], group["blocks_free"])
        yield groups
        steps = CounterMetricFamily(f"{PREFIX}_steps", "engine steps by runtime mode", labels=["mode"])
        for mode in ("full", "piecewise", "none"):
            steps.add_metric([mode], s["modes"].get(mode, 0))
        yield steps
        yield counter("graph_fallbacks", "steps that ran without the graph they could have used", s["fallbacks"])
        yield counter("preemptions", "requests preempted (recomputed later) for lack of KV blocks",
                      s["preemptions"])
        yield gauge("decode_graph_bytes", "memory of the full-decode CUDA graphs", s.get("decode_graph_bytes", 0))
        yield gauge("piecewise_graph_bytes", "memory of the piecewise CUDA graphs (the backend's pool growth)",
                    (s.get("backend") or {}).get("graph_pool_bytes", 0))
        for key, value in (s.get("prefix_cache") or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                yield gauge(f"prefix_cache_{key}", f"LLM.stats()['prefix_cache']['{key}']", value)
        spec = s.get("spec_decode")
        if spec:  # speculative decoding (engine.spec.proposer.SpecStats)
            yield counter("spec_decode_verify_chunks", "requests' verify chunks (a decode with proposals)",
                          spec["verify_chunks"])
            yield counter("spec_decode_no_proposal", "decodes of eligible requests with nothing to propose",
                          spec["no_proposal"])
            yield counter("spec_decode_proposed_tokens", "proposed tokens verified", spec["proposed_tokens"])
            yield counter("spec_decode_accepted_tokens", "proposed tokens accepted", spec["accepted_tokens"])
            yield gauge("spec_decode_acceptance_rate", "accepted / proposed tokens", spec["acceptance_rate"])
            yield gauge("spec_decode_mean_accepted_length", "tokens a verify chunk adds (accepted + 1)",
                        spec["mean_accepted_length"])
            if "draft_forwards" in spec:  # a draft model's (engine.spec.draft)
                yield counter("spec_decode_draft_forwards", "the draft model's forward passes", spec["draft_forwards"])
                yield gauge("spec_decode_draft_ms_per_round", "host ms per drafting round (its steps and read-back)",
                            spec["draft_ms_per_round"])
                yield gauge("spec_decode_draft_kv_blocks_free", "free blocks of the draft's KV pool",
                            spec["draft_kv_blocks_free"])
        if self.device.type == "cuda":
            # with --engine-process the engine's process reads its allocator (this one holds no CUDA context)
            allocated = s.get("cuda_memory_allocated_bytes")
            reserved = s.get("cuda_memory_reserved_bytes")
            yield gauge("cuda_memory_allocated_bytes", "memory torch's allocator hands out on the engine's device",
                        torch.cuda.memory_allocated(self.device) if allocated is None else allocated)
            yield gauge("cuda_memory_reserved_bytes", "memory torch's allocator holds on the engine's device",
                        torch.cuda.memory_reserved(self.device) if reserved is None else reserved)


class TokenHistogram:
    """A histogram observed once per generated token, by the event loop thread only: a bucket index by
    bisect and a list increment, without prometheus_client's Histogram and its per-bucket lock
    (~3 us a value, 14 us of a streamed chunk's event-loop time, which the step loop waits behind
    for the GIL). Exposed as prometheus_client's Histogram of the same name is (_bucket, _count, _sum)."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...],
                 registry: CollectorRegistry) -> None:
        self.name, self.documentation, self.bounds = name, documentation, tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0
        registry.register(self)

    def observe_many(self, values: Iterable[float]) -> None:
        counts, bounds = self.counts, self.bounds
        for value in values:
            counts[bisect.bisect_left(bounds, value)] += 1  # a bucket holds values <= its bound, as le= says
            self.sum += value

    def collect(self):
        cumulative, buckets = 0, []
        for bound, count in zip((*map(repr, self.bounds), "+Inf"), self.counts):
            cumulative += count
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=self.sum)


class ServerMetrics:
    def __init__(self, device: str = "cpu", max_waiting: int | None = None) -> None:
        self.registry = CollectorRegistry()
        self.engine = _EngineStats(device, max_waiting)
        self.registry.register(self.engine)
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes and friends (Linux)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "arrival -> first generated token",
                              buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        self.itl = TokenHistogram(f"{PREFIX}_inter_token_latency_seconds", "between consecutive generated tokens",
                                  _LATENCY_BUCKETS_S, self.registry)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "arrival -> finished",
                             buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        self.loop_lag = Histogram(f"{PREFIX}_event_loop_lag_seconds", "how late the event loop ran its 0.1 s tick: "
                                  "what every request and /health waits behind", buckets=_LATENCY_BUCKETS_S,
                                  registry=self.registry)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt tokens of accepted requests",
                                     registry=self.registry)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "tokens generated",
                                         registry=self.registry)
        self.requests = Counter(f"{PREFIX}_requests", "requests ended, by finish reason", ["finish_reason"],
                                registry=self.registry)
        self.rejections = Counter(f"{PREFIX}_requests_rejected", "requests refused with 503, by reason "
                                  "(queue_full: max_waiting_requests; shutting_down: a drain)", ["reason"],
                                  registry=self.registry)
        self.left = Counter(f"{PREFIX}_requests_left_before_body", "clients that closed the connection before "
                            "their request's body arrived (nothing was started for them)", registry=self.registry)
        for reason in ("queue_full", "shutting_down"):  # exported at 0 before the first one
            self.rejections.labels(reason)

    def observe(self, out: Any, num_seen: int, ttft: bool = True) -> int:
        """Count the tokens a RequestOutput adds to the `num_seen` of its request counted before (a
        whole response's handler sees only the first output and the final one); the count now.
        `ttft`: its first token counts toward TTFT (choice 0 of an API request)."""
        h = out.history
        total = num_seen + len(out.new_token_ids) if h is None else h.num_output_tokens
        if total <= num_seen:
            return num_seen
        self.generation_tokens.inc(total - num_seen)
        if ttft and num_seen == 0 and out.ttft_s is not None:
            self.ttft.observe(out.ttft_s)
        if h is not None:
            times = h.token_times
            self.itl.observe_many(times[i] - times[i - 1] for i in range(max(1, num_seen), total))
        return total

    def rejected(self, reason: str) -> None:
        self.rejections.labels(reason).inc()

    def left_early(self) -> None:
        self.left.inc()

    def finished(self, reason: str, num_prompt_tokens: int, e2e_s: float) -> None:
        self.requests.labels(reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.e2e.observe(e2e_s)

    def render(self, stats: dict[str, Any]) -> bytes:
        self.engine.snapshot = stats
        return generate_latest(self.registry)
