"""LLM.stats(): the engine's counters in one dict (steps, graph modes and fallbacks, scheduler, KV
pool and prefix cache, decode and mixed-step graphs, the step loop, start-up memory and timeline, the backend's
counters, and under tensor parallelism every rank's)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.core.llm import LLM


def collect_stats(llm: LLM, gather_ranks: bool) -> dict[str, Any]:
    """`gather_ranks`: ask the other tensor-parallel ranks for theirs (not while closing: a failed
    group could keep the caller waiting)."""
    runner = llm.runtime.runner
    graphs, mixed = runner.decode_graphs, runner.mixed_graphs
    stats: dict[str, Any] = {
        "cudagraph_mode": llm.config.cudagraph_mode,
        "steps": llm.num_steps,
        "generated_tokens": llm._loop.num_tokens_read,
        "modes": dict(runner.dispatcher.mode_counts),
        "fallbacks": runner.dispatcher.fallbacks,
        "fallback_reasons": dict(runner.dispatcher.fallback_counts),
        "preemptions": llm.scheduler.num_preemptions,
        "requests_running": len(llm.scheduler.running),
        "requests_waiting": len(llm.scheduler.waiting),
        "kv_blocks": llm.runtime.block_pool.num_blocks,
        "prefix_cache": llm.runtime.block_pool.prefix_cache_stats(),
        "kv_blocks_free": llm.runtime.block_pool.num_free_blocks,
        "kv_blocks_by_group": list(llm.runtime.kv_cache.num_blocks_by_group),
        "kv_groups": llm.runtime.kv_group_stats(llm.config.max_model_len),
        "decode_graphs": len(graphs.sizes) if graphs else 0,
        "decode_graph_replays": graphs.replays if graphs else 0,
        "decode_graph_replays_by_size": dict(graphs.replays_by_size) if graphs else {},
        "decode_graph_capture_seconds": graphs.capture_seconds if graphs else 0.0,
        "decode_graph_bytes": graphs.graph_bytes if graphs else 0,
        "mixed_graphs": len(mixed.sizes) if mixed else 0,
        "mixed_graph_replays": mixed.replays if mixed else 0,
        "verify_graphs": len(runner.verify_graphs.sizes) if runner.verify_graphs else 0,
        "verify_graph_replays": runner.verify_graphs.replays if runner.verify_graphs else 0,
        "mixed_graph_capture_seconds": mixed.capture_seconds if mixed else 0.0,
        "piecewise_capture_seconds": llm.runtime.piecewise_capture_seconds,
        "async_scheduling": llm._loop.depth == 1,
        # steps the host could not run ahead of: it read the in-flight tokens with the device idle
        "async_drains": llm._loop.num_drains,
        "async_overlapped_steps": llm._loop.num_overlapped_steps,
        "async_discarded_tokens": llm._loop.num_discarded_tokens,
        # detokenization and stop strings in their own process (engine/core/text_process.py): records
        # sent, and the times an output waited for the process to answer (step() and generate()'s end)
        "frontend_process": llm._front.process,
        "frontend_records": getattr(llm._front, "records", 0),
        "frontend_flush_waits": getattr(llm._front, "flush_waits", 0),
        "frontend_tokens_past_stop": llm.num_tokens_past_stop,
        **llm.runtime.memory,
        "spec_decode": _spec_stats(llm),
        "startup": llm.startup.as_dict(),
    }
    if llm.runtime.backend is not None:
        stats["backend"] = dataclasses.asdict(llm.runtime.backend.stats)
    if llm.tp is not None and gather_ranks:
        # graph counts and fallbacks of every rank; a failed group can only report its failure
        stats["ranks"] = llm.tp.rank_stats() if llm.tp.failure is None else llm.tp.failure
    return stats


def _spec_stats(llm: LLM) -> dict[str, Any] | None:
    """Speculative decoding's counts (engine.spec.proposer.SpecStats), or None without it."""
    proposer = llm.scheduler.proposer
    if proposer is None:
        return None
    config = proposer.config
    return {**config.describe(), **proposer.stats.as_dict(), **proposer.stats_dict(),
            "waits": llm._loop.num_spec_waits,  # steps planned after reading the step in flight
            "verify_graph_fallbacks": llm.runtime.runner.dispatcher.fallback_kinds["verify"]}
