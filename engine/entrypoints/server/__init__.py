"""`python -m engine serve`: an OpenAI-compatible HTTP server over one LLM.

Start-up order: build the engine (load, compile, capture every graph), bind the socket, start the
engine loop thread, log "ready" with the URL, then let uvicorn accept. Connections made before
uvicorn accepts wait in the socket's backlog, so "ready" is true when it is logged and /health
answers 200 from then on. SIGINT / SIGTERM: the engine loop refuses new requests and aborts the
running ones (their clients get an error object, their blocks go back), then uvicorn stops.
"""
from __future__ import annotations

import argparse
import logging
import socket
from typing import Any

from engine.config import ConfigError

logger = logging.getLogger("engine.server")


def serve(args: argparse.Namespace, config_fields: dict[str, Any]) -> int:
    """`python -m engine serve`: build the engine from the command line, then serve it."""
    from engine.core.llm import LLM

    return serve_llm(LLM(args.model, **config_fields), args.served_model_name or args.model, args.host, args.port,
                     api_key=args.api_key, max_request_bytes=args.max_request_bytes)


def serve_llm(llm: Any, name: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
              max_request_bytes: int = 1 << 20) -> int:
    """Serve a built LLM until SIGINT / SIGTERM (the benchmarks serve models built from a config)."""
    import uvicorn

    from engine.entrypoints.server.app import build_app
    from engine.entrypoints.server.engine_loop import EngineLoop

    if llm.tokenizer is None:
        logger.warning("model %s has no tokenizer: prompts must be token ids, texts are empty, no chat", name)
    sock = _listen(host, port)
    engine = EngineLoop(llm)
    app = build_app(engine, name, api_key=api_key, max_request_bytes=max_request_bytes)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            engine.shutdown()
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5))
    stats = llm.stats()  # before the loop starts: from then on only its thread calls the engine
    engine.start()
    host, port = sock.getsockname()[:2]
    logger.info("ready: serving %r at http://%s:%d/v1 (%s, %s; %d decode graphs, prefill graphs %s%s)",
                name, host if ":" not in host else f"[{host}]", port, llm.config.device, llm.config.dtype,
                stats["decode_graphs"], "on" if llm.config.prefill_graphs else "off",
                ", API key required" if api_key else "")
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled, after its shutdown
        pass
    finally:
        app.state.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        engine.stop()
        if engine.is_alive():  # a step still running (a stuck collective): closing would free its memory
            logger.error("the engine loop did not stop in time; exiting without closing the engine")
        else:
            llm.close()
    logger.info("server stopped")
    return 0


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
