"""`python -m engine serve`: an OpenAI-compatible HTTP server over one LLM.

Start-up order: build the engine (load, compile, capture every graph), bind the socket, start the
engine loop thread, log "ready" with the URL, then let uvicorn accept. Connections made before
uvicorn accepts wait in the socket's backlog, so "ready" is true when it is logged and /health
answers 200 from then on. With the engine in a process of its own the socket is bound first, and the
server loads what it needs of its own (its tokenizer, uvicorn, the app's modules) while that process
starts: after it is ready only the app is built. SIGINT / SIGTERM drain the server
(engine.entrypoints.server.shutdown): new requests get 503, those in flight finish within
--shutdown-timeout or are aborted, then the engine is closed and "server stopped" logged; a second
signal stops at once.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import functools
import importlib
import logging
import os
import socket
from typing import Any

from engine.config import ConfigError

logger = logging.getLogger("engine.server")

KEEP_ALIVE_S = 30  # an idle connection's life (uvicorn's timeout_keep_alive; its default is 5)


def serve(args: argparse.Namespace, config_fields: dict[str, Any]) -> int:
    """`python -m engine serve`: build the engine from the command line, then serve it."""
    # what the command line gets wrong is refused before the engine spends its start-up on it
    chat_template = None if args.chat_template is None else load_chat_template(args.chat_template)
    _check_shutdown_timeout(args.shutdown_timeout)
    options = dict(api_key=args.api_key, max_request_bytes=args.max_request_bytes, chat_template=chat_template,
                   shutdown_timeout_s=args.shutdown_timeout)
    name = args.served_model_name or args.model
    if args.engine_process:
        return serve_engine_process(functools.partial(build_llm, args.model, config_fields), name, args.host,
                                    args.port, tokenizer_source=tokenizer_source(args.model, config_fields),
                                    **options)
    return serve_llm(build_llm(args.model, config_fields), name, args.host, args.port, **options)


def tokenizer_source(model: Any, config_fields: dict[str, Any]) -> tuple[str, bool] | None:
    """(name, required) of the tokenizer LLM(model, **config_fields) loads, where the server can load the
    same itself: EngineConfig.tokenizer, or a model directory's own. None for what the engine resolves
    first ("default", a .gguf file or a hub id: converted or downloaded once, by the engine)."""
    if isinstance(config_fields.get("tokenizer"), str):
        return config_fields["tokenizer"], True
    if isinstance(model, str) and os.path.isdir(model):
        return model, False
    return None


def build_llm(model: Any, config_fields: dict[str, Any]) -> Any:
    """LLM(model, **config_fields): what either server serves (module-level: the engine process builds it)."""
    from engine.core.llm import LLM
    return LLM(model, **config_fields)


def serve_llm(llm: Any, name: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
              max_request_bytes: int = 1 << 20, chat_template: str | None = None,
              shutdown_timeout_s: float = 30.0) -> int:
    """Serve a built LLM until SIGINT / SIGTERM (the benchmarks serve models built from a config).
    Returns the exit status: 0 after a drain, 1 if a second signal cut it short, the engine failed
    for good (a tensor-parallel rank died) or the engine loop did not stop. `chat_template`: a Jinja
    string (load_chat_template) replacing the tokenizer's."""
    from engine.entrypoints.server.engine_loop import EngineLoop

    _check_shutdown_timeout(shutdown_timeout_s)
    _check_chat_template(llm, name, chat_template)
    sock = _listen(host, port)
    engine = EngineLoop(llm)
    stats = llm.stats()  # before the loop starts: from then on only its thread calls the engine

    def close() -> int:
        engine.stop()
        if engine.is_alive():  # a step still running (a stuck collective): closing would free its memory
            logger.error("the engine loop did not stop in time; exiting without closing the engine")
            return 1
        llm.close()
        return 0
    # the tokenizer thread needs a copy only where the step thread decodes with the tokenizer too
    return _serve(engine, llm, stats["decode_graphs"], sock, name, close, api_key, max_request_bytes, chat_template,
                  shutdown_timeout_s, "", copy_tokenizer=llm.decodes_on_step_thread)


def serve_engine_process(build: Any, name: str, host: str = "127.0.0.1", port: int = 8000,
                         api_key: str | None = None, max_request_bytes: int = 1 << 20, chat_template: str | None = None,
                         shutdown_timeout_s: float = 30.0, tokenizer_source: tuple[str, bool] | None = None) -> int:
    """serve_llm with the engine built by `build()` in a process of its own (engine_process.py): the
    HTTP side and the step loop do not share a GIL. Same start-up order, drain and exit statuses.
    tokenizer_source: see EngineProcess."""
    from engine.entrypoints.server.engine_process import EngineProcess

    _check_shutdown_timeout(shutdown_timeout_s)
    sock = _listen(host, port)  # before the start-up: a port in use fails at once
    try:
        engine = EngineProcess(build, tokenizer_source=tokenizer_source, meanwhile=_import_http_side)
    except BaseException:
        sock.close()
        raise
    try:
        _check_chat_template(engine.llm, name, chat_template)
    except BaseException:
        sock.close()
        engine.stop()
        raise

    def close() -> int:
        engine.stop()
        return 0 if engine.failure is None else 1
    try:
        return _serve(engine, engine.llm, engine.snapshot.get("decode_graphs", 0), sock, name, close, api_key,
                      max_request_bytes, chat_template, shutdown_timeout_s, ", the engine in a process of its own",
                      copy_tokenizer=False)
    finally:
        engine.stop()  # whatever ended the server: the engine process must not outlive it


def _import_http_side() -> None:
    """What _serve imports (uvicorn, FastAPI, the app), imported while the engine process starts rather
    than after it is ready."""
    for module in ("uvicorn", "engine.entrypoints.server.app", "engine.entrypoints.server.shutdown"):
        importlib.import_module(module)


def _check_chat_template(llm: Any, name: str, chat_template: str | None) -> None:
    if llm.tokenizer is None:
        if chat_template is not None:
            raise ConfigError(f"--chat-template: model {name} has no tokenizer to render a chat template with")
        logger.warning("model %s has no tokenizer: prompts must be token ids, texts are empty, no chat", name)


def _serve(engine: Any, llm: Any, num_decode_graphs: int, sock: socket.socket, name: str, close: Any,
           api_key: str | None, max_request_bytes: int, chat_template: str | None, shutdown_timeout_s: float,
           where: str, copy_tokenizer: bool = True) -> int:
    """The HTTP server over `engine` (EngineLoop or EngineProcess) until it stops; `close()` stops the
    engine and returns its part of the exit status. `copy_tokenizer`: build_app's."""
    import uvicorn

    from engine.entrypoints.server.app import build_app
    from engine.entrypoints.server.shutdown import DrainingServer

    tokenize_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
    app = build_app(engine, name, tokenize_pool, api_key=api_key, max_request_bytes=max_request_bytes,
                    chat_template=chat_template, copy_tokenizer=copy_tokenizer)
    # no lifespan: the app has no start-up or shutdown hooks, and a forced exit (which skips the
    # lifespan's shutdown) would leave its task to be cancelled with a traceback
    # keep-alive outlasts the clients' own (httpx and the openai client: 5 s, aiohttp: 15 s), so the
    # client closes an idle connection first: at uvicorn's 5 s both could, and a request sent on a
    # connection the server just closed is lost (a ReadError in the first H100 soak)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5, lifespan="off",
                            timeout_keep_alive=KEEP_ALIVE_S)
    server = DrainingServer(config, engine, app, shutdown_timeout_s)
    status = 0
    with server.signals_handled():
        engine.start()
        host, port = sock.getsockname()[:2]
        logger.info("ready: serving %r at http://%s:%d/v1 (%s, %s; %d decode graphs, prefill graphs %s%s%s%s)",
                    name, host if ":" not in host else f"[{host}]", port, llm.config.device, llm.config.dtype,
                    num_decode_graphs, "on" if llm.config.prefill_graphs else "off",
                    "" if engine.max_waiting is None else f", at most {engine.max_waiting} waiting",
                    ", API key required" if api_key else "", where)
        try:
            server.run(sockets=[sock])
        finally:
            server.cleaning_up = True
            if server.forced:
                logger.warning("second signal: stopped without draining (in-flight requests aborted)")
                status = 1
            if server.failed:
                status = 1
            tokenize_pool.shutdown(wait=False, cancel_futures=True)
            status = max(status, close())
    logger.info("server stopped")
    return status


def load_chat_template(value: str) -> str:
    """--chat-template: a file's contents, or the value itself if it is a Jinja template (as vLLM reads
    it); ConfigError if it is neither or does not parse."""
    import jinja2

    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            template = f.read()
    elif "{{" in value or "{%" in value:
        template = value
    else:
        raise ConfigError(f"--chat-template {value!r} is neither a file nor a Jinja template (no '{{{{' or '{{%')")
    try:  # the extension transformers renders templates with
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"--chat-template does not parse as Jinja: line {exc.lineno}: {exc.message}") from None
    return template


def _check_shutdown_timeout(seconds: float) -> None:
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not seconds >= 0:
        raise ConfigError(f"--shutdown-timeout={seconds!r} is invalid: expected seconds >= 0")


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
