"""Start-up: from a loaded model to a runner with its KV pool and graphs, in the one safe order.

On CUDA:
1. compile (optional: the compiled graph loaded from the compile cache, engine/worker/warm_start.py,
   or a forward Dynamo traces at the first dummy step) and a scratch-only KV cache (block 0), enough
   for dummy steps;
2. warm-up: a dummy step at the full token budget (the compile happens here) and a dummy decode at
   the largest batch, then the sampler on the largest batch of logits, and the LM head and sampler at
   every row count (their Triton variants compile here, not in a serving step); the measured peak is
   memory every later eager step needs;
3. piecewise graphs (prefill_graphs), largest size first: they do not record the KV address
   (attention runs between pieces), so they are captured now and their memory is simply resident;
4. a throwaway capture of the largest decode graph (and, under cudagraph_mode FULL, of the largest
   mixed-step graph) measures the memory those graphs will need;
5. the KV pool takes kv_memory_fraction of what is left (or, with gpu_memory_utilization, what that share of
   the GPU leaves; or num_gpu_blocks, checked to fit);
6. the decode graphs (and mixed-step graphs) are captured against the final pool, largest first, into
   the engine's pool: they record the KV caches' addresses.
On CPU: compile (optional), a pool of num_gpu_blocks (or kv_cache.CPU_KV_BYTES worth), no graphs.
Every step is a phase of the start-up timeline (engine/worker/timeline.py: seconds and memory, logged).

Graph memory follows compile_backend/pool.py's one rule: the engine owns ONE GraphPool, hands it to
its backend (piecewise graphs) and captures its decode graphs into it; `Runtime.close()` drops it.

Ownership: everything built here belongs to this engine alone and `Runtime.close()` releases it:
the KV tensors (handed to attention through the forward context, never a process-wide registry),
the decode and piecewise graphs, the pool, the compiled code with its Dynamo cache entries
(engine/worker/compile.py). Tensor-parallel worker processes belong to the LLM (engine/distributed/tp.py), which stops
them before it closes its runtime. Two engines over one model therefore never share state, and a closed engine's
model can be handed to a new one.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from custom_ops import RuntimeMode
from engine.config import ConfigError, EngineConfig
from engine.kv.block_pool import BlockPool
from engine.kv.grouped_pool import GroupedBlockPool, group_stats
from engine.kv.kv_cache import CPU_KV_BYTES, KVCache
from engine.params import SamplingParams
from engine.request import Request
from engine.sample.sampler import Sampler
from engine.worker.graphs_and_pool import (_dummy_seqs, allocate_pool, capture_and_size, check_blocks,
                                           verify_graph_sizes)
from engine.worker.model_runner import ModelRunner
from engine.worker.timeline import StartupTimeline

if TYPE_CHECKING:
    from compile_backend import InferGraphsBackend
    from engine.worker.compile import CompiledModel

logger = logging.getLogger("engine")


@dataclass
class Runtime:
    runner: ModelRunner
    kv_cache: KVCache
    block_pool: BlockPool | GroupedBlockPool
    sampler: Sampler
    backend: InferGraphsBackend | None = None  # the compile backend (for its stats), if compiled
    memory: dict[str, int] = field(default_factory=dict)  # start-up measurements, bytes
    piecewise_capture_seconds: float = 0.0
    compiled: CompiledModel | None = None
    pool: Any = None                            # the engine's GraphPool (CUDA)
    # With a compiled model, what start-up left alive (the traced and compiled model above all) stays
    # out of the collector's reach until close: a full collection over it took 0.24-0.28 s (gemma-3-1b
    # on an H100 host; 0.4 ms frozen), a stall for every request of the step that met one
    # (compile_backend.pool.gc_frozen; vLLM freezes the same way).
    gc_freeze: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def kv_group_stats(self, max_model_len: int) -> list[dict[str, object]]:
        """Per KV group: layers, blocks, free blocks, and sequences of max_model_len it holds."""
        kv = self.kv_cache
        return group_stats(kv.groups, kv.group_bytes_per_block, self.block_pool, max_model_len, kv.block_size)

    def close(self) -> None:
        """Release everything this engine made; the model itself is left as it was. Its frozen
        objects go back to the collector (the last engine open unfreezes), so the caller's next
        collection reaches what of the engine sits in reference cycles."""
        self.gc_freeze.close()
        runner = self.runner
        if runner.decode_graphs is not None:
            runner.decode_graphs.release()
            runner.decode_graphs = None
        if runner.mixed_graphs is not None:
            runner.mixed_graphs.release()
            runner.mixed_graphs = None
        if runner.verify_graphs is not None:
            runner.verify_graphs.release()
            runner.verify_graphs = None
        self.kv_cache.release()
        if runner.device.type == "cuda":
            from custom_ops.triton_attention import clear_plans  # lazy: Triton is imported where it runs
            clear_plans()  # launch plans hold this engine's step metadata
        if self.compiled is not None:
            self.compiled.release()
        runner.forward = None
        self.compiled = self.backend = None
        if self.pool is not None:
            self.pool.release()
            self.pool = None


def build_runtime(model: torch.nn.Module, config: EngineConfig, timeline: StartupTimeline | None = None,
                  min_over_ranks: Callable[[int], int] | None = None) -> Runtime:
    """`min_over_ranks`: under tensor parallelism, the minimum of a value over the ranks, so every
    rank's KV pool has the same number of blocks (the block tables are shared)."""
    timeline = timeline or StartupTimeline()
    device = torch.device(config.device)
    timeline.device = device
    cuda = device.type == "cuda"
    with timeline.phase("setup"):
        pool = None
        if cuda:
            from compile_backend.pool import GraphPool
            with torch.cuda.device(device):
                pool = GraphPool()
        from models import set_decode_gemv
        # before the compile and every capture: the switch is read when the forward is traced. Without
        # decode graphs nothing would record the GEMV, and the op would only cost host time.
        gemv = config.decode_gemv and config.cuda_graphs
        if set_decode_gemv(model, gemv) == 0 and gemv:  # the default: not a warning
            logger.info("EngineConfig.decode_gemv: %s has no models.layers.Linear, its matmuls stay as they are",
                        type(model).__name__)
        elif gemv and cuda:
            _note_untuned_matmuls(model, device, timeline)
    forward, mark_dynamic, backend, compiled = model, None, None, None
    if config.compile:
        # The compiled graph from the compile cache (a warm start: no trace, no compile; its load is
        # this phase), or a forward Dynamo traces at the warm-up's first step ("compile").
        with timeline.phase("compile cache"):
            from engine.worker.compile import compile_model, wait_for_compile_imports
            # the imports the thread started at the engine's start did not finish beside the load
            timeline.notes["compile_imports_wait_s"] = round(wait_for_compile_imports(), 3)
            from engine.worker.compile_cache import configure_compile_cache
            configure_compile_cache()
            compiled, mark_dynamic, backend = compile_model(model, config, pool)
            forward = compiled
        timeline.notes["compile_cache"] = compiled.cache_status
    with timeline.phase("buffers"):
        max_tokens = max(config.max_num_batched_tokens, config.max_seq_rows)
        runner = ModelRunner(model, forward, config.block_size, config.max_model_len, max_tokens,
                             config.max_seq_rows, device, mark_dynamic, config.max_logits_rows)
        kv_cache = KVCache(model.attention_layer_names, config.block_size, config.torch_dtype, device,
                           by_kind=config.hybrid_kv_cache)
        runner.kv_caches = kv_cache.by_layer  # every step's forward context carries this engine's caches
        runner.set_kv_groups(kv_cache.groups)
        choices = None
        if cuda:  # the argmax method timed once per GPU and vocabulary, then remembered
            from engine.worker.compile_cache import compile_cache_dir
            choices = compile_cache_dir() / "argmax.json"
        sampler = Sampler(device, config.seed, tuple(model.config.eos_token_ids), choices)
    rt = Runtime(runner, kv_cache, BlockPool(2, config.block_size), sampler, backend, compiled=compiled,
                 pool=pool)
    try:
        # The engine's device is current while it builds: the capture streams and the pool are per device.
        with torch.cuda.device(device) if cuda else contextlib.nullcontext():
            _build(rt, model, config, timeline, min_over_ranks)
    except BaseException:
        rt.close()  # a failed start-up leaves nothing behind either
        del rt
        if cuda:
            torch.cuda.empty_cache()
        raise
    if compiled is not None:
        compiled.finish_cache()  # only a start-up that succeeded writes its graph to the cache
        timeline.notes["dynamo_traced"] = compiled.dynamo_traced
        if compiled.cache_saved is not None:
            timeline.notes["compile_cache_saved"] = compiled.cache_saved
    return rt


def _note_untuned_matmuls(model: torch.nn.Module, device: torch.device, timeline: StartupTimeline) -> None:
    """Say once (log and stats()["startup"]["gemv_untuned"]) which of the model's matmul shapes run cuBLAS
    at batch 1 for want of a GEMV table entry on this GPU: a model or tensor-parallel split not yet swept."""
    from custom_ops.gemv_table import untuned_shapes
    from models import matmul_weights
    shapes = list(dict.fromkeys(tuple(w.shape) for w in matmul_weights(model)
                                if w.element_size() > 1))  # FP8 layers have tables of their own
    untuned = untuned_shapes(shapes, next(model.parameters()).dtype, device.index)
    timeline.notes["gemv_untuned"] = [f"{n}x{k}" for n, k in untuned]
    if untuned:
        logger.info("decode matmuls: %d of %d shapes have no GEMV tuning on this GPU and run cuBLAS at batch 1 "
                    "(%s)", len(untuned), len(shapes), ", ".join(timeline.notes["gemv_untuned"]))


def _build(rt: Runtime, model: torch.nn.Module, config: EngineConfig, timeline: StartupTimeline,
           min_over_ranks: Callable[[int], int] | None) -> None:
    runner, kv_cache, sampler = rt.runner, rt.kv_cache, rt.sampler
    device = runner.device
    min_blocks = -(-config.max_model_len // config.block_size) + 1  # one full-length request + scratch
    if device.type != "cuda":
        with timeline.phase("kv pool"):
            num_blocks = config.num_gpu_blocks
            if num_blocks is None:
                num_blocks = max(min_blocks, min(kv_cache.blocks_for_memory(CPU_KV_BYTES),
                                                 config.max_num_seqs * (min_blocks - 1) + 1))
            if min_over_ranks is not None:
                num_blocks = min_over_ranks(num_blocks)
            check_blocks(num_blocks, min_blocks, config)
            allocate_pool(rt, num_blocks, config)
        # compiles now (with compile), and makes the kernels' lazy set-up: not in the first request's step
        # (the default model's first TTFT on a 2-core CPU read 2.4 s without it, the next 0.6-0.9 s)
        _warm_up(runner, sampler, config, timeline)
        if config.compile:
            from compile_backend.pool import gc_frozen  # lazy: compile_backend is slow to import
            with timeline.phase("gc freeze"):
                rt.gc_freeze.enter_context(gc_frozen())  # the compiled model out of serving's collections
        return

    kv_cache.allocate(1)  # scratch block only: every dummy step reads and writes just block 0
    memory = rt.memory
    memory["activation_peak_bytes"] = _warm_up(runner, sampler, config, timeline)
    from compile_backend.pool import gc_frozen  # lazy: compile_backend is slow to import
    # One full collection for all the capture phases below: each phase's own freeze then only visits
    # what was made since (compile_backend.pool.gc_frozen). The freeze lasts until Runtime.close, so
    # serving never collects over the compiled model either (Runtime.gc_freeze).
    with timeline.phase("gc freeze"):
        rt.gc_freeze.enter_context(gc_frozen())
    capture_and_size(rt, config, timeline, min_over_ranks, min_blocks)


def _warm_up(runner: ModelRunner, sampler: Sampler, config: EngineConfig,
             timeline: StartupTimeline | None = None) -> int:
    """Run the largest steps once (compiling if needed); the activation peak in bytes (0 on CPU).

    The first step is the "compile" phase of the timeline when the model is compiled (Dynamo and
    the backend run inside it), the rest "warm-up"."""
    timeline = timeline or StartupTimeline()
    cuda = runner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(runner.device)
        torch.cuda.reset_peak_memory_stats(runner.device)
        base = torch.cuda.memory_allocated(runner.device)
    max_tokens = config.max_num_batched_tokens
    num_seqs = min(config.max_num_seqs, max_tokens)
    if not cuda:  # no memory to measure: small steps do the lazy set-up (the full budget took 12 s)
        max_tokens, num_seqs = min(max_tokens, 16), min(num_seqs, 2)
    steps = ((max_tokens, _dummy_seqs(max_tokens, config), False), (num_seqs, num_seqs, True))
    traces = config.compile and getattr(runner.forward, "cache_status", None) != "hit"
    for i, (tokens, seqs, uniform) in enumerate(steps):
        phase = "compile" if i == 0 and traces else "warm-up"
        with timeline.phase(phase):
            meta = runner.load_dummy(tokens, seqs, uniform)
            hidden = runner.run_forward(meta, RuntimeMode.NONE, tokens)
            rows = runner.buffers.logits_indices[:seqs]
            logits = runner.model.compute_logits(hidden[rows])
            del hidden
            if i == len(steps) - 1:
                # The sampler's largest working set: sorting and filtering a full batch of logits.
                fake = [Request(f"warm-up-{j}", [0], SamplingParams(temperature=1.0, top_k=2, top_p=0.5))
                        for j in range(logits.shape[0])]
                sampler(logits, fake)
                if cuda:  # real logits of this model: the argmax method is timed on them once
                    sampler.argmax.choose(logits)
            del logits
    if not cuda:
        return 0
    with timeline.phase("sampling kernels"):
        # up to max_seq_rows: a verify graph's rows reach 1 + k, and its greedy tokens come from the keys
        _compile_sampling_kernels(runner, sampler, min(config.max_seq_rows, max_tokens),
                                  1 + config.num_speculative_tokens, verify_graph_sizes(config))
    torch.cuda.synchronize(runner.device)
    return max(0, torch.cuda.max_memory_allocated(runner.device) - base)


def _compile_sampling_kernels(runner: ModelRunner, sampler: Sampler, num_seqs: int, verify_width: int = 1,
                              verify_sizes: tuple[int, ...] = ()) -> None:
    """The LM head and the sampler outside any graph at every row count a step can sample (1..num_seqs),
    so each Triton variant they use compiles now: the LM head's kernel is chosen per row bucket
    (custom_ops.gemv_table) and the argmax's chunk per row count. Met first in serving, such a compile
    took 0.36 s of one step (gemma-3-1b at batch 64 on a fresh H100: TTFT median 98 -> 465 ms in that
    generate; bench/results/h100-2026-11-27/serving-compiles/). With warm Triton caches this costs
    milliseconds. Every rank runs it (the LM head's collectives under tensor parallelism). At each verify
    graph's row count (`verify_sizes`, chunks of `verify_width` = 1 + k) the greedy verify's one kernel
    over that graph's keys too."""
    from engine.sample.sampler import verify_greedy_from_keys
    model = runner.model
    hidden = torch.randn(num_seqs, model.config.hidden_size, dtype=model.config.dtype, device=runner.device)
    key_tiles = getattr(model, "argmax_key_tiles", None)  # a models.base.CausalLM's
    for rows in range(1, num_seqs + 1):
        logits = model.compute_logits(hidden[:rows])
        tiles = key_tiles(rows) if key_tiles is not None else None
        sampler.compile_kernels(logits, tiles)
        if tiles and rows in verify_sizes:  # laid out as engine.spec.sampling stages them
            staged = torch.zeros(2, verify_width, dtype=torch.int64, device=runner.device)
            verify_greedy_from_keys(torch.zeros(rows, tiles, dtype=torch.int64, device=runner.device), staged[:1],
                                    staged[1:, :verify_width - 1])


def check_built_model(weight: torch.Tensor, config: EngineConfig) -> None:
    """A built model runs in its own dtype and on its own device: a config that asks for others
    would give a KV cache and buffers the model cannot use."""
    dtype = str(weight.dtype).removeprefix("torch.")
    if config.dtype != dtype:
        raise ConfigError(f"EngineConfig.dtype={config.dtype!r} but the built model's weights are {dtype}: "
                          "leave dtype unset for a built model, or convert the model first")
    asked = torch.device(config.device)
    if asked.type != weight.device.type or asked.index not in (None, weight.device.index):
        raise ConfigError(f"EngineConfig.device={config.device!r} but the built model's weights are on "
                          f"{weight.device}: leave device unset for a built model, or move the model first")
