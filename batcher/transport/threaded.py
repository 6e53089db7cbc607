"""The in-process transport (`tgq serve`'s `memory.MemoryTransport`) for the api's event loop:
its blocking reads run on a thread pool of their own, one thread per waiting reader; the other
calls take a lock and return at once, so they run on the loop."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tgq.batcher.messages import FinalResult, Heartbeat, SubmitRequest, TokenEvent
from tgq.batcher.transport.aio import Epoch
from tgq.batcher.transport.base import ApiTransport, StoredFinal

_T = TypeVar("_T")


class ThreadedApiTransport:
    """A synchronous transport behind a thread pool: one thread per waiting reader."""

    def __init__(self, transport: ApiTransport, max_workers: int) -> None:
        self.transport = transport
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="transport")
        self._epoch = Epoch.start()  # in process: its data lives as long as this object

    async def _run(self, call: Callable[..., _T], *args: Any) -> _T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(call, *args))

    async def submit(self, requests: list[SubmitRequest]) -> None:
        for request in requests:
            self.transport.submit(request)  # in-process: a lock and an append

    async def abort(self, request_id: str, reason: str = "aborted by client") -> None:
        self.transport.abort(request_id, reason)

    async def read_tokens(
        self, request_id: str, from_seq: int, timeout_s: float
    ) -> list[TokenEvent]:
        return await self._run(self.transport.read_tokens, request_id, from_seq, timeout_s)

    async def read_final(self, request_id: str, timeout_s: float = 0.0) -> FinalResult | None:
        return await self._run(self.transport.read_final, request_id, timeout_s)

    async def live_batchers(self) -> list[Heartbeat]:
        return self.transport.live_batchers()

    async def queue_depth(self) -> int:
        return self.transport.queue_depth()

    async def pull_finals(self, consumer: str, max_count: int, block_ms: int) -> list[StoredFinal]:
        return await self._run(self.transport.pull_finals, consumer, max_count, block_ms)

    async def ack_finals(self, entry_ids: list[str]) -> None:
        self.transport.ack_finals(entry_ids)

    async def read_started(
        self, cursor: str | None, max_count: int, block_ms: int
    ) -> tuple[str, list[str]]:
        return await self._run(self.transport.read_started, cursor, max_count, block_ms)

    async def missing(self, request_ids: list[str]) -> list[str]:
        return self.transport.missing(request_ids)

    async def warm_up(self, num_connections: int) -> None:
        pass  # in process: nothing to connect

    async def epoch(self) -> Epoch:
        epoch, self._epoch = self._epoch, dataclasses.replace(self._epoch, is_new=False)
        return epoch

    async def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
