"""The FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Handlers never call the model: they submit to the EngineLoop the n engine requests of a request's
`n` choices (engine.entrypoints.server.choices) and read their outputs as the engine produces them. Every exit
of a handler or of a stream (finished, client gone mid-prefill or mid-stream, server shutting down)
ends in a `finally` that aborts every choice, so their KV blocks go back to the pool whatever
happened; abort is idempotent, so aborting a finished request is free.
Prompts are tokenized (and chat templates rendered) on one tokenizer thread, never on the event loop
that streams every client's tokens nor on the engine loop's thread, whose host time is every running
request's inter-token latency. The same thread turns a request's logprobs into token strings
(engine.entrypoints.server.logprobs). Prompts are never logged.

Refusals that must be fast come first, before the body is tokenized: a server that is shutting down
(503), and a full waiting queue (503 with Retry-After: the engine's max_waiting_requests; the engine
thread's own check is exact but answers a step later). /health and /metrics never wait for a
request nor a step: /health reads flags, /metrics the counters the engine thread last published
(EngineLoop.snapshot).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import functools
import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from engine.core.llm import QueueFullError
from engine.entrypoints.server.choices import Choices
from engine.entrypoints.server.engine_loop import EngineLoop, EngineUnavailable
from engine.entrypoints.server.guard import Guard
from engine.entrypoints.server.logprobs import LogprobsFormatter, TokenText
from engine.entrypoints.server.metrics import ServerMetrics
from engine.entrypoints.server.protocol import ChatRequest, CompletionRequest, ResponseBuilder, error_body, sse
from engine.params import InvalidRequestError

logger = logging.getLogger("engine.server")

# What a client refused for a full queue is told to wait: about the time for requests at the head of
# the queue to be scheduled (a step or a few) and their places freed, without making clients idle long.
RETRY_AFTER_S = 1


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, param, code, type), status_code=status, headers=headers)


# nginx's code for a request whose client closed the connection first: no one reads it, the access log does
CLIENT_CLOSED_REQUEST = 499


def _format_all(formatters: list[LogprobsFormatter], outs: list[Any]) -> list[dict[str, Any]]:
    """Each choice's logprobs object, for all its tokens (on the tokenizer thread)."""
    return [formatter(out.prompt_token_ids, out.logprobs) for formatter, out in zip(formatters, outs)]


def build_app(engine: EngineLoop, model_name: str, tokenize_pool: concurrent.futures.ThreadPoolExecutor,
              api_key: str | None = None, max_request_bytes: int = 1 << 20,
              chat_template: str | None = None, copy_tokenizer: bool = True) -> Guard:
    """The app behind its Guard. `tokenize_pool`: one thread (requests are tokenized in arrival order,
    and the tokenizer is never entered by two encoders at once: a fast tokenizer borrows its Rust
    state per call); its owner shuts it down. `chat_template`: replaces the tokenizer's own (a Jinja
    string, already checked by load_chat_template). `copy_tokenizer=False`: the tokenizer thread takes
    engine.llm.tokenizer itself, for an engine that does not use it (EngineProcess's, or one whose front
    end decodes in a process of its own)."""
    llm = engine.llm
    # The tokenizer thread's own copy where the engine thread detokenizes with llm.tokenizer meanwhile
    # (LLM.encode says why two threads must not share one). Copying a large vocabulary's tokenizer takes
    # seconds of start-up, which an engine whose decoding runs in another process is spared.
    tokenizer = copy.deepcopy(llm.tokenizer) if copy_tokenizer else llm.tokenizer
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    encode = functools.partial(llm.encode, tokenizer=tokenizer)
    token_text = TokenText(tokenizer)  # tokenizer thread only
    max_model_len = llm.config.max_model_len
    metrics = ServerMetrics(llm.config.device, engine.max_waiting)
    app = FastAPI(title="infer_graphs", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = metrics  # the server's tick observes the event loop's lag into it (shutdown.py)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), code=str(exc.status_code))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.error("%s %s failed: %r", request.method, request.url.path, exc)
        return _error(500, f"internal error: {type(exc).__name__}", type="server_error")

    @app.get("/health")
    async def health() -> Response:
        if engine.healthy:
            return JSONResponse({"status": "ok"})
        if not engine.accepting:
            return _error(503, "the server is shutting down", code="server_shutting_down", type="server_error")
        return _error(503, "the engine is not running", type="server_error")

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        # the engine thread's latest snapshot: a scrape never waits for the step in progress
        stats = {**engine.snapshot, "requests_waiting": engine.num_waiting,  # published after every step
                 "requests_admitting": engine.num_admitting}  # submitted, not yet added by the engine thread
        return Response(metrics.render(stats), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "infer_graphs",
             "max_model_len": max_model_len}]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _serve(request, chat=True)

    def _chat_prompt(req: ChatRequest) -> list[int] | JSONResponse:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            return _error(400, f"model {model_name!r} has no tokenizer chat template: use /v1/completions",
                          "messages")
        if not req.messages:
            return _error(400, "messages is empty", "messages")
        try:
            text = tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in req.messages],
                                                 tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # the template refuses this conversation (roles, order)
            return _error(400, f"messages cannot be rendered by the chat template: {exc}", "messages")
        return tokenizer(text, add_special_tokens=False)["input_ids"]  # the template wrote the special tokens

    def _shutting_down() -> JSONResponse:
        metrics.rejected("shutting_down")
        return _error(503, "the server is shutting down", code="server_shutting_down", type="server_error")

    def _queue_full(message: str) -> JSONResponse:
        metrics.rejected("queue_full")
        return _error(503, message, code="server_overloaded", type="server_error",
                      headers={"Retry-After": str(RETRY_AFTER_S)})

    async def _serve(request: Request, chat: bool) -> Response:
        if not engine.accepting:
            return _shutting_down()
        if engine.queue_full():
            return _queue_full(f"the server is overloaded: {engine.max_waiting} requests are waiting "
                               f"(--max-waiting-requests); retry after {RETRY_AFTER_S} s")
        try:
            body = await request.body()
        except ClientDisconnect:  # gone before its body arrived (a client's timeout under load): nothing started
            metrics.left_early()
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        try:
            req = (ChatRequest if chat else CompletionRequest).model_validate_json(body)
        except ValidationError as exc:
            err = exc.errors()[0]
            param = ".".join(str(p) for p in err["loc"]) or None
            return _error(400, f"invalid request body: {param or 'body'}: {err['msg']}", param)
        if req.model != model_name:  # 404, as OpenAI and vLLM answer it (the client's NotFoundError)
            return _error(404, f"model {req.model!r} does not exist here; this server serves {model_name!r}",
                          "model", "model_not_found")
        unsupported = req.unsupported()
        if unsupported:
            return _error(400, unsupported[1], unsupported[0])
        loop = asyncio.get_running_loop()
        if chat:
            prompt = await loop.run_in_executor(tokenize_pool, _chat_prompt, req)
            if isinstance(prompt, JSONResponse):
                return prompt
        else:
            prompt = req.prompt
            if isinstance(prompt, str) and prompt and tokenizer is not None:  # the engine would encode it alike
                prompt = await loop.run_in_executor(tokenize_pool, encode, prompt)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            params = req.sampling_params()  # SamplingParams validate when made
        except InvalidRequestError as exc:
            return _refused(exc, req)
        choices = Choices(engine, prompt, params, request_id, req.n, every_step=bool(req.stream))
        watcher = asyncio.create_task(_abort_on_disconnect(request, choices))
        try:
            await choices.accepted()
        except (InvalidRequestError, EngineUnavailable, QueueFullError) as exc:
            watcher.cancel()
            return _refused(exc, req)
        logger.debug("request %s accepted (n=%d)", request_id, req.n)
        builder = ResponseBuilder(request_id, model_name, chat, req.return_token_ids)
        # one per choice: a formatter carries its choice's text offsets from one chunk to the next
        formatters = None if req.num_logprobs is None else [LogprobsFormatter(token_text, chat) for _ in range(req.n)]
        if req.stream:
            return StreamingResponse(_stream(choices, builder, req, watcher, formatters),
                                     media_type="text/event-stream")
        try:
            finals: list[Any] = [None] * req.n
            counted = [0] * req.n  # tokens metrics has seen, per choice
            async for index, out in choices:
                counted[index] = metrics.observe(out, counted[index], ttft=index == 0)
                finals[index] = out
            _finished(finals)
            logprobs = [None] * req.n if formatters is None else await loop.run_in_executor(
                tokenize_pool, _format_all, formatters, finals)
            return JSONResponse(builder.final(finals, logprobs))
        except (InvalidRequestError, EngineUnavailable) as exc:
            return _refused(exc, req)
        finally:
            watcher.cancel()
            choices.abort()

    async def _stream(choices: Choices, builder: ResponseBuilder, req: Any, watcher: asyncio.Task,
                      formatters: list[LogprobsFormatter] | None):
        loop = asyncio.get_running_loop()
        try:
            # per choice: chunks sent (a choice's first chunk carries the chat role), tokens, final output
            num_chunks, num_tokens, finals = [0] * choices.n, [0] * choices.n, [None] * choices.n
            async for index, out in choices:
                num_tokens[index] = metrics.observe(out, num_tokens[index], ttft=index == 0)
                # a token whose text is held back (half a character, a possible stop string) still
                # sends its id and logprobs when the client asked for them
                if out.new_text or out.finished or not num_chunks[index] or (out.new_token_ids and (
                        builder.return_token_ids or formatters is not None)):
                    logprobs = None
                    if formatters is not None and out.new_token_ids:
                        logprobs = await loop.run_in_executor(tokenize_pool, formatters[index],
                                                              out.prompt_token_ids, out.new_logprobs)
                    yield builder.chunk_event(index, out.new_text, out.new_token_ids,
                                              out.finish_reason if out.finished else None,
                                              first=not num_chunks[index], logprobs=logprobs)
                    num_chunks[index] += 1
                if out.finished:
                    finals[index] = out
            _finished(finals)
            if req.include_usage:
                yield sse(builder.usage_chunk(len(finals[0].prompt_token_ids), sum(num_tokens)))
            yield "data: [DONE]\n\n"
        except (InvalidRequestError, EngineUnavailable) as exc:
            yield sse(error_body(str(exc), type="invalid_request_error" if isinstance(exc, InvalidRequestError)
                                 else "server_error"))
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            choices.abort()

    def _refused(exc: Exception, req: Any) -> JSONResponse:
        if isinstance(exc, InvalidRequestError):
            return _error(400, str(exc), req.wire_name(exc.param))
        if isinstance(exc, QueueFullError):
            return _queue_full(f"the server is overloaded: {exc.num_waiting} requests are waiting "
                               f"(--max-waiting-requests); retry after {RETRY_AFTER_S} s")
        return _error(503, str(exc), type="server_error")

    def _finished(finals: list[Any]) -> None:
        """Each choice is a request that ended (its finish reason, its latency); the prompt and the time
        to first token are the API request's, counted once (choice 0's: its first token is the client's
        first, the others start after it)."""
        for index, out in enumerate(finals):
            metrics.finished(out.finish_reason, len(out.prompt_token_ids) if index == 0 else 0,
                             (out.ttft_s or 0.0) + sum(out.inter_token_latencies_s))

    async def _abort_on_disconnect(request: Request, choices: Choices) -> None:
        """Wait for the client to go away; then abort its choices and wake its handler."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        choices.fail(EngineUnavailable("client disconnected"))

    return Guard(app, api_key, max_request_bytes)
