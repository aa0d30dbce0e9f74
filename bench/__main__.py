"""`python -m bench SUITE --model NAME_OR_DIR [--out DIR]`: run one benchmark suite, write JSON + Markdown.

`python -m bench tokenizer [--out DIR] [--source PATH]` writes the tokenizer directory that e2e, host and
serving run with (bench/tokenizer.py; default bench/.tokenizer).

`python -m bench soak --url URL | --model M [--duration S] [--clients N] [--seed K] [--out FILE.json]`: a
seeded traffic mix, then overload, against the server; JSON out, exit status 1 if anything was lost (bench/soak.py)."""
from __future__ import annotations

import argparse
import datetime
import importlib
import logging
import os
import sys

SUITES = ("floor", "decode", "prefill", "capture", "serving", "e2e", "prefix", "tp", "capacity", "kernels",
          "gemm", "knockout", "gemv_graph", "host", "tokenizer", "soak", "spec",
          "spec_acceptance")


def gpu_tag(device_name: str) -> str:
    """The model in a device name: its first word with a digit ("NVIDIA H100 80GB HBM3" -> "h100";
    the last word would be the memory type, "hbm3")."""
    words = device_name.split()
    tag = next((w for w in words if any(c.isdigit() for c in w)), words[-1] if words else "gpu")
    return "".join(c for c in tag.lower() if c.isalnum() or c == "-")


def default_out_dir() -> str:
    import torch
    gpu = gpu_tag(torch.cuda.get_device_name()) if torch.cuda.is_available() else "cpu"
    return os.path.join("bench", "results", f"{gpu}-{datetime.date.today().isoformat()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("suite", choices=SUITES)
    parser.add_argument("--model", default="llama-3.2-3b",
                        help="llama-3.2-3b, qwen3-4b, gemma-3-1b (real configs, random weights) or a model dir")
    parser.add_argument("--out", default=None, help="output directory (default bench/results/<gpu>-<date>; "
                        "tokenizer: where to write it, default bench/.tokenizer)")
    parser.add_argument("--tokenizer", help="e2e, host, serving: the tokenizer directory the engine holds (default "
                        "bench/.tokenizer, written by `python -m bench tokenizer`), or 'none' for no tokenizer")
    parser.add_argument("--variants", help="e2e, host: front-end variants, comma-separated, of plain (no tokenizer), "
                        "tokenizer, stop (tokenizer + 2 stop strings) (default all three); spec: of ngram, rejected, "
                        "ceiling, draft, draft_small (default all; none always runs)")
    parser.add_argument("--frontends", help="host: where the engine detokenizes, comma-separated, of process "
                        "(EngineConfig.frontend_process=True) and inline (default both on CUDA, inline on the CPU)")
    parser.add_argument("--draft-layers", type=int, help="spec: layers of the draft_small rows' draft (default a "
                        "quarter of the target's)")
    parser.add_argument("--source", help="tokenizer: a tokenizer directory or .gguf file to read (default the "
                        "default model's GGUF)")
    parser.add_argument("--batches", help="decode: batch sizes, comma-separated (default 1,8,32,64,128); "
                        "e2e: default 1,16,64; host: 64 (CPU: 4); kernels, gemm: 1,8; gemv_graph: the decode graph's rows "
                        "(one value, default 1; 2-64 sweeps that row bucket's table)")
    parser.add_argument("--contexts", help="decode: context lengths (default 512,4096); capacity: 4096,32768; "
                        "kernels: one context (default 512); knockout, gemv_graph: one context (default 576)")
    parser.add_argument("--ks", help="spec: numbers of speculative tokens, comma-separated (default 2,4); "
                        "spec_acceptance: default 2,4,6")
    parser.add_argument("--device", help="spec_acceptance: cpu (default: float32, step counts) or cuda (bf16, "
                        "and timed batch-1 rows without and with speculation)")
    parser.add_argument("--lookups", help="spec_acceptance: prompt_lookup_min-max pairs, comma-separated "
                        "(default 1-3,2-4)")
    parser.add_argument("--tokens", help="prefill: prompt lengths (default 16..2048; tp: 512)")
    parser.add_argument("--peers", choices=("all", "eager", "none"),
                        help="decode/prefill: which peers to run; e2e: all (transformers static + compile) or none")
    parser.add_argument("--prompt-len", type=int, help="e2e, host: prompt tokens per request (default 512)")
    parser.add_argument("--output-len", type=int, help="e2e, host: generated tokens per request (default 128); "
                        "spec_acceptance: per copy-heavy request (default 96)")
    parser.add_argument("--free-output-len", type=int, help="spec_acceptance: per free-generation request "
                        "(default 64)")
    parser.add_argument("--peer-batches", help="e2e: batch sizes with the transformers static + compile peer "
                        "(default 1; each is one compile)")
    parser.add_argument("--requests", type=int, help="serving, prefix: number of requests")
    parser.add_argument("--rate", type=float, help="serving, prefix: arrival rate, requests/s")
    parser.add_argument("--workloads", help="serving: comma-separated, batch_N too (N requests at once, each "
                        "with an in-process row) (default baseline,continuous_batching,"
                                            "chunked_prefill,prefix_caching)")
    parser.add_argument("--configs", help="serving: comma-separated, of off, decode, prefill (default all three: "
                                          "graphs off, decode graphs, decode + prefill graphs)")
    parser.add_argument("--servers", help="serving: process (default, as serve: the engine in a process of its "
                        "own), thread (serve --no-engine-process: the engine loop a thread of the server) or "
                        "thread,process")
    parser.add_argument("--url", help="serving: a running server to send the workloads to (default: start one "
                                      "per configuration); soak: the server to soak (default: start one for --model)")
    parser.add_argument("--duration", type=float, help="soak: seconds of traffic, 2/3 steady and 1/3 overload "
                        "(default 600)")
    parser.add_argument("--clients", type=int, help="soak: concurrent clients in the steady phase (default 48)")
    parser.add_argument("--seed", type=int, help="soak: the traffic mix's seed (default 0)")
    parser.add_argument("--max-waiting-requests", type=int, help="soak: the server it starts refuses past this "
                        "many waiting requests (default --clients)")
    parser.add_argument("--server-args", help="soak: more flags for the server it starts, e.g. \"--device cpu\"")
    parser.add_argument("--api-key", help="soak: the server's API key (default $INFER_GRAPHS_API_KEY)")
    parser.add_argument("--decode-gemv", action="store_true", default=None,
                        help="decode: full_graph rows from an engine with EngineConfig.decode_gemv=False (cuBLAS only), "
                             "and full_graph_gemv rows from one with it on (the default)")
    parser.add_argument("--quantization", choices=("fp8",),
                        help="decode, e2e, prefill: rows from engines over the same model with FP8 weights "
                             "(EngineConfig.quantization), next to the model dtype's, with the FP8 floor")
    parser.add_argument("--tp-size", type=int, help="gemm: time the matmul shapes of one rank of N-way tensor "
                        "parallelism; gemv_graph: sweep the GEMV tiles in one rank's decode graph, on one GPU "
                        "(default 1)")
    parser.add_argument("--tp-sizes", help="tp: tensor-parallel sizes to compare, comma-separated (default 1,2); "
                        "sizes past the visible GPUs are skipped and noted")
    parser.add_argument("--all-reduce", choices=("custom", "nccl", "both"),
                        help="tp: the engines' all-reduce: symmetric memory below the crossover (custom, the "
                             "default), NCCL only (disable_custom_all_reduce), or each in turn (both)")
    parser.add_argument("--candidates", choices=("tiles", "neighbours", "whole_k"), dest="candidate_set",
                        help="gemv_graph: try tile shapes (default), each entry's tile with other stages and "
                             "warps, or tiles spanning all of K")
    parser.add_argument("--time-budget", type=float, dest="time_budget_s",
                        help="decode, e2e: seconds after which peers are skipped; gemv_graph: after which "
                             "candidates are skipped (noted in the report)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.suite == "tokenizer":
        from bench.tokenizer import main as write_tokenizer
        return write_tokenizer(args.out, args.source)
    from bench.frontend import TokenizerMissing
    if args.suite == "soak":
        from bench.soak import main as soak
        args.out = args.out or default_out_dir()
        try:
            return soak(args)
        except TokenizerMissing as exc:
            print(f"python -m bench soak: {exc}", file=sys.stderr)
            return 2
    suite = importlib.import_module(f"bench.{args.suite}")
    options = {k: v for k, v in vars(args).items() if k not in ("suite", "model", "out", "source") and v is not None}
    try:
        report = suite.run(args.model, **options)
    except TokenizerMissing as exc:
        print(f"python -m bench {args.suite}: {exc}", file=sys.stderr)
        return 2
    paths = report.write(args.out or default_out_dir())
    print(report.markdown())
    print("wrote", *paths, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
