"""EngineConfig: every knob of the engine in one validated dataclass.

Graph options on a CPU device: CUDA graphs do not exist there, so `cuda_graphs=True` or
`prefill_graphs=True` with a CPU device is *ignored with one warning* (not an error), so that one
command line works on a laptop and on a GPU machine. `resolve()` turns the "auto" values (None) into
concrete ones for the device; the rest of the engine reads only resolved configs.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from compile_backend.config import default_capture_sizes
from engine.spec.config import SpeculativeConfig, SpeculativeConfigError
from models.quantization import QUANTIZATIONS

logger = logging.getLogger("engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PIECE_COMPILERS = ("inductor", "eager")

# The seeds' (vLLM's) graph modes -> (decode graphs, piecewise graphs, full graphs for mixed steps):
#   NONE                no graphs: the compiled (or eager) model on every step
#   PIECEWISE           piecewise graphs for every step (attention eager between the pieces)
#   FULL                one native graph per step bucket for every step: decode graphs for uniform
#                       decode batches, mixed graphs (engine.worker.mixed_graphs) for the rest
#   FULL_DECODE_ONLY    decode graphs; every other step without a graph
#   FULL_AND_PIECEWISE  decode graphs, and piecewise graphs for the other steps
CUDAGRAPH_MODES: dict[str, tuple[bool, bool, bool]] = {
    "NONE": (False, False, False),
    "PIECEWISE": (False, True, False),
    "FULL": (True, False, True),
    "FULL_DECODE_ONLY": (True, False, False),
    "FULL_AND_PIECEWISE": (True, True, False),
}


def cudagraph_mode_of(cuda_graphs: bool, prefill_graphs: bool) -> str:
    """The mode name of the two simple switches (they cannot spell FULL)."""
    graphs = (bool(cuda_graphs), bool(prefill_graphs), False)
    return next(mode for mode, captured in CUDAGRAPH_MODES.items() if captured == graphs)


class ConfigError(ValueError):
    """An EngineConfig field has a value the engine cannot run with; the message names the field."""


def default_decode_graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Dense at small batch (1, 2, 4, 8), then steps of 8, always ending at max_num_seqs itself."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:  # an off-stride maximum must still be captured
        sizes.append(max_num_seqs)
    return tuple(sizes)


@dataclass
class EngineConfig:
    model: str = "default"                 # HF-format dir, a name models.resolve_model_path knows, or "default"
    tokenizer: str | None = None           # defaults to the model's own
    dtype: str | None = None               # float32 | bfloat16 | float16; None: bfloat16 on CUDA, float32 on CPU
    device: str | None = None              # None: cuda if available, else cpu
    max_model_len: int | None = None       # prompt + output tokens per request; None: min(model limit, 4096)
    max_num_seqs: int = 32                 # requests running at once (also the largest decode batch)
    max_num_batched_tokens: int = 1024     # per-step token budget shared by decodes and prefill chunks
    block_size: int = 16                   # tokens per KV cache block
    kv_memory_fraction: float = 0.9        # of the GPU memory left after weights, warm-up peak and graphs
    # vLLM's spelling: the share of the GPU's total memory this engine may hold in all (weights,
    # warm-up peak, graphs and the KV pool); when set, it sizes the KV pool instead of kv_memory_fraction
    gpu_memory_utilization: float | None = None
    num_gpu_blocks: int | None = None      # explicit KV pool size in blocks (incl. the scratch block)
    # KV pool per layer kind (engine.kv.groups): sliding-window layers give back blocks out of their
    # window; False: one pool, every layer keeps every block (num_gpu_blocks counts blocks of every layer)
    hybrid_kv_cache: bool = True
    compile: bool | None = None            # torch.compile with the infer_graphs backend; None: on for CUDA
    piece_compiler: str = "inductor"       # how the backend compiles pieces: inductor | eager
    cuda_graphs: bool | None = None        # full-decode graphs; None: on for CUDA
    decode_graph_sizes: tuple[int, ...] | None = None   # batch buckets; None: default_decode_graph_sizes
    prefill_graphs: bool | None = None     # piecewise graphs for prefill and mixed steps; None: on for CUDA + compile
    prefill_graph_sizes: tuple[int, ...] | None = None  # token buckets; None: compile_backend's default_capture_sizes
    # NONE | PIECEWISE | FULL | FULL_DECODE_ONLY | FULL_AND_PIECEWISE (CUDAGRAPH_MODES above); None: from
    # cuda_graphs / prefill_graphs (FULL_AND_PIECEWISE on CUDA with compile). The simple switches may be
    # given too, but only in agreement with it. Mixed-step graphs (FULL) use prefill_graph_sizes' buckets.
    cudagraph_mode: str | None = None
    seed: int = 0                          # for requests that give no seed of their own
    enable_prefix_caching: bool = True     # share the KV blocks of common prompt prefixes (README: why on)
    async_scheduling: bool = True          # host schedules step N+1 while step N runs (engine/core/step_loop.py at depth 1; False: depth 0)
    # detokenization and stop strings in a process of their own (engine/core/text_process.py), off the
    # step thread; False: on it. None: on with CUDA (the step thread's time at batch 64 fell 29% for
    # gemma-3-1b, 4% for llama-3.2-3b, H100: docs/performance.md), inline on the CPU device, whose
    # model uses every core.
    frontend_process: bool | None = None
    # batch-1 decode linears and LM head on the Triton GEMV where an H100 measurement of the kernel
    # alone beat cuBLAS (custom_ops.gemv_table; other shapes and batches stay on cuBLAS). Measured end
    # to end (`python -m bench decode --decode-gemv`, H100, llama-3.2-3b): the batch-1 decode graph
    # 3.305 -> 3.054 ms, batch 8 unchanged. Compiled pieces call the op (the graphs that record them
    # record its kernel); eager code calls the kernel without the dispatcher (models.layers.Linear).
    decode_gemv: bool = True
    show_progress: bool = True             # tqdm bar during graph capture
    tensor_parallel_size: int = 1          # ranks (GPUs) the model is split over; engine.distributed.tp
    # True: every tensor-parallel all-reduce is NCCL's; False: small ones run on symmetric memory
    # (custom_ops.all_reduce) where the GPUs support it (vLLM's flag of the same name)
    disable_custom_all_reduce: bool = False
    # requests add_request lets wait (added, not yet scheduled) before it raises QueueFullError; the
    # server answers 503 + Retry-After past it. None: unbounded. generate() is not bounded: it waits
    # for its own prompts, so a queue bound would only refuse what the caller is about to run.
    max_waiting_requests: int | None = None
    # speculative decoding, in vLLM's shape: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_min": a, "prompt_lookup_max": b} or {"model": DRAFT_PATH, "num_speculative_tokens": k}
    # (engine.spec); None: one token per step
    speculative_config: dict | SpeculativeConfig | None = None
    # "fp8": the decoder's linear layers hold float8_e4m3fn weights with a float32 scale per output row,
    # quantized at load (the LM head and embedding stay in `dtype`; activations too: weight-only), read by
    # the FP8 GEMV / skinny GEMM at decode (custom_ops/fp8.py). A checkpoint already in a supported FP8
    # format (models/quantization.py) loads as FP8 with None too.
    quantization: str | None = None

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        _check(isinstance(self.model, str) and self.model != "", "model", self.model, "a path or model name")
        if self.dtype is not None:
            name = str(self.dtype).removeprefix("torch.")
            _check(name in _DTYPES, "dtype", self.dtype, f"one of {', '.join(_DTYPES)}")
            self.dtype = name
        if self.device is not None:
            try:
                device = torch.device(self.device)
            except (RuntimeError, TypeError):
                raise ConfigError(f"EngineConfig.device={self.device!r} is not a torch device") from None
            _check(device.type in ("cuda", "cpu"), "device", self.device, "'cuda', 'cuda:N' or 'cpu'")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            _check_int(name, getattr(self, name), 1)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 1)
        if self.num_gpu_blocks is not None:
            _check_int("num_gpu_blocks", self.num_gpu_blocks, 2, "an int >= 2 (block 0 is the scratch block)")
        _check(isinstance(self.kv_memory_fraction, (int, float)) and 0 < self.kv_memory_fraction <= 1,
               "kv_memory_fraction", self.kv_memory_fraction, "a number in (0, 1]")
        _check(self.gpu_memory_utilization is None or (isinstance(self.gpu_memory_utilization, (int, float))
                                                       and not isinstance(self.gpu_memory_utilization, bool)
                                                       and 0 < self.gpu_memory_utilization <= 1),
               "gpu_memory_utilization", self.gpu_memory_utilization, "None or a number in (0, 1]")
        _check(self.piece_compiler in _PIECE_COMPILERS, "piece_compiler", self.piece_compiler,
               f"one of {', '.join(_PIECE_COMPILERS)}")
        _check_int("seed", self.seed, 0)
        _check(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching", self.enable_prefix_caching,
               "a bool")
        _check(isinstance(self.async_scheduling, bool), "async_scheduling", self.async_scheduling, "a bool")
        _check(self.frontend_process is None or isinstance(self.frontend_process, bool), "frontend_process",
               self.frontend_process, "a bool or None")
        _check(isinstance(self.hybrid_kv_cache, bool), "hybrid_kv_cache", self.hybrid_kv_cache, "a bool")
        _check(isinstance(self.decode_gemv, bool), "decode_gemv", self.decode_gemv, "a bool")
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        _check(isinstance(self.disable_custom_all_reduce, bool), "disable_custom_all_reduce",
               self.disable_custom_all_reduce, "a bool")
        try:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        except SpeculativeConfigError as exc:
            raise ConfigError(f"EngineConfig.{exc}") from None
        spec = self.speculative_config
        if spec is not None and spec.draft_model and not isinstance(spec.model, str) and self.tensor_parallel_size > 1:
            raise ConfigError("EngineConfig.speculative_config['model']: under tensor_parallel_size > 1 give the "
                              "draft model's path, not a built model (the draft runs on rank 0, loaded by the engine)")
        _check(self.quantization is None or self.quantization in QUANTIZATIONS, "quantization", self.quantization,
               f"None or one of {', '.join(QUANTIZATIONS)}")
        if self.max_waiting_requests is not None:
            _check_int("max_waiting_requests", self.max_waiting_requests, 1, "None (unbounded) or an int >= 1")
        for name in ("decode_graph_sizes", "prefill_graph_sizes"):
            sizes = getattr(self, name)
            if sizes is None:
                continue
            sizes = tuple(sizes)
            _check(len(sizes) > 0 and all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes),
                   name, sizes, "a non-empty list of ints >= 1")
            setattr(self, name, tuple(sorted(set(sizes))))
        if self.decode_graph_sizes is not None:
            _check(max(self.decode_graph_sizes) <= self.max_num_seqs, "decode_graph_sizes",
                   self.decode_graph_sizes, f"sizes <= max_num_seqs ({self.max_num_seqs})")
        if self.prefill_graph_sizes is not None:
            _check(max(self.prefill_graph_sizes) <= self.max_num_batched_tokens, "prefill_graph_sizes",
                   self.prefill_graph_sizes, f"sizes <= max_num_batched_tokens ({self.max_num_batched_tokens})")
        _check(self.prefill_graphs is None or isinstance(self.prefill_graphs, bool), "prefill_graphs",
               self.prefill_graphs, "None (on for CUDA with compile) or a bool")
        if self.cudagraph_mode is not None:
            mode = self.cudagraph_mode.upper() if isinstance(self.cudagraph_mode, str) else self.cudagraph_mode
            _check(isinstance(mode, str) and mode in CUDAGRAPH_MODES, "cudagraph_mode", self.cudagraph_mode,
                   f"None or one of {', '.join(CUDAGRAPH_MODES)}")
            self.cudagraph_mode = mode
            decode, piecewise, _ = CUDAGRAPH_MODES[mode]
            for name, wanted in (("cuda_graphs", decode), ("prefill_graphs", piecewise)):
                given = getattr(self, name)
                if given is not None and given != wanted:
                    raise ConfigError(
                        f"EngineConfig.cudagraph_mode={mode!r} and {name}={given!r} disagree: {mode} means "
                        f"{name}={wanted}; give only cudagraph_mode (or matching values)")
        _check(self.cuda_graphs is None or isinstance(self.cuda_graphs, bool), "cuda_graphs",
               self.cuda_graphs, "None (on for CUDA) or a bool")
        if self.prefill_graphs and self.compile is False:
            raise ConfigError("EngineConfig.prefill_graphs=True needs compile=True (piecewise graphs are "
                              "captured by the infer_graphs torch.compile backend)")
        if self.cudagraph_mode == "PIECEWISE" and self.compile is False:
            raise ConfigError("EngineConfig.cudagraph_mode='PIECEWISE' needs compile=True (piecewise graphs are "
                              "captured by the infer_graphs torch.compile backend)")

    @property
    def mixed_graphs(self) -> bool:
        """Whether steps that are not uniform decodes replay full graphs (cudagraph_mode FULL)."""
        return self.cudagraph_mode is not None and CUDAGRAPH_MODES[self.cudagraph_mode][2]

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative_config.num_speculative_tokens if self.speculative_config else 0

    @property
    def max_seq_rows(self) -> int:
        """Sequence rows a step's buffers hold: every running request's, and at least one request's verify
        step of 1 + k tokens as rows of their own (a verify graph, engine.worker.graphs_and_pool), so a
        small max_num_seqs (1 for one user at a time) still verifies under a graph of decode rows."""
        k = self.num_speculative_tokens
        return max(self.max_num_seqs, 1 + k) if k else self.max_num_seqs

    @property
    def max_logits_rows(self) -> int:
        """Rows a step computes logits for at most: a sequence verifying k proposals has 1 + k."""
        return self.max_num_seqs * (1 + self.num_speculative_tokens)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype is None:
            raise ConfigError("EngineConfig.dtype is unresolved: call resolve() first")
        return _DTYPES[self.dtype]

    def device_and_dtype(self) -> tuple[str, str]:
        """The device and dtype names this config runs with (what the model is loaded with)."""
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        on_cuda = torch.device(device).type == "cuda"
        if on_cuda and not torch.cuda.is_available():
            raise ConfigError(f"EngineConfig.device={device!r} but CUDA is not available; use device='cpu'")
        return device, self.dtype or ("bfloat16" if on_cuda else "float32")

    def wants_frontend_process(self) -> bool:
        """frontend_process, resolved for the device (the engine starts the process before resolve)."""
        if self.frontend_process is not None:
            return self.frontend_process
        return torch.device(self.device_and_dtype()[0]).type == "cuda"

    def wants_compile(self) -> bool:
        """compile, resolved for the device (the engine starts importing the compile stack before resolve)."""
        if self.compile is not None:
            return self.compile
        return torch.device(self.device_and_dtype()[0]).type == "cuda"

    def resolve(self, model_max_len: int | None = None) -> EngineConfig:
        """A copy with every automatic value made concrete for the device (and the model's length limit)."""
        device, dtype = self.device_and_dtype()
        on_cuda = torch.device(device).type == "cuda"
        changes: dict[str, Any] = {"device": device, "dtype": dtype, "frontend_process": self.wants_frontend_process()}
        changes["compile"] = self.wants_compile()
        mode = self.cudagraph_mode
        if mode is not None:
            cuda_graphs, prefill_graphs, _ = CUDAGRAPH_MODES[mode]
        else:
            cuda_graphs, prefill_graphs = self.cuda_graphs, self.prefill_graphs
            if prefill_graphs is None:  # the configuration the benchmarks measure, where it can run
                prefill_graphs = on_cuda and changes["compile"]
            if cuda_graphs is None:
                cuda_graphs = on_cuda
        if not on_cuda and (cuda_graphs or prefill_graphs):
            asked = (f"cudagraph_mode={mode!r}" if mode is not None else " and ".join(
                f"{n}=True" for n, on in (("cuda_graphs", cuda_graphs), ("prefill_graphs", prefill_graphs)) if on))
            logger.warning("EngineConfig: device %r has no CUDA graphs; %s ignored (the model runs "
                           "without graphs)", device, asked)
            cuda_graphs, prefill_graphs, mode = False, False, "NONE"
        changes["cuda_graphs"] = cuda_graphs
        changes["prefill_graphs"] = prefill_graphs
        changes["cudagraph_mode"] = mode or cudagraph_mode_of(cuda_graphs, prefill_graphs)
        max_len = self.max_model_len
        if max_len is None:
            max_len = min(model_max_len or 4096, 4096)
        elif model_max_len is not None and max_len > model_max_len:
            raise ConfigError(f"EngineConfig.max_model_len={max_len} exceeds the model's "
                              f"max_position_embeddings ({model_max_len})")
        changes["max_model_len"] = max_len
        # A decode batch spends one token of the step budget per sequence, so no batch exceeds it.
        changes["decode_graph_sizes"] = self.decode_graph_sizes or default_decode_graph_sizes(
            min(self.max_num_seqs, self.max_num_batched_tokens))
        changes["prefill_graph_sizes"] = (self.prefill_graph_sizes
                                          or default_capture_sizes(self.max_num_batched_tokens))
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise ConfigError(f"unknown EngineConfig field(s) {unknown}; known: {sorted(fields)}")
        return cls(model=model, **kwargs)


def _check(ok: bool, field: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"EngineConfig.{field}={value!r} is invalid: expected {allowed}")


def _check_int(field: str, value: Any, minimum: int, allowed: str | None = None) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool) and value >= minimum, field, value,
           allowed or f"an int >= {minimum}")
