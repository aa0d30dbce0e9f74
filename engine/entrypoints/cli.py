"""Command line: `infer-graphs` (setup.cfg's console script) or `python -m engine`.

    infer-graphs generate --model PATH|org/name|default --prompt TEXT [options]   text, throughput
    infer-graphs serve --model PATH|org/name|default [--host 127.0.0.1] [--port 8000] [options]
                                                                             an OpenAI-compatible server

Both take every engine option (engine/entrypoints/cli_args.py). A user's mistake (a model that does
not exist, an invalid option value, an empty prompt) is one line, `error: ...` naming the flag, and
exit status 2; `-v` keeps the traceback. What can be checked without the model (option values,
sampling values, empty prompts, the device) is checked before the model loads.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
from pathlib import Path

from engine.entrypoints.cli_args import ENGINE_OPTIONS, OneLineErrorParser, add_engine_args, engine_config_fields

API_KEY_ENV = "INFER_GRAPHS_API_KEY"
# SamplingParams field -> the flag of `generate` that sets it, for errors that name the flag
SAMPLING_FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_k": "--top-k",
                  "top_p": "--top-p", "seed": "--seed", "ignore_eos": "--ignore-eos", "prompt": "--prompt"}


def build_parser(prog: str = "python -m engine") -> OneLineErrorParser:
    parser = OneLineErrorParser(prog=prog, description="generate text, or serve the OpenAI API")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate from one or more prompts")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    gen.add_argument("--max-tokens", type=_max_tokens, default=32, metavar="N|none",
                     help="tokens to generate at most (default 32); none: until EOS or --max-model-len")
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
    serve.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                       help="build and run the engine in a process of its own, so the HTTP server and the "
                            "engine's step loop do not share a GIL (the default; --no-engine-process runs the "
                            "engine loop as a thread of the server: docs/server.md)")
    return parser


def _max_tokens(value: str) -> int | None:
    """--max-tokens: an int (SamplingParams checks its range), or none for SamplingParams.max_tokens=None."""
    if value.lower() == "none":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is neither an int nor none") from None


def main(argv: list[str] | None = None, prog: str = "python -m engine") -> int:
    import models
    from engine import ConfigError, InvalidRequestError

    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose or args.command == "serve" else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        _check_before_loading(args)
        if args.command == "serve":
            from engine.entrypoints.server import serve  # FastAPI and uvicorn only for this command
            return serve(args, engine_config_fields(args))
        return _generate(args)
    except (ConfigError, InvalidRequestError, models.ModelLoadError) as exc:
        if args.verbose:
            raise
        print(f"error: {_in_flags(str(exc))}", file=sys.stderr)
        return 2


def console_main() -> int:
    """The `infer-graphs` console script (setup.cfg)."""
    return main(prog="infer-graphs")


def _check_before_loading(args) -> None:
    """Refuse what is wrong without the model (seconds to minutes of loading otherwise); resolve a
    hub id, so a missing one is refused before anything loads too."""
    import torch

    import models
    from engine import ConfigError, EngineConfig, InvalidRequestError, SamplingParams

    fields = engine_config_fields(args)
    EngineConfig.from_kwargs(args.model, **fields)  # validates every field given
    device = fields.get("device") or ""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: no CUDA device is visible to torch here; use --device cpu")
    if args.revision is not None or models.paths.is_hub_id(args.model):
        if args.command == "serve" and args.served_model_name is None:
            args.served_model_name = args.model  # clients send the id, not the snapshot directory
        args.model = models.resolve_model_path(args.model, args.revision)
    args.tokenizer_object = None
    if args.command == "generate":
        if not all(args.prompt):
            raise InvalidRequestError("--prompt is empty", param="prompt")
        args.params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                     top_p=args.top_p, seed=args.sampling_seed, ignore_eos=args.ignore_eos)
        _refuse_too_long_prompts(args, fields)


# A token covers at least one UTF-8 byte of its text; the tokenizer adds a few of its own (BOS, a
# SentencePiece word-start): a prompt of fewer bytes than the context minus this cannot be too long.
ADDED_TOKENS_BOUND = 8


def _refuse_too_long_prompts(args, fields: dict) -> None:
    """A prompt longer than the context is refused before the weights load. Only a prompt that could be
    that long (by its bytes) costs loading the tokenizer here, and the engine is then given it; a .gguf
    file (converted by the engine) is left to the engine's own check."""
    import models
    from engine import InvalidRequestError
    from engine.core.tokenizer_load import load_tokenizer
    from models.config import ModelConfig

    model_dir = Path(args.model)
    if args.model == models.paths.DEFAULT_MODEL:  # converted on its first use: the engine's next step anyway
        model_dir = Path(models.resolve_model_path(args.model))
    if not (model_dir / "config.json").is_file():
        return
    limit = fields.get("max_model_len")
    if limit is None:  # as EngineConfig.resolve sets it
        limit = min(ModelConfig.from_hf(models.loader.read_config(model_dir)).max_position_embeddings, 4096)
    if all(len(p.encode()) + ADDED_TOKENS_BOUND <= limit for p in args.prompt):
        return
    # the engine's own loader: a model without a tokenizer gives None here (the engine says what that means)
    tokenizer = load_tokenizer(fields.get("tokenizer") or args.model, required=fields.get("tokenizer") is not None)
    if tokenizer is None:
        return
    for prompt in args.prompt:
        num_tokens = len(tokenizer(prompt)["input_ids"])  # as LLM.encode counts it
        if num_tokens > limit:
            raise InvalidRequestError(f"prompt has {num_tokens} tokens, longer than max_model_len ({limit})",
                                      param="prompt")
    args.tokenizer_object = tokenizer  # loaded once: the engine takes it


def _in_flags(message: str) -> str:
    """An engine error in the command line's words: `SamplingParams.max_tokens=0` -> `--max-tokens 0`,
    `EngineConfig.max_num_seqs=0` -> `--max-num-seqs 0`; the internal request id left out."""
    flags = {**SAMPLING_FLAGS, **{field: flag for flag, (field, _) in ENGINE_OPTIONS.items()}}
    message = re.sub(r"^request '[^']*': ", "", message)
    message = re.sub(r"(?<!-)\bprompt (has|is|token)", r"--prompt \1", message).replace(
        "longer than max_model_len", "longer than --max-model-len")
    return re.sub(r"\b(?:SamplingParams|EngineConfig)\.(\w+)=",
                  lambda m: f"{flags[m.group(1)]} " if m.group(1) in flags else m.group(0), message)


def _generate(args) -> int:
    from engine import LLM

    start = time.perf_counter()
    fields = engine_config_fields(args)
    if args.tokenizer_object is not None:
        fields.pop("tokenizer", None)
    llm = LLM(args.model, tokenizer=args.tokenizer_object, **fields)
    print(f"engine ready in {time.perf_counter() - start:.1f} s on {llm.config.device} ({llm.config.dtype})",
          file=sys.stderr)
    start = time.perf_counter()
    outputs = llm.generate(args.prompt, args.params)
    seconds = time.perf_counter() - start
    for prompt, out in zip(args.prompt, outputs):
        print(f"{prompt}{out.text}")
        print(f"  [{len(out.token_ids)} tokens, finish: {out.finish_reason}, "
              f"ttft {1000 * (out.ttft_s or 0):.1f} ms]")
    tokens = sum(len(o.token_ids) for o in outputs)
    stats = llm.stats()
    print(f"{tokens} tokens in {seconds:.2f} s: {tokens / seconds:.1f} tokens/s")
    if llm.config.device.startswith("cuda"):  # on the CPU there are no graphs to count
        print(f"graphs: {stats['decode_graphs']} decode graphs, {stats['decode_graph_replays']} replays, "
              f"modes {stats['modes']}, fallbacks {stats['fallbacks']}"
              + (f", backend {stats['backend']}" if "backend" in stats else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
