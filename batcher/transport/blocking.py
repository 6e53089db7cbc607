"""The api side for synchronous callers: scripts, benchmarks and tests that play an api replica.

`BlockingApiTransport` runs an `AsyncApiTransport` (for Redis, `AsyncRedisApiTransport`: the one
implementation of the api's side) on an event loop of its own, in a thread, so that any thread
may call it and each call blocks only its caller. It honours `base.ApiTransport`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, TypeVar

from tgq.batcher.messages import FinalResult, Heartbeat, SubmitRequest, TokenEvent
from tgq.batcher.transport.aio import AsyncApiTransport, AsyncRedisApiTransport, Epoch
from tgq.batcher.transport.base import StoredFinal, TransportConfig

_T = TypeVar("_T")


class BlockingApiTransport:
    def __init__(self, make: Callable[[], AsyncApiTransport]) -> None:
        """`make` runs on the transport's own loop: a connection pool binds to the loop it
        first runs on."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="api-transport", daemon=True
        )
        self._thread.start()
        self.transport = self._call(_made(make))

    @classmethod
    def from_url(
        cls, url: str, prefix: str = "tgq", config: TransportConfig | None = None
    ) -> BlockingApiTransport:
        return cls(lambda: AsyncRedisApiTransport.from_url(url, prefix, config))

    def _call(self, call: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(call, self._loop).result()

    def submit(self, request: SubmitRequest) -> None:
        self._call(self.transport.submit([request]))

    def abort(self, request_id: str, reason: str = "aborted by client") -> None:
        self._call(self.transport.abort(request_id, reason))

    def read_tokens(self, request_id: str, from_seq: int, timeout_s: float) -> list[TokenEvent]:
        return self._call(self.transport.read_tokens(request_id, from_seq, timeout_s))

    def read_final(self, request_id: str, timeout_s: float = 0.0) -> FinalResult | None:
        return self._call(self.transport.read_final(request_id, timeout_s))

    def live_batchers(self) -> list[Heartbeat]:
        return self._call(self.transport.live_batchers())

    def queue_depth(self) -> int:
        return self._call(self.transport.queue_depth())

    def pull_finals(self, consumer: str, max_count: int, block_ms: int) -> list[StoredFinal]:
        return self._call(self.transport.pull_finals(consumer, max_count, block_ms))

    def ack_finals(self, entry_ids: list[str]) -> None:
        self._call(self.transport.ack_finals(entry_ids))

    def missing(self, request_ids: list[str]) -> list[str]:
        return self._call(self.transport.missing(request_ids))

    def read_started(
        self, cursor: str | None, max_count: int, block_ms: int
    ) -> tuple[str, list[str]]:
        return self._call(self.transport.read_started(cursor, max_count, block_ms))

    def epoch(self) -> Epoch:
        return self._call(self.transport.epoch())

    def close(self) -> None:
        try:
            self._call(self.transport.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> BlockingApiTransport:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


async def _made(make: Callable[[], AsyncApiTransport]) -> AsyncApiTransport:
    return make()
