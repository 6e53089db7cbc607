"""Graceful shutdown of the api: drain, then stop.

On the first SIGTERM (or SIGINT) the api keeps its socket open but answers every new request
503 (with `Retry-After` and `Connection: close`, so a load balancer or client moves to another
replica), while the requests already admitted finish. Once none is left, or `DRAIN_TIMEOUT_S`
has passed, uvicorn shuts down as usual: it closes idle connections, gives what remains (job
event followers, which resume on any replica) `GRACEFUL_CLOSE_S`, then the lifespan stops the
persister after its last round. A second signal stops at once.

uvicorn alone closes its socket at the first signal: a request sent during the drain would be
refused at the TCP level, which clients cannot tell from a crash.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from tgq.api.errors import UnavailableError, error_response, flavour_for_path
from tgq.batcher.gc_freeze import freeze_startup_objects

log = logging.getLogger("api")
POLL_S = 0.05
GRACEFUL_CLOSE_S = 5  # uvicorn's own timeout, after the drain, for connections still open


class Drain:
    """Whether this replica is draining; shared by the server (sets it) and the middleware."""

    def __init__(self) -> None:
        self.draining = False


class DrainMiddleware:
    """Outside every route: while draining, a new request gets 503 without reaching the app."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.drain.draining:
            error = UnavailableError(
                "the server is shutting down; retry on another replica", retry_after_s=1
            )
            response = error_response(error, flavour=flavour_for_path(scope["path"]))
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain between the signal and the shut-down."""

    def __init__(
        self,
        config: uvicorn.Config,
        drain: Drain,
        in_flight: Callable[[], int],
        drain_timeout_s: float,
    ) -> None:
        super().__init__(config)
        self.drain = drain
        self.in_flight = in_flight
        self.drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)  # type: ignore[arg-type]

    async def startup(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        await super().startup(sockets)  # type: ignore[arg-type]
        freeze_startup_objects()  # the app's start-up (its lifespan) is done

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain.draining or self._loop is None:  # a second signal, or not serving yet
            super().handle_exit(sig, frame)
            return
        self.drain.draining = True
        log.info("signal %d: draining (new requests get 503)", sig)
        # A fresh context: not that of the request the signal happened to interrupt.
        self._loop.call_soon_threadsafe(self._start_drain, context=contextvars.Context())

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_stop())

    async def _drain_then_stop(self) -> None:
        started = time.monotonic()
        deadline = started + self.drain_timeout_s
        while self.in_flight() > 0 and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        left = self.in_flight()
        log.info("drained in %.1f s%s", time.monotonic() - started, f", {left} cut" if left else "")
        self.should_exit = True
