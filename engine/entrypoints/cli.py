"""Command line.

    python -m engine generate --model PATH|default --prompt TEXT [options]   text, throughput, graph stats
    python -m engine serve --model PATH|default [--host 127.0.0.1] [--port 8000] [options]
                                                                             an OpenAI-compatible server

Both take every engine option (engine/entrypoints/cli_args.py). A user's mistake (a model path that does not
exist, an invalid option value, an empty prompt) is one line, `error: ...`, and exit status 2;
`-v` keeps the traceback.
"""
from __future__ import annotations

import logging
import os
import sys
import time

from engine.entrypoints.cli_args import OneLineErrorParser, add_engine_args, engine_config_fields

API_KEY_ENV = "INFER_GRAPHS_API_KEY"


def build_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(prog="python -m engine", description="generate text, or serve the OpenAI API")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate from one or more prompts")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None, dest="sampling_seed", help="per-request sampling seed")
    gen.add_argument("--ignore-eos", action="store_true")
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8000, help="0 picks a free port (the ready line says which)")
    serve.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    serve.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                       help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_ENV})")
    serve.add_argument("--max-request-bytes", type=int, default=1 << 20, help="larger bodies get 413")
    serve.add_argument("--chat-template", default=None, metavar="FILE_OR_JINJA",
                       help="a chat template (a file, or an inline Jinja string) for /v1/chat/completions, "
                            "replacing the tokenizer's own (for models whose tokenizer has none)")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="on SIGTERM / SIGINT: how long requests in flight may run on before they are "
                            "aborted (default 30; a second signal stops at once)")
    return parser


def main(argv: list[str] | None = None) -> int:
    import models
    from engine import ConfigError, InvalidRequestError

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose or args.command == "serve" else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "serve":
            from engine.entrypoints.server import serve  # FastAPI and uvicorn only for this command
            return serve(args, engine_config_fields(args))
        return _generate(args)
    except (ConfigError, InvalidRequestError, models.ModelLoadError) as exc:
        if args.verbose:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _generate(args) -> int:
    from engine import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(args.model, **engine_config_fields(args))
    print(f"engine ready in {time.perf_counter() - start:.1f} s on {llm.config.device} ({llm.config.dtype})",
          file=sys.stderr)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.sampling_seed, ignore_eos=args.ignore_eos)
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
