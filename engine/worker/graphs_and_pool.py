"""Start-up's steps 3-6 on CUDA (engine/worker/startup.py): the piecewise graphs, a throwaway capture that
measures what the full graphs (decode, verify, mixed-step) will need, the KV pool sized from what is
left, then the full graphs captured against that pool, and the dispatcher built from what was
captured. Also the pool's allocation and the checks shared with the CPU path."""
from __future__ import annotations

import logging
import sys
import time
from typing import TYPE_CHECKING, Callable

import torch

from engine.config import ConfigError, EngineConfig
from engine.kv.grouped_pool import GroupedBlockPool, make_block_pool
from engine.kv.groups import blocks_per_group
from engine.worker.decode_graphs import DecodeGraphs, free_memory_gib
from engine.worker.dispatch import Dispatcher
from engine.worker.mixed_graphs import MixedGraphs
from engine.worker.model_runner import ModelRunner
from engine.worker.timeline import StartupTimeline

if TYPE_CHECKING:
    from compile_backend import InferGraphsBackend
    from engine.worker.startup import Runtime

logger = logging.getLogger("engine")
GRAPH_OVERHEAD_BYTES = 8 * 2**20  # per decode graph, outside the caching allocator (a margin)


def capture_and_size(rt: Runtime, config: EngineConfig, timeline: StartupTimeline,
                      min_over_ranks: Callable[[int], int] | None, min_blocks: int) -> None:
    """Piecewise capture, decode-graph measure, the KV pool sized from what is left, decode capture."""
    runner, kv_cache, backend, memory = rt.runner, rt.kv_cache, rt.backend, rt.memory
    device = runner.device
    if config.prefill_graphs:
        with timeline.phase("piecewise capture"):
            rt.piecewise_capture_seconds = capture_piecewise(runner, backend, config)
    decode_graphs = verify_graphs = None
    memory["decode_graph_reserve_bytes"] = memory["mixed_graph_reserve_bytes"] = 0
    memory["verify_graph_reserve_bytes"] = 0
    if config.cuda_graphs:
        decode_graphs = DecodeGraphs(runner, rt.pool.handle)
        with timeline.phase("decode measure"):
            memory["decode_graph_reserve_bytes"] = measure_graphs(DecodeGraphs, runner, config.decode_graph_sizes)
    verify_sizes = verify_graph_sizes(config)
    if verify_sizes:
        verify_graphs = DecodeGraphs(runner, rt.pool.handle, store_first=True)
        with timeline.phase("verify measure"):
            memory["verify_graph_reserve_bytes"] = measure_graphs(DecodeGraphs, runner, verify_sizes)
    mixed_graphs, mixed_sizes = None, mixed_graph_sizes(config)
    if mixed_sizes:
        mixed_graphs = MixedGraphs(runner, rt.pool.handle)
        with timeline.phase("mixed measure"):
            memory["mixed_graph_reserve_bytes"] = measure_graphs(MixedGraphs, runner, mixed_sizes)
    with timeline.phase("kv pool"):
        torch.cuda.empty_cache()  # cached-but-free warm-up blocks count as free (near-free after the measure)
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        memory["free_bytes_before_pool"] = free_bytes
        reserved = (memory["activation_peak_bytes"] + memory["decode_graph_reserve_bytes"]
                    + memory["mixed_graph_reserve_bytes"] + memory["verify_graph_reserve_bytes"])
        spare = kv_pool_spare_bytes(free_bytes, total_bytes, reserved, config.gpu_memory_utilization)
        if config.num_gpu_blocks is not None:
            num_blocks = config.num_gpu_blocks
            if num_blocks * kv_cache.bytes_per_block > spare:
                raise ConfigError(
                    f"EngineConfig.num_gpu_blocks={num_blocks} needs {num_blocks * kv_cache.bytes_per_block / 2**30:.2f} "
                    f"GiB but only {max(spare, 0) / 2**30:.2f} GiB is left after weights, warm-up peak and graphs")
        elif config.gpu_memory_utilization is not None:
            num_blocks = kv_cache.blocks_for_memory(max(spare, 0))
        else:
            num_blocks = kv_cache.blocks_for_memory(spare * config.kv_memory_fraction)
        if min_over_ranks is not None:
            num_blocks = min_over_ranks(num_blocks)
        check_blocks(num_blocks, min_blocks, config)
        allocate_pool(rt, num_blocks, config, spare)
        memory["kv_pool_bytes"] = kv_cache.pool_bytes
    logger.info("KV pool: %s blocks of %d tokens (%.2f GiB); free before pool %.2f GiB, warm-up peak "
                "%.2f GiB, graph reserve %.2f GiB decode + %.2f GiB mixed",
                " + ".join(f"{n} {g.kind}" for n, g in zip(kv_cache.num_blocks_by_group, kv_cache.groups)),
                config.block_size,
                kv_cache.pool_bytes / 2**30, free_bytes / 2**30, memory["activation_peak_bytes"] / 2**30,
                memory["decode_graph_reserve_bytes"] / 2**30, memory["mixed_graph_reserve_bytes"] / 2**30)
    if decode_graphs is not None:
        with timeline.phase("decode capture"):
            decode_graphs.capture(config.decode_graph_sizes, config.show_progress)
        runner.decode_graphs = decode_graphs
        memory["decode_graph_bytes"] = decode_graphs.graph_bytes
    if verify_graphs is not None:
        with timeline.phase("verify capture"):
            verify_graphs.capture(verify_sizes, config.show_progress)
        runner.verify_graphs = verify_graphs
        memory["verify_graph_bytes"] = verify_graphs.graph_bytes
    if mixed_graphs is not None:
        with timeline.phase("mixed capture"):
            mixed_graphs.capture(mixed_sizes, config.show_progress)
        runner.mixed_graphs = mixed_graphs
        memory["mixed_graph_bytes"] = mixed_graphs.graph_bytes
    runner.dispatcher = Dispatcher(
        decode_graphs.sizes if decode_graphs else (),
        config.prefill_graph_sizes if config.prefill_graphs else (),
        decode_graphs_wanted=config.cuda_graphs, piecewise_graphs_wanted=config.prefill_graphs,
        mixed_sizes=mixed_graphs.sizes if mixed_graphs else (), mixed_graphs_wanted=config.mixed_graphs,
        verify_graphs_wanted=config.cuda_graphs and config.num_speculative_tokens > 0,
        verify_sizes=verify_graphs.sizes if verify_graphs else ())


def verify_graph_sizes(config: EngineConfig) -> tuple[int, ...]:
    """The decode-row graphs of speculative decoding's verify steps (DecodeGraphs(store_first=True)):
    the decode buckets from 2 rows, where a verify step's tokens are rows of their own, and one request's
    1 + k tokens exactly (batch 1's verify step: no padding rows, and a graph even where max_num_seqs is
    below 1 + k; EngineConfig.max_seq_rows)."""
    k = config.num_speculative_tokens
    if not (config.cuda_graphs and k):
        return ()
    return tuple(sorted({b for b in config.decode_graph_sizes if b >= 2} | {1 + k}))


def mixed_graph_sizes(config: EngineConfig) -> tuple[int, ...]:
    """The token buckets of the mixed-step graphs: under cudagraph_mode FULL the prefill graph sizes
    from 2 tokens (a one-token step is a uniform decode, a decode graph's); with decode graphs and
    speculative decoding, the verify steps too large for a verify graph (decode-row graphs up to the
    largest decode bucket or 1 + k, verify_graph_sizes): one per decode bucket B of B verify
    chunks of 1 + k tokens (the seeds' uniform batches of query length 1 + k). Under FULL those sizes
    join the prefill ones."""
    k = config.num_speculative_tokens
    sizes: set[int] = set()
    if config.mixed_graphs:
        sizes.update(n for n in config.prefill_graph_sizes if n >= 2)
    if config.cuda_graphs and k:
        largest_verify = max(verify_graph_sizes(config))
        sizes.update(n for n in (b * (1 + k) for b in config.decode_graph_sizes)
                     if largest_verify < n <= config.max_num_batched_tokens)
    return tuple(sorted(sizes))


def allocate_pool(rt: Runtime, num_blocks: int, config: EngineConfig, spare_bytes: int | None = None) -> None:
    """The KV tensors and block pool for a budget of num_blocks blocks of every layer. With several KV
    groups (engine.kv.groups) the budget's bytes are split so that every group holds the same number
    of max_model_len sequences; a group's block costs only its own layers' bytes."""
    kv_cache = rt.kv_cache
    blocks = blocks_per_group(kv_cache.groups, kv_cache.group_bytes_per_block, num_blocks * kv_cache.bytes_per_block,
                              config.max_model_len, config.block_size, config.max_num_batched_tokens)
    total = sum(n * b for n, b in zip(blocks, kv_cache.group_bytes_per_block))
    if spare_bytes is not None and total > spare_bytes:
        raise ConfigError(f"the KV groups need {total / 2**30:.2f} GiB for one request of max_model_len="
                          f"{config.max_model_len} each, but only {max(spare_bytes, 0) / 2**30:.2f} GiB is left")
    kv_cache.allocate(blocks)
    rt.block_pool = make_block_pool(kv_cache.groups, blocks, config.block_size)
    if isinstance(rt.block_pool, GroupedBlockPool):
        try:
            rt.block_pool.check_fits(config.max_model_len, config.max_num_batched_tokens)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def kv_pool_spare_bytes(free_bytes: int, total_bytes: int, reserved_bytes: int,
                        gpu_memory_utilization: float | None) -> int:
    """What the KV pool may take: the free memory less what the warm-up peak and the graphs still to be
    captured need (`reserved_bytes`); with gpu_memory_utilization (vLLM's meaning), also no more than
    that share of the GPU's total less what is in use already (this engine's weights and graphs, and
    anything else on the GPU, as vLLM counts it)."""
    spare = free_bytes - reserved_bytes
    if gpu_memory_utilization is not None:
        in_use = total_bytes - free_bytes
        spare = min(spare, int(total_bytes * gpu_memory_utilization) - in_use - reserved_bytes)
    return spare


def check_blocks(num_blocks: int, min_blocks: int, config: EngineConfig) -> None:
    if num_blocks < min_blocks:
        raise ConfigError(
            f"the KV pool has {num_blocks} blocks but max_model_len={config.max_model_len} needs at least "
            f"{min_blocks} (one full-length request plus the scratch block): raise EngineConfig.num_gpu_blocks "
            f"/ {'gpu_memory_utilization' if config.gpu_memory_utilization is not None else 'kv_memory_fraction'}"
            ", or lower max_model_len")


def capture_piecewise(runner: ModelRunner, backend: InferGraphsBackend, config: EngineConfig) -> float:
    """Let the backend capture its piecewise graphs now, largest size first, on scratch-only dummy steps."""
    sizes = sorted(config.prefill_graph_sizes, reverse=True)
    start = time.perf_counter()
    bar = None
    if config.show_progress:
        from tqdm import tqdm
        bar = tqdm(total=len(sizes), desc="piecewise graphs", unit="size", file=sys.stderr, leave=False)
    free_before = torch.cuda.mem_get_info(runner.device)[0]

    def forward(num_tokens: int) -> None:
        if bar is not None:
            bar.set_postfix_str(f"tokens {num_tokens}, free {free_memory_gib(runner.device):.2f} GiB")
        ids, positions = runner.buffers.input_ids[:num_tokens], runner.buffers.positions[:num_tokens]
        runner.mark_dynamic(ids, positions)
        runner.forward(ids, positions)
        if bar is not None:
            bar.update(1)

    try:
        backend.capture(forward, sizes, lambda n: runner.load_dummy(n, _dummy_seqs(n, config), False),
                        kv_caches=runner.kv_caches)
    finally:
        if bar is not None:
            bar.close()
    torch.cuda.synchronize(runner.device)
    seconds = time.perf_counter() - start
    used = max(0, free_before - torch.cuda.mem_get_info(runner.device)[0])
    line = (f"captured piecewise graphs for {len(sizes)} token sizes ({sizes[-1]}..{sizes[0]}) in "
            f"{seconds:.2f} s, graph memory {used / 2**20:.1f} MiB")
    if config.show_progress:
        print(line, file=sys.stderr)
    logger.info(line)
    return seconds


def measure_graphs(kind: type[DecodeGraphs] | type[MixedGraphs], runner: ModelRunner, sizes: tuple[int, ...]) -> int:
    """Memory to reserve for a kind of full graphs (decode or mixed-step), measured by a throwaway
    capture of its largest size."""
    probe = kind(runner, torch.cuda.graph_pool_handle())  # a pool of its own, dropped with it
    released = probe.measure(max(sizes))
    # Every graph also holds a little device memory outside the allocator (its instantiated
    # executable): a fixed margin per graph keeps the real capture from running out.
    return released + len(sizes) * GRAPH_OVERHEAD_BYTES


def _dummy_seqs(num_tokens: int, config: EngineConfig) -> int:
    """Sequences to split a dummy step of num_tokens into: each within max_model_len, at most
    max_num_seqs (the static buffers' rows); what they cannot hold is padding (load_dummy)."""
    return min(num_tokens, config.max_num_seqs, max(1, -(-num_tokens // config.max_model_len)))
