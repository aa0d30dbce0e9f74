"""Tensor parallelism: one process per rank, rank 0 schedules, every rank runs the same forward.

Launch. `LLM(..., tensor_parallel_size=N)` calls `launch`: under torchrun (RANK / WORLD_SIZE /
MASTER_ADDR set) each of torchrun's processes is a rank; otherwise the caller is rank 0 and spawns
ranks 1..N-1 (always spawn: fork after CUDA initialisation breaks CUDA). Either way every rank then
does the same: join the process group (NCCL on CUDA, with device_id so NCCL initialises before any
graph capture; gloo on the CPU), load only its shards (models.from_pretrained(tp=...)), build the
same runtime (warm-up, compile and graph capture run their collectives in lockstep), and agree on
the KV pool size (the minimum over ranks: block tables are shared). Rank 0 returns to the caller;
every other rank follows steps until told to stop (a torchrun rank then exits its process).

One step. Rank 0's ModelRunner stages the step into its static buffers, then `Leader.send_step`
sends it through the StepChannel (engine.distributed.rank_loop) and every other rank runs the same
`ModelRunner.run_staged`. Logits are gathered on every rank; only rank 0 samples.

Errors, not hangs. Collectives on the compute group time out after COLLECTIVE_TIMEOUT_S; the control
group waits longer, because a follower legitimately waits there while the engine is idle. Rank 0
checks before every step that each spawned worker is alive, and a worker that raises reports its
traceback and exits, so the caller gets a TensorParallelError naming the rank instead of a hang.
`close()` stops the workers (joined with a deadline, then terminated) and leaves the process group.
"""
from __future__ import annotations

import atexit
import dataclasses
import datetime
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from engine.config import ConfigError, EngineConfig
from engine.worker.dispatch import BatchDescriptor, Dispatch
from engine.distributed.headers import STATS, STEP, STOP, StepHeader
from engine.distributed.rank_loop import (COLLECTIVE_TIMEOUT_S, MODES, StepChannel, TensorParallelError,
                                          abort_process_groups, follow, leave_process_group)

__all__ = ["COLLECTIVE_TIMEOUT_S", "Leader", "TensorParallelError", "check_model_fits", "launch"]

logger = logging.getLogger("engine")

JOIN_TIMEOUT_S = 30.0


def launch(config: EngineConfig, model: Any) -> tuple[Leader, EngineConfig]:
    """Start (or join) the ranks; on rank 0, return its Leader and its config (device cuda:0 on
    CUDA). On any other torchrun rank, serve the steps and exit the process when rank 0 closes."""
    n = config.tensor_parallel_size
    if not isinstance(model, (str, os.PathLike)):
        raise ConfigError(f"EngineConfig.tensor_parallel_size={n} needs a model path (an HF-format dir or "
                          "a .gguf file) so each rank loads its own shards; got a built model")
    check_model_fits(str(model), n)
    device, _ = config.device_and_dtype()
    cuda = torch.device(device).type == "cuda"
    if {"RANK", "WORLD_SIZE", "MASTER_ADDR"} <= os.environ.keys():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world != n:
            raise ConfigError(f"EngineConfig.tensor_parallel_size={n} but torchrun started WORLD_SIZE={world} "
                              "processes; they must match")
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        if cuda and local_rank >= torch.cuda.device_count():  # ranks may span nodes: count this node's
            raise ConfigError(f"EngineConfig.tensor_parallel_size={n}: local rank {local_rank} has no GPU "
                              f"(this node has {torch.cuda.device_count()} visible)")
        owns_group = _init_group(rank, n, local_rank, cuda, store=None)
        rank_config = _rank_config(config, local_rank, cuda)
        if rank != 0:
            follow(rank_config, str(model), rank, owns_group)
            sys.exit(0)
        leader = Leader(rank_config, processes=[], errors=None, owns_group=owns_group)
        atexit.register(leader.close)
        return leader, rank_config
    if cuda and n > torch.cuda.device_count():
        raise ConfigError(f"EngineConfig.tensor_parallel_size={n} exceeds the {torch.cuda.device_count()} "
                          "visible GPU(s) (one rank per GPU)")
    if dist.is_initialized():
        raise ConfigError(f"EngineConfig.tensor_parallel_size={n}: this process already has a torch.distributed "
                          "process group, so the engine cannot start its own ranks; launch with torchrun "
                          "(its group is then used) or destroy the group first")
    import torch.multiprocessing as mp
    store = dist.TCPStore("127.0.0.1", 0, n, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    processes = []
    for rank in range(1, n):
        process = ctx.Process(target=_spawned_rank, name=f"tp-rank-{rank}", daemon=True,
                              args=(rank, n, store.port, config, str(model), errors, torch.get_num_threads()))
        process.start()
        processes.append(process)
    leader = Leader(_rank_config(config, 0, cuda), processes, errors, owns_group=True)
    atexit.register(leader.close)  # an engine never closed still stops its workers at exit
    try:
        _init_group(0, n, 0, cuda, store)
    except Exception as exc:
        leader.close()
        raise TensorParallelError(f"tensor-parallel start-up failed: {exc}{leader.worker_report()}") from exc
    if cuda:
        leader.watch()
    return leader, leader.config


def check_model_fits(model_path: str, n: int) -> None:
    """N must divide the attention heads and the intermediate size (KV heads are split or replicated)."""
    import models
    from models.config import ModelConfig
    from models.loader import read_config
    from pathlib import Path
    config = ModelConfig.from_hf(read_config(Path(models.resolve_model_path(model_path))))
    for what, size in (("num_attention_heads", config.num_heads), ("intermediate_size", config.intermediate_size)):
        if size % n:
            raise ConfigError(f"EngineConfig.tensor_parallel_size={n} does not divide the model's {what} "
                              f"({size}): every rank must hold the same share")
    if n > config.num_kv_heads and n % config.num_kv_heads:
        raise ConfigError(f"EngineConfig.tensor_parallel_size={n} exceeds the model's num_key_value_heads "
                          f"({config.num_kv_heads}) and is not a multiple of it: KV heads cannot be replicated evenly")
    if n <= config.num_kv_heads and config.num_kv_heads % n:
        raise ConfigError(f"EngineConfig.tensor_parallel_size={n} does not divide the model's "
                          f"num_key_value_heads ({config.num_kv_heads})")


def _rank_config(config: EngineConfig, local_rank: int, cuda: bool) -> EngineConfig:
    device = f"cuda:{local_rank}" if cuda else "cpu"
    return dataclasses.replace(config, device=device, show_progress=config.show_progress and local_rank == 0)


def _init_group(rank: int, world: int, local_rank: int, cuda: bool, store: Any) -> bool:
    """Join the default process group; False if the process already had one (torchrun scripts that
    made their own), which is then used and left for its owner to destroy."""
    if dist.is_initialized():
        if dist.get_world_size() != world:
            raise ConfigError(f"EngineConfig.tensor_parallel_size={world} but the existing process group has "
                              f"{dist.get_world_size()} ranks")
        if cuda:
            torch.cuda.set_device(local_rank)
        return False
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    kwargs: dict[str, Any] = {"backend": "nccl" if cuda else "gloo", "rank": rank, "world_size": world,
                              "timeout": timeout}
    if store is not None:
        kwargs["store"] = store
    if cuda:
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)  # NCCL initialises now, not inside a capture
    dist.init_process_group(**kwargs)
    return True


def _spawned_rank(rank: int, world: int, port: int, config: EngineConfig, model: str, errors: Any,
                  num_threads: int) -> None:
    """Entry point of a spawned worker process (intra-op threads as many as rank 0 uses)."""
    torch.set_num_threads(num_threads)
    try:
        cuda = torch.device(config.device_and_dtype()[0]).type == "cuda"
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                              timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        _init_group(rank, world, rank, cuda, store)
        follow(_rank_config(config, rank, cuda), model, rank, owns_group=True, spawned=True)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise


class Leader:
    """Rank 0's handle on the group: sends each staged step, gathers stats, checks and stops workers."""

    def __init__(self, config: EngineConfig, processes: list[Any], errors: Any, owns_group: bool) -> None:
        self.config = config
        self.processes = processes  # spawned ranks 1..N-1 (empty under torchrun)
        self.errors = errors
        self.owns_group = owns_group
        self.group: StepChannel | None = None
        self.failure: str | None = None
        self.closed = False
        self._stop_sent = False
        self._lock = threading.Lock()  # close() against the watcher's abort

    def wait_for(self, event: torch.cuda.Event, check_every_s: float = 0.2) -> None:
        """Wait for a CUDA event of rank 0's step, asking every check_every_s whether the workers live:
        a collective whose peer died never completes (a symmetric-memory kernel spins on its signal pad;
        no abort reaches it), so a plain synchronize would block forever. Raises TensorParallelError
        naming the dead rank, before anything the step computed is read."""
        last_check = time.monotonic()
        while not event.query():
            now = time.monotonic()
            time.sleep(0)  # spin as a CUDA synchronize does, the GIL free for the other threads
            if now - last_check > check_every_s:
                last_check = now
                self.check_workers()

    def watch(self, interval_s: float = 1.0) -> None:
        """On CUDA, a daemon thread that, when a spawned worker dies, aborts the NCCL communicators and
        releases this rank's symmetric-memory waits (custom_ops.all_reduce.SymmetricAllReduce.release_waits):
        rank 0's GPU may be inside a collective that can no longer complete; released, its queued work
        drains (its results are never read: wait_for raises first) and close() can free the graphs."""
        def run() -> None:
            while True:
                time.sleep(interval_s)
                with self._lock:
                    if self.closed:
                        return
                    if all(p.is_alive() for p in self.processes):
                        continue
                    comm = self.group.all_reduce if self.group is not None else None
                    if dist.is_initialized():
                        logger.error("tensor parallelism: a worker died; aborting the process group")
                        try:
                            abort_process_groups()
                        except Exception as exc:  # the step still fails, by check_workers or timeout
                            logger.warning("tensor parallelism: abort failed: %s", exc)
                if comm is not None:  # outside the lock: close() must not wait on a drain
                    comm.release_waits(torch.device(self.config.device))
                return

        threading.Thread(target=run, name="tp-watch", daemon=True).start()

    @property
    def parallel(self):  # models.parallel.TensorParallel of rank 0
        return self._group().parallel

    def _group(self) -> StepChannel:
        if self.group is None:
            self.group = StepChannel(self.config)
        return self.group

    def min_over_ranks(self, value: int) -> int:
        return self._group().min_over_ranks(value)

    def attach(self, runtime: Any) -> None:
        """Start sending rank 0's staged steps (runtime: engine.worker.startup.Runtime, built on every rank)."""
        self._group().runtime = runtime
        runtime.runner.on_staged = self.send_step

    def send_step(self, batch: BatchDescriptor, dispatch: Dispatch, meta: Any, num_sampling: int,
                  num_chunks: int) -> None:
        group = self._group()
        self.check_workers()
        if meta is None:  # FULL: the graph reads the sequence rows it was captured with; no metadata
            num_seqs = group.runtime.runner.full_graph_seqs(dispatch)
            num_actual, max_query_len, max_seq_len = 0, 0, 0
        else:
            num_seqs, num_actual = meta.seq_lens.shape[0], meta.num_actual_tokens
            max_query_len, max_seq_len = meta.max_query_len, meta.max_seq_len
        table_width = group.table_width(num_seqs)
        header = StepHeader(STEP, batch.num_tokens, int(batch.uniform_decode), MODES.index(dispatch.mode),
                            dispatch.descriptor.num_tokens, num_seqs, num_actual, max_query_len, max_seq_len,
                            num_sampling, num_chunks, table_width)
        try:
            group.headers.send(header, self.check_workers)
            group.broadcast_buffers(dispatch.descriptor.num_tokens, num_seqs, num_sampling, table_width)
        except (RuntimeError, TimeoutError) as exc:
            self._fail(f"sending a step failed: {exc}")

    def rank_stats(self) -> list[dict[str, Any]]:
        """Every rank's graph counts and fallbacks, rank 0 first (none once closed)."""
        if self.closed:
            return []
        group = self._group()
        self.check_workers()
        gathered: list[Any] = [None] * group.world_size
        try:
            group.headers.send(StepHeader(STATS), self.check_workers)
            dist.gather_object(group.local_stats(), gathered, dst=0, group=group.control)
        except (RuntimeError, TimeoutError) as exc:
            self._fail(f"gathering stats failed: {exc}")
        return gathered

    def worker_report(self) -> str:
        """What failed workers reported (their tracebacks), as text to append to an error."""
        lines = []
        while self.errors is not None and not self.errors.empty():
            rank, text = self.errors.get_nowait()
            lines.append(f"\n--- tensor-parallel rank {rank} raised:\n{text}")
        return "".join(lines)

    def check_workers(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        dead = [p for p in self.processes if not p.is_alive()]
        if dead:
            self._fail("; ".join(f"rank {p.name.removeprefix('tp-rank-')} (pid {p.pid}) exited with code "
                                 f"{p.exitcode}" for p in dead))

    def _fail(self, what: str) -> None:
        self.failure = f"tensor-parallel worker failed: {what}{self.worker_report()}"
        raise TensorParallelError(self.failure)

    def close(self) -> None:
        """Stop the workers and leave the group (start-up failures and exit; LLM.close() calls the
        three steps itself, with this rank's graphs released after the first)."""
        self.send_stop()
        self.leave_group()
        self.join_workers()

    def send_stop(self) -> None:
        """Tell every worker to stop (each then frees its graphs and leaves the group); idempotent.

        The header goes out in a daemon thread joined with a deadline: a rank stuck in a collective
        (rank 0 failed mid-step) must not make close(), or process exit, hang."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        atexit.unregister(self.close)
        group = self.group
        # Only once attached are the other ranks sure to reach the control group's next header;
        # otherwise (rank 0 failed during start-up) they are stopped by signal in join_workers.
        self._stop_sent = group is not None and group.runtime is not None and self.failure is None
        if self._stop_sent:
            _bounded(lambda: group.headers.send(StepHeader(STOP), self.check_workers), JOIN_TIMEOUT_S,
                     "sending stop to the tensor-parallel workers")
        if group is not None:
            group.runtime = None  # the model and its KV pool are the engine's to free

    def leave_group(self) -> None:
        """Leave the process group this engine made (a torchrun script's own group is left alone),
        after this rank's CUDA graphs are freed (engine.distributed.rank_loop.leave_process_group says how)."""
        if self.group is not None:
            self.group.headers.close()
        if not self.owns_group or not dist.is_initialized():
            return
        self.owns_group = False
        _bounded(leave_process_group, JOIN_TIMEOUT_S, "leaving the tensor-parallel process group")
        if dist.is_initialized():
            logger.error("tensor parallelism: the process group is still initialized after close(); a new "
                         "tensor-parallel engine in this process will refuse to start")

    def join_workers(self) -> None:
        """Wait for the workers to exit (a deadline if they were sent stop), then terminate, then kill."""
        for process in self.processes:
            process.join(JOIN_TIMEOUT_S if self._stop_sent else 1.0)
            if process.is_alive():
                process.terminate()
                process.join(5.0)
            if process.is_alive():
                process.kill()
                process.join(5.0)


def _bounded(fn: Any, seconds: float, what: str) -> None:
    """Run fn in a daemon thread; give up (with a warning) after `seconds`."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:  # reported below: close() itself must not raise
            errors.append(exc)

    thread = threading.Thread(target=target, name="tp-close", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        logger.warning("tensor parallelism: %s did not finish in %.0f s; going on", what, seconds)
    elif errors:
        logger.warning("tensor parallelism: %s failed: %s", what, errors[0])
