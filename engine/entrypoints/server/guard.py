"""The ASGI middleware in front of the app: the API key on every /v1 route, the body size limit, and
the count of requests in flight.

The count is what a drain waits for (engine.entrypoints.server.shutdown): a request is in flight
from its first byte until its response's last, so a stream counts until its final event and a
request still being tokenized counts too. /health and /metrics are not counted: a load balancer
polling them must not hold a drain open.
"""
from __future__ import annotations

import hmac
import json
from typing import Any

from engine.entrypoints.server.protocol import error_body

UNCOUNTED_PATHS = ("/health", "/metrics")


class Guard:
    """The API key (constant-time compare), the body size limit (Content-Length, or counted while
    reading a chunked body) and `in_flight`, the requests being answered (event loop thread only)."""

    def __init__(self, app: Any, api_key: str | None, max_request_bytes: int) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_request_bytes = max_request_bytes
        self.in_flight = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["path"] in UNCOUNTED_PATHS:
            return await self._guarded(scope, receive, send)
        self.in_flight += 1
        try:
            return await self._guarded(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _guarded(self, scope, receive, send) -> None:
        headers = dict(scope["headers"])
        if self.expected is not None and scope["path"].startswith("/v1"):
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                return await _send(send, 401, error_body("missing or wrong API key: send 'Authorization: "
                                                         "Bearer KEY'", code="invalid_api_key"))
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return await _send(send, 400, error_body("Content-Length is not a number"))
            if int(length) > self.max_request_bytes:
                return await _send(send, 413, self._too_large())
            return await self.app(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_request_bytes:
                return await _send(send, 413, self._too_large())
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)

    def _too_large(self) -> dict:
        return error_body(f"request body larger than {self.max_request_bytes} bytes", code="request_too_large")


async def _send(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
