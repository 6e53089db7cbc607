"""Each HTTP request's id and trace, as the outermost middleware.

The id is the client's `x-request-id` when it is a valid one (at most 64 of `A-Za-z0-9._-`),
else a new one. It is answered in the `x-request-id` header of every response, errors and 500s
included, and is the log context (`batcher.logs.current_request_id`) while the request runs, so
every line logged meanwhile carries it (uvicorn's access line too); the recorder sends it to the
batcher inside the submit messages. With tracing on, each request is a server span (a child of the
client's `traceparent`, if any) named by its route, with its status and request id.
"""

from __future__ import annotations

import logging
import re
import uuid
from typing import Any

from fastapi import FastAPI
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tgq.api.errors import ApiError, error_response, flavour_for_path
from tgq.api.settings import Settings
from tgq.batcher import tracing
from tgq.batcher.logs import current_request_id

REQUEST_ID_HEADER = "x-request-id"
_VALID_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
log = logging.getLogger("api")


def install_observability(app: FastAPI, settings: Settings) -> None:
    """Outermost middleware (install it last); with `otlp_endpoint`, tracing starts here
    (`TracingUnavailableError` without the `otel` extra), the app's shut-down flushes it."""
    if settings.otlp_endpoint:
        tracing.configure_tracing(settings.otlp_endpoint, settings.otlp_service_name, scope="api")
    app.add_middleware(RequestIdMiddleware)


def request_id_for(header: str | None) -> str:
    if header is not None and _VALID_REQUEST_ID.fullmatch(header):
        return header
    return uuid.uuid4().hex


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        exchange = _Exchange(request_id_for(headers.get(REQUEST_ID_HEADER)), send)
        context = current_request_id.set(exchange.request_id)
        try:
            if tracing.tracer() is None:
                await self._answer(scope, receive, exchange)
            else:
                await self._traced(scope, receive, exchange, headers)
        finally:
            current_request_id.reset(context)

    async def _answer(self, scope: Scope, receive: Receive, exchange: _Exchange) -> None:
        """The app's answer; an exception it let through becomes the api's 500 error body
        (logged here, with the request id), unless the response had already started."""
        try:
            await self.app(scope, receive, exchange.send)
        except Exception:
            if exchange.status is not None:
                raise
            log.exception("%s %s failed", scope["method"], scope["path"])
            error = ApiError("Internal server error")
            response = error_response(error, flavour=flavour_for_path(scope["path"]))
            await response(scope, receive, exchange.send)

    async def _traced(
        self, scope: Scope, receive: Receive, exchange: _Exchange, headers: Headers
    ) -> None:
        from opentelemetry.trace import SpanKind, StatusCode

        tracer = tracing.tracer()
        assert tracer is not None
        method = scope["method"]
        with tracer.start_as_current_span(
            method,
            context=tracing.parent_context(headers),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "request_id": exchange.request_id},
        ) as span:
            await self._answer(scope, receive, exchange)
            route: Any = scope.get("route")
            path = getattr(route, "path", None)
            if path is not None:
                span.update_name(f"{method} {path}")
                span.set_attribute("http.route", path)
            status = exchange.status or 0
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(StatusCode.ERROR)


class _Exchange:
    """One request's id, and the status its response started with."""

    def __init__(self, request_id: str, send: Send) -> None:
        self.request_id = request_id
        self.status: int | None = None
        self._send = send

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            MutableHeaders(scope=message)[REQUEST_ID_HEADER] = self.request_id
        await self._send(message)
