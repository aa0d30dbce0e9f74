"""The engine's command-line options, defined once for every command (`generate`, `serve`, the bench).

Each option's `dest` is an EngineConfig field and its default is "not given" (argparse.SUPPRESS),
so `engine_config_fields(args)` passes on exactly what the user typed and EngineConfig keeps its own
defaults and its own validation. Adding an engine option is one line in ENGINE_OPTIONS.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, NoReturn

from engine.config import EngineConfig


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _set(field: str, value: Any, help: str) -> tuple[str, dict[str, Any]]:
    """A switch that sets EngineConfig.`field` to `value`."""
    return field, dict(action="store_const", const=value, help=help)


# flag -> (EngineConfig field, argparse keywords)
ENGINE_OPTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "--tokenizer": ("tokenizer", dict(help="tokenizer name or path (default: the model's own)")),
    "--dtype": ("dtype", dict(choices=("float32", "bfloat16", "float16"),
                              help="default: bfloat16 on CUDA, float32 on CPU")),
    "--device": ("device", dict(help="default: cuda if available, else cpu")),
    "--max-model-len": ("max_model_len", dict(type=int)),
    "--max-num-seqs": ("max_num_seqs", dict(type=int)),
    "--max-num-batched-tokens": ("max_num_batched_tokens", dict(type=int)),
    "--block-size": ("block_size", dict(type=int, help="tokens per KV cache block")),
    "--num-gpu-blocks": ("num_gpu_blocks", dict(type=int)),
    "--kv-memory-fraction": ("kv_memory_fraction", dict(type=float)),
    "--gpu-memory-utilization": ("gpu_memory_utilization", dict(
        type=float, help="vLLM's: the share of the GPU's memory this engine holds in all (weights, graphs, "
                         "KV pool); sizes the KV pool instead of --kv-memory-fraction")),
    "--no-hybrid-kv-cache": _set("hybrid_kv_cache", False, "one KV pool where every layer keeps every block "
                                 "(default: a pool per layer kind, sliding-window blocks freed out of the window)"),
    "--no-cuda-graphs": _set("cuda_graphs", False, "no full-decode graphs"),
    "--prefill-graphs": _set("prefill_graphs", True, "piecewise graphs for prefill / mixed steps (the default "
                             "where CUDA and compile are)"),
    "--no-prefill-graphs": _set("prefill_graphs", False, "no piecewise graphs: prefill / mixed steps run the "
                                "compiled pieces without graphs"),
    "--cudagraph-mode": ("cudagraph_mode", dict(
        choices=("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"), type=str.upper,
        help="which steps replay CUDA graphs (docs/engine.md); default FULL_AND_PIECEWISE on CUDA: decode "
             "graphs, piecewise graphs for prefill / mixed steps. FULL: full graphs for mixed steps too")),
    "--decode-graph-sizes": ("decode_graph_sizes", dict(type=_sizes, help="e.g. 1,2,4,8,16")),
    "--prefill-graph-sizes": ("prefill_graph_sizes", dict(type=_sizes, help="e.g. 16,64,256")),
    "--compile": _set("compile", True, "torch.compile the model with the infer_graphs backend on any device "
                      "(the default on CUDA; on the CPU, eager unless asked)"),
    "--no-compile": _set("compile", False, "eager model (implies no prefill graphs)"),
    "--piece-compiler": ("piece_compiler", dict(choices=("inductor", "eager"))),
    "--enable-prefix-caching": _set("enable_prefix_caching", True, "share the KV blocks of common prompt "
                                    "prefixes (the default)"),
    "--no-prefix-caching": _set("enable_prefix_caching", False, "no prefix caching"),
    "--decode-gemv": _set("decode_gemv", True, "batch-1 decode matmuls on the Triton GEMV where measured faster "
                          "than cuBLAS (custom_ops/gemv_table.py; the default)"),
    "--no-decode-gemv": _set("decode_gemv", False, "every matmul on cuBLAS / Inductor's choice"),
    "--no-async-scheduling": _set("async_scheduling", False, "synchronous step loop: the host reads each "
                                  "step's tokens before scheduling the next (debugging)"),
    "--frontend-process": _set("frontend_process", True, "detokenization and stop strings in a process of their "
                               "own, off the step thread (the default on CUDA)"),
    "--no-frontend-process": _set("frontend_process", False, "detokenization and stop strings on the step "
                                  "thread (the default on the CPU)"),
    "--tensor-parallel-size": ("tensor_parallel_size", dict(
        type=int, help="ranks (GPUs) to split the model over; spawned, or torchrun's processes")),
    "--disable-custom-all-reduce": _set("disable_custom_all_reduce", True, "every tensor-parallel all-reduce on "
                                        "NCCL (default: small ones on symmetric memory where the GPUs allow)"),
    "--max-waiting-requests": ("max_waiting_requests", dict(
        type=int, help="requests allowed to wait for a slot; past it add_request refuses and the server answers "
                       "503 + Retry-After (default: unbounded)")),
    "--speculative-config": ("speculative_config", dict(
        type=_json_object, help='speculative decoding, as vLLM: \'{"method": "ngram", "num_speculative_tokens": 4, '
                                '"prompt_lookup_max": 4}\' (prompt lookup) or \'{"model": DRAFT_PATH, "num_speculative_tokens": 4}\' '
                                '(a draft model with the target\'s vocabulary); docs/engine.md')),
    "--quantization": ("quantization", dict(
        help="fp8: the decoder's linear weights in FP8 (float8_e4m3fn, a scale per output row), quantized at "
             "load; activations, LM head and embedding stay in --dtype. A checkpoint already in FP8 loads as "
             "FP8 without it")),
    "--engine-seed": ("seed", dict(type=int, help="sampling seed of requests that give none of their own")),
    "--no-progress": _set("show_progress", False, "no progress bar during graph capture"),
}


class OneLineErrorParser(argparse.ArgumentParser):
    """A usage mistake is one line, `error: ...`, and exit status 2 (argparse's status)."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default",
                        help="HF-format dir, hub id (org/name), .gguf file, or 'default' (Gemma 3 270M)")
    parser.add_argument("--revision", default=None, help="branch, tag or commit of a hub id (default: main)")
    group = parser.add_argument_group("engine options")
    for flag, (field, kwargs) in ENGINE_OPTIONS.items():
        group.add_argument(flag, dest=field, default=argparse.SUPPRESS, **kwargs)
    parser.add_argument("-v", "--verbose", action="store_true", help="INFO logs, and tracebacks on errors")


def engine_config_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields the user gave on the command line (LLM(model, **fields))."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
            if f.name != "model" and hasattr(args, f.name)}
