"""The step channel between tensor-parallel ranks: what rank 0 sends each step and how the others run it.

Every rank holds a StepChannel: the compute group (the default process group: the model's
collectives and the staged buffers), a gloo control group for stats and start-up's agreements, and
the step headers (engine.distributed.headers: shared memory on one host, gloo across hosts). Rank 0's
ModelRunner stages a step into its static buffers; the channel sends the header (the step's size,
dispatch and metadata bounds, read on the host without a device sync) and broadcasts the staged
buffer slices packed into one tensor (block tables only as wide as the step's longest table, not
max_model_len / block_size wide); each follower unpacks them into its own static buffers at their
fixed addresses and calls the same ModelRunner.run_staged, so it replays the same graphs and its
collectives pair up with rank 0's. The model's all-reduces run on symmetric memory where every rank
can map it (custom_ops.all_reduce), on NCCL otherwise.
"""
from __future__ import annotations

import dataclasses
import datetime
import gc
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from custom_ops import RuntimeMode
from engine.config import EngineConfig
from engine.distributed.headers import STATS, STOP, make_headers, min_over_ranks
from engine.worker.dispatch import BatchDescriptor

logger = logging.getLogger("engine")

COLLECTIVE_TIMEOUT_S = 300.0  # a step, or start-up's compile of one rank while the others wait
CONTROL_TIMEOUT = datetime.timedelta(days=7)  # followers wait here for the next step of an idle engine
MODES = list(RuntimeMode)


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed (died, raised, or a collective timed out); the engine is unusable."""


class StepChannel:
    """What every rank shares: the compute group (the model's collectives, the staged buffers), the
    control group (stats, start-up's agreements) and the step headers (engine.distributed.headers)."""

    def __init__(self, config: EngineConfig) -> None:
        import models.parallel
        self.config = config
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        self.all_reduce, self.all_reduce_path = _symmetric_all_reduce(config, self.control)
        self.parallel = models.parallel.TensorParallel(self.rank, self.world_size, dist.group.WORLD,
                                                       symmetric_all_reduce=self.all_reduce is not None)
        self.headers = make_headers(self.control, self.rank, self.world_size, timeout_s=COLLECTIVE_TIMEOUT_S,
                                    on_gpu=torch.device(config.device).type == "cuda")
        self.packed: torch.Tensor | None = None  # the staged buffers of one step, flat
        self.runtime = None

    def load_model(self, model_path: str) -> torch.nn.Module:
        import models
        device, dtype = self.config.device_and_dtype()
        return models.from_pretrained(model_path, dtype=dtype, device=device, tp=self.parallel,
                                      quantization=self.config.quantization)

    def min_over_ranks(self, value: int) -> int:
        return min_over_ranks(value, self.control)

    def _staged(self, num_tokens: int, num_seqs: int, num_sampling: int, table_width: int) -> list[torch.Tensor]:
        b = self.runtime.runner.buffers
        groups = [t for (slots, _), tables in zip(b.group_slot_mappings, b.group_tables)  # engine.kv.groups
                  for t in (slots[:num_tokens], tables.table[:num_seqs, :table_width])]
        return [b.input_ids[:num_tokens], b.positions[:num_tokens], b.slot_mapping[:num_tokens],
                b.query_start_loc[:num_seqs + 1], b.seq_lens[:num_seqs], b.block_tables[:num_seqs, :table_width],
                b.logits_indices[:num_sampling], *groups]

    def table_width(self, num_seqs: int) -> int:
        """Rank 0: the block-table columns this step's sequences use, in any KV group's tables (entries
        past a table's length are never read, so the other ranks' stale ones there are harmless)."""
        b = self.runtime.runner.buffers
        return max(t.used_width(num_seqs) for t in (b.tables, *b.group_tables))

    def broadcast_buffers(self, num_tokens: int, num_seqs: int, num_sampling: int, table_width: int) -> None:
        """Rank 0's staged step into every rank's static buffers, packed into one broadcast (each
        collective costs a round trip; the buffers keep their fixed addresses)."""
        b = self.runtime.runner.buffers
        if self.packed is None:
            num_groups = 1 + len(b.group_tables)
            size = (2 + num_groups) * b.max_tokens + 3 * b.max_seqs + 1 + num_groups * b.max_seqs * b.max_blocks_per_seq
            self.packed = torch.empty(size, dtype=torch.int64, device=b.input_ids.device)
        staged = self._staged(num_tokens, num_seqs, num_sampling, table_width)
        packed = self.packed[:sum(t.numel() for t in staged)]
        if self.rank == 0:
            torch.cat([t.reshape(-1) for t in staged], out=packed)
        dist.broadcast(packed, src=0)
        if self.rank != 0:  # into the buffers themselves (a narrowed table is a strided view), in one call
            sources = [part.view(t.shape) for part, t in zip(packed.split([t.numel() for t in staged]), staged)]
            torch._foreach_copy_(staged, sources)

    def local_stats(self) -> dict[str, Any]:
        """This rank's graph counts and fallbacks (LLM.stats()['ranks'])."""
        runner = self.runtime.runner
        graphs = runner.decode_graphs
        stats: dict[str, Any] = {
            "rank": self.rank,
            "device": str(runner.device),
            "modes": dict(runner.dispatcher.mode_counts),
            "fallbacks": runner.dispatcher.fallbacks,
            "fallback_reasons": dict(runner.dispatcher.fallback_counts),
            "kv_blocks": self.runtime.kv_cache.num_blocks,
            "kv_blocks_by_group": list(self.runtime.kv_cache.num_blocks_by_group),
            "decode_graphs": len(graphs.sizes) if graphs else 0,
            "decode_graph_replays": graphs.replays if graphs else 0,
            # calls per kernel when the op ran eagerly (warm-up, captures, steps without a graph):
            # which kernels the graphs hold, not how often they replayed; {} where NCCL does all
            "all_reduce_calls": dict(self.all_reduce.calls) if self.all_reduce is not None else {},
            "all_reduce": self.all_reduce_path,
            "step_headers": self.headers.kind,  # shared_memory (ranks on one host) or gloo
        }
        if self.runtime.backend is not None:
            stats["backend"] = dataclasses.asdict(self.runtime.backend.stats)
        return stats


# Crossovers from the sweep of bench tp on 2 H200s (bench/results/h200-2026-11-28/tp, an all-reduce of
# [tokens, 2560] bf16 in a CUDA graph): one-shot beats two-shot up to 128 tokens (655 KB: 12.8 vs 14.3 us)
# and ties at 256 (1.3 MB: 17.0 vs 16.5); two-shot beats NCCL at every size measured, to 4096 tokens
# (21 MB: 93 vs 110 us). The buffer is as large as the two-shot bound, on every rank. Measured at tp 2 only.
ONE_SHOT_MAX_BYTES = 1 << 20
TWO_SHOT_MAX_BYTES = 32 << 20


def _symmetric_all_reduce(config: EngineConfig, control: Any) -> tuple[Any, str]:
    """The compute group's symmetric-memory all-reduce, registered for infer::all_reduce, and what
    all-reduces (said in every rank's stats). Every rank makes its channel at the same point of
    start-up, and all of them agree before and after the rendezvous (a collective): the ranks must
    call the same kernels or their collectives never pair up. None (NCCL for every all-reduce, as
    before) on the CPU, when disabled, or where any rank cannot map the buffer."""
    from custom_ops import all_reduce
    if config.disable_custom_all_reduce:
        return None, "nccl: EngineConfig.disable_custom_all_reduce"
    if torch.device(config.device).type != "cuda":
        return None, "gloo: the CPU"
    group = dist.group.WORLD
    reason = all_reduce.SymmetricAllReduce.unavailable(group, torch.device(config.device))
    comm = None
    if min_over_ranks(int(reason is None), control):
        comm = all_reduce.SymmetricAllReduce.create(group, torch.device(config.device), ONE_SHOT_MAX_BYTES,
                                                    TWO_SHOT_MAX_BYTES)
        if not min_over_ranks(int(comm is not None), control):
            reason = reason or ("symmetric memory failed on this rank" if comm is None else
                                "symmetric memory failed on another rank")
            comm = None
    else:
        reason = reason or "another rank cannot map a symmetric buffer (its log says why)"
    if comm is None:
        logger.warning("tensor parallelism: all-reduce over NCCL: %s", reason)
        return None, f"nccl: {reason}"
    all_reduce.register(comm)
    return comm, "symmetric memory below the crossover, nccl above"


def follow(config: EngineConfig, model_path: str, rank: int, owns_group: bool, spawned: bool = False) -> None:
    """A rank other than 0: build the same runtime as rank 0, then run each step it sends."""
    from engine.worker.startup import build_runtime
    if config.wants_compile():  # beside this rank's weight load, as on rank 0 (engine.core.llm)
        from engine.worker.compile import prefetch_compile_imports
        prefetch_compile_imports(torch.device(config.device).type)
    group = StepChannel(config)
    model = group.load_model(model_path)
    config = config.resolve(model.config.max_position_embeddings)
    with torch.inference_mode():
        group.runtime = build_runtime(model, config, min_over_ranks=group.min_over_ranks)
        runner = group.runtime.runner
        parent = os.getppid()

        def rank0_alive() -> None:  # a spawned rank whose rank 0 died must not poll forever
            if spawned and os.getppid() != parent:
                raise TensorParallelError(f"rank {rank}: rank 0 (the parent process) exited")

        while True:
            header = group.headers.receive(rank0_alive)
            if header.op == STOP:
                break
            if header.op == STATS:
                dist.gather_object(group.local_stats(), None, dst=0, group=group.control)
                continue
            h = header  # a STEP
            dispatch = runner.dispatcher.dispatch(BatchDescriptor(h.num_tokens, bool(h.uniform)))
            if dispatch.mode is not MODES[h.mode] or dispatch.descriptor.num_tokens != h.num_padded:
                raise TensorParallelError(
                    f"rank {rank} dispatched a {h.num_tokens}-token step to {dispatch.mode.value} at "
                    f"{dispatch.descriptor.num_tokens} tokens, rank 0 to {MODES[h.mode].value} at {h.num_padded}: "
                    "the ranks' graph sizes differ")
            group.broadcast_buffers(h.num_padded, h.num_seqs, h.num_sampling, h.table_width)
            meta = None
            if dispatch.mode is not RuntimeMode.FULL:
                meta = runner.buffers.metadata(h.num_padded, h.num_seqs, h.num_actual, h.max_query_len,
                                               h.max_seq_len, bool(h.uniform))
            runner.run_staged(dispatch, meta, h.num_sampling, h.num_chunks)
        group.runtime.close()  # this rank's graphs go before the communicator they captured
        group.runtime = None
        group.headers.close()
    del model
    if torch.device(config.device).type == "cuda":
        torch.cuda.empty_cache()
    if owns_group:
        leave_process_group()


def abort_process_groups() -> bool:
    """Abort every group of this process (local: peers are not waited for) and forget them, so a
    new group can be made; False where this torch lacks the (private) call, torch 2.11-2.13 have it."""
    abort_all = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort_all is None:
        return False
    abort_all()
    return True


def leave_process_group(abort: bool | None = None) -> None:
    """Leave the default group and its subgroups, once this rank's graphs are freed and nothing is
    in flight. NCCL's destroy and abort both wait until every CUDA graph that captured one of the
    communicator's collectives is destroyed (its commDestroySync polls the graphs' references; the
    hang of pytorch/pytorch#115388 is that wait), so a graph that outlives its engine makes this
    hang. Piecewise graphs kept through Dynamo's globals would: the backend hands Dynamo a handle it
    can cut (compile_backend.compiled_graph.GraphHandle), so they go with the engine. The
    communicators are aborted (a local call: no peer is waited for); gloo (the CPU) is destroyed."""
    if abort is None:
        abort = dist.get_backend() == "nccl"
    from custom_ops import all_reduce
    all_reduce.unregister(dist.group.WORLD.group_name)  # its buffer goes before the group it was mapped for
    if abort:
        from compile_backend.pool import live_graphs  # lazy: compile_backend is slow to import
        # Free what only a collection frees, and name the graphs that survive: the wait below is theirs.
        gc.collect()
        if torch.cuda.is_initialized():  # a graph's release completes after its last replay
            torch.cuda.synchronize()
        if live := live_graphs():
            logger.error("tensor parallelism: %d CUDA graphs of this process are still alive while it leaves "
                         "the process group; NCCL waits for graphs that captured its collectives", live)
    if not (abort and abort_process_groups()):
        dist.destroy_process_group()
