"""The app's edge: CORS, the payload limit and API-key auth, as pure ASGI middleware (none of
them buffers a response, so token streams pass through as they are produced).

Order, outermost first: CORS (so that a 401 or 413 still carries its headers), the payload
limit (the cheapest rejection, before any key lookup), auth.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tgq.api.errors import (
    ApiError,
    PayloadTooLargeError,
    UnauthorizedError,
    error_response,
    flavour_for_path,
)
from tgq.api.key_policy import KeyAccess
from tgq.api.settings import Settings

VerifyKey = Callable[[str], Awaitable[KeyAccess | None]]  # a stored key, or None

MULTIPART_FRAMING_BYTES = 64 * 1024  # boundaries, part headers and the `purpose` field
CORS_ALLOWED_HEADERS = ("Authorization", "Content-Type", "Idempotency-Key", "Last-Event-ID")
CORS_EXPOSED_HEADERS = ("Retry-After",)
MISSING_KEY = "Missing API key: send `Authorization: Bearer <key>`"
INVALID_KEY = "Invalid API key"


def install_security(app: FastAPI, settings: Settings, verify_key: VerifyKey | None = None) -> None:
    """Wrap `app` in the edge middleware; `verify_key` looks a key up in the database and is
    required when `settings.require_api_keys`."""
    if settings.require_api_keys and verify_key is None:
        raise ValueError("`require_api_keys` needs a `verify_key` that checks the database")
    # Each `add_middleware` wraps the ones added before it: the last added is the outermost.
    app.add_middleware(ApiKeyMiddleware, settings=settings, verify_key=verify_key)
    # File uploads stream to storage and the route bounds the file itself (`max_file_bytes`);
    # here only the multipart framing around it is allowed on top. Every other body is held in
    # memory, so it gets TGI's `payload_limit`.
    limits = {"/v1/files": settings.max_file_bytes + MULTIPART_FRAMING_BYTES}
    app.add_middleware(PayloadLimitMiddleware, limit=settings.payload_limit, path_limits=limits)
    if settings.cors_allow_origin:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_allow_origin,
            allow_methods=["*"],
            allow_headers=CORS_ALLOWED_HEADERS,
            expose_headers=CORS_EXPOSED_HEADERS,
        )


class PayloadLimitMiddleware:
    """413 for a request body over `limit` bytes: by `Content-Length` before the app runs,
    otherwise (chunked) as soon as the bytes received pass the limit."""

    def __init__(self, app: ASGIApp, *, limit: int, path_limits: dict[str, int] | None = None):
        self.app = app
        self.limit = limit
        self.path_limits = path_limits or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.path_limits.get(scope["path"], self.limit)
        content_length = Headers(scope=scope).get("content-length", "")
        if content_length.isdecimal():  # the server reads no more than it announces
            if int(content_length) > limit:
                await _too_large(limit, scope)(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        body = _LimitedBody(limit, scope, receive, send)
        try:
            await self.app(scope, body.receive, body.send)
        except ClientDisconnect:
            if not body.is_cut:  # a real disconnect, not the one this middleware made up
                raise


class _LimitedBody:
    """One request's body, counted as it arrives. Past the limit the app is told the client
    disconnected (it never sees the chunk that crossed it) and the client gets the 413; whatever
    the app answers then goes nowhere."""

    def __init__(self, limit: int, scope: Scope, receive: Receive, send: Send) -> None:
        self.limit = limit
        self.scope = scope
        self._receive = receive
        self._send = send
        self.num_bytes = 0
        self.is_cut = False
        self.is_response_started = False  # by the app: then too late for a 413
        self.has_rejected = False

    async def receive(self) -> Message:
        if self.is_cut:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.request":
            self.num_bytes += len(message.get("body", b""))
            if self.num_bytes > self.limit:
                await self._cut()
                return {"type": "http.disconnect"}
        return message

    async def send(self, message: Message) -> None:
        if self.has_rejected:
            return
        if message["type"] == "http.response.start":
            self.is_response_started = True
        await self._send(message)

    async def _cut(self) -> None:
        self.is_cut = True
        if not self.is_response_started:
            self.has_rejected = True
            await _too_large(self.limit, self.scope)(self.scope, self._receive, self._send)


def _too_large(limit: int, scope: Scope) -> ASGIApp:
    error = PayloadTooLargeError(f"Payload too large: the limit is {limit} bytes")
    return error_response(error, flavour=flavour_for_path(scope["path"]))


class ApiKeyMiddleware:
    """`Authorization: Bearer <key>` on every path outside `settings.public_routes` (and CORS
    preflights), when auth is on. Sets `request.state.key` (`KeyAccess`: the stored key, its
    limits, the rate-limit headers its admission leaves, which are added to the response) and
    `request.state.api_key_id` (its id); both None for the static key, for public paths and
    when auth is off."""

    def __init__(
        self, app: ASGIApp, *, settings: Settings, verify_key: VerifyKey | None = None
    ) -> None:
        self.app = app
        self.is_enabled = settings.is_auth_enabled
        self.public_routes = frozenset(settings.public_routes)
        self.static_key = None if settings.api_key is None else settings.api_key.encode()
        self.verify_key = verify_key if settings.require_api_keys else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["api_key_id"] = state["key"] = None
        if not self.is_enabled or self._is_public(scope):
            await self.app(scope, receive, send)
            return
        try:
            key = await self._authenticate(Headers(scope=scope))
        except ApiError as error:  # 401, or 503 when the key store is down
            response = error_response(error, flavour=flavour_for_path(scope["path"]))
            await response(scope, receive, send)
            return
        if key is None:
            await self.app(scope, receive, send)
            return
        state["api_key_id"], state["key"] = key.key_id, key

        async def send_with_limits(message: Message) -> None:
            if message["type"] == "http.response.start" and key.headers:
                message = {**message, "headers": _with(message.get("headers", []), key.headers)}
            await send(message)

        await self.app(scope, receive, send_with_limits)

    def _is_public(self, scope: Scope) -> bool:
        return scope["path"] in self.public_routes or _is_preflight(scope)

    async def _authenticate(self, headers: Headers) -> KeyAccess | None:
        key = _bearer_key(headers)
        if key is None:
            raise UnauthorizedError(MISSING_KEY)
        if self.static_key is not None and hmac.compare_digest(key.encode(), self.static_key):
            return None
        access = None if self.verify_key is None else await self.verify_key(key)
        if access is None:
            raise UnauthorizedError(INVALID_KEY)
        return access


def _with(headers: list[tuple[bytes, bytes]], more: dict[str, str]) -> list[tuple[bytes, bytes]]:
    """`headers` plus `more`, the ones already there (a 429's own) kept."""
    present = {name.lower() for name, _ in headers}
    added = [(k.encode(), v.encode()) for k, v in more.items() if k.encode() not in present]
    return [*headers, *added]


class RecentKeys:
    """`verify` with each valid key's answer kept for `ttl_s`: a burst from one key costs one
    database lookup, not one per request. So a revoked key, or a key's new limits, take effect
    within `ttl_s` (on every replica). Keys that fail are looked up every time; at most
    `max_keys` are kept (when full, all are dropped)."""

    def __init__(
        self,
        verify: VerifyKey,
        *,
        ttl_s: float,
        max_keys: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._verify = verify
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._clock = clock
        self._found: dict[str, tuple[float, KeyAccess]] = {}  # sha256 of the key -> (until, key)

    async def __call__(self, key: str) -> KeyAccess | None:
        digest = hashlib.sha256(key.encode()).hexdigest()
        now = self._clock()
        found = self._found.get(digest)
        if found is None or found[0] <= now:
            checked = await self._verify(key)
            if checked is None:
                self._found.pop(digest, None)
                return None
            if len(self._found) >= self.max_keys:
                self._found.clear()
            found = self._found[digest] = (now + self.ttl_s, checked)
        access = found[1]
        return KeyAccess(access.key_id, access.name, access.limits)  # headers of its own


def _bearer_key(headers: Headers) -> str | None:
    scheme, _, key = headers.get("authorization", "").partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


def _is_preflight(scope: Scope) -> bool:
    is_options = scope.get("method") == "OPTIONS"
    return is_options and "access-control-request-method" in Headers(scope=scope)
