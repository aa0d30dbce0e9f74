"""Command line: `python -m engine generate --model PATH|default --prompt TEXT [options]`.

Prints the generated text, the throughput and the graph statistics.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate from one or more prompts")
    gen.add_argument("--model", default="default", help="HF-format dir, .gguf file, or 'default' (Gemma 3 270M)")
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                     help="default: bfloat16 on CUDA, float32 on CPU")
    gen.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--max-num-seqs", type=int, default=None)
    gen.add_argument("--max-num-batched-tokens", type=int, default=None)
    gen.add_argument("--num-gpu-blocks", type=int, default=None)
    gen.add_argument("--kv-memory-fraction", type=float, default=None)
    gen.add_argument("--no-cuda-graphs", action="store_true", help="no full-decode graphs")
    gen.add_argument("--prefill-graphs", action="store_true", help="piecewise graphs for prefill / mixed steps")
    gen.add_argument("--decode-graph-sizes", type=_sizes, default=None, help="e.g. 1,2,4,8,16")
    gen.add_argument("--prefill-graph-sizes", type=_sizes, default=None, help="e.g. 16,64,256")
    gen.add_argument("--no-compile", action="store_true", help="eager model (implies no prefill graphs)")
    gen.add_argument("--piece-compiler", choices=("inductor", "eager"), default=None)
    gen.add_argument("--tensor-parallel-size", type=int, default=None,
                     help="ranks (GPUs) to split the model over; spawned, or torchrun's processes")
    gen.add_argument("-v", "--verbose", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from engine import LLM, SamplingParams

    fields = {name: getattr(args, name) for name in (
        "dtype", "device", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks",
        "kv_memory_fraction", "decode_graph_sizes", "prefill_graph_sizes", "piece_compiler",
        "tensor_parallel_size")
        if getattr(args, name) is not None}
    if args.no_cuda_graphs:
        fields["cuda_graphs"] = False
    if args.prefill_graphs:
        fields["prefill_graphs"] = True
    if args.no_compile:
        fields["compile"] = False
    start = time.perf_counter()
    llm = LLM(args.model, **fields)
    print(f"engine ready in {time.perf_counter() - start:.1f} s on {llm.config.device} ({llm.config.dtype})",
          file=sys.stderr)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
    start = time.perf_counter()
    outputs = llm.generate(args.prompt, params)
    seconds = time.perf_counter() - start
    for prompt, out in zip(args.prompt, outputs):
        print(f"{prompt}{out.text}")
        print(f"  [{len(out.token_ids)} tokens, finish: {out.finish_reason}, "
              f"ttft {1000 * (out.ttft_s or 0):.1f} ms]")
    tokens = sum(len(o.token_ids) for o in outputs)
    stats = llm.stats()
    print(f"{tokens} tokens in {seconds:.2f} s: {tokens / seconds:.1f} tokens/s")
    print(f"graphs: {stats['decode_graphs']} decode graphs, {stats['decode_graph_replays']} replays, "
          f"modes {stats['modes']}, fallbacks {stats['fallbacks']}"
          + (f", backend {stats['backend']}" if "backend" in stats else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
