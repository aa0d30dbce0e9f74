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
    import uvicorn

    from engine.llm import LLM
    from engine.server.app import build_app
    from engine.server.engine_loop import EngineLoop

    llm = LLM(args.model, **config_fields)
    if llm.tokenizer is None:
        logger.warning("model %s has no tokenizer: prompts must be token ids, texts are empty, no chat", args.model)
    sock = _listen(args.host, args.port)
    engine = EngineLoop(llm)
    name = args.served_model_name or args.model
    app = build_app(engine, name, api_key=args.api_key, max_request_bytes=args.max_request_bytes)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            engine.shutdown()
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5))
    engine.start()
    host, port = sock.getsockname()[:2]
    stats = llm.stats()
    logger.info("ready: serving %r at http://%s:%d/v1 (%s, %s; %d decode graphs, prefill graphs %s%s)",
                name, host if ":" not in host else f"[{host}]", port, llm.config.device, llm.config.dtype,
                stats["decode_graphs"], "on" if llm.config.prefill_graphs else "off",
                ", API key required" if args.api_key else "")
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled, after its shutdown
        pass
    finally:
        engine.stop()
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
