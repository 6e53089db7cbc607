"""The in-process transport (`tgq serve`'s `memory.MemoryTransport`) for the api's event loop.
A stream's token reads wait on the loop itself: the transport calls back (`watch`) when the
batcher publishes, and one `call_soon_threadsafe` per stream wakes the loop, which then reads
under the lock. (A thread per waiting reader, as before, cost each token a thread wake-up and
two GIL hand-offs against the engine's thread.) The other blocking reads run on a thread pool of
their own; the remaining calls take a lock and return at once, so they run on the loop."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tgq.batcher.messages import FinalResult, Heartbeat, SubmitRequest, TokenEvent
from tgq.batcher.transport.aio import Epoch
from tgq.batcher.transport.base import StoredFinal
from tgq.batcher.transport.memory import MemoryTransport

_T = TypeVar("_T")


class ThreadedApiTransport:
    """The in-process transport for the event loop (see the module docstring)."""

    def __init__(self, transport: MemoryTransport, max_workers: int) -> None:
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
        if timeout_s > 0:
            loop = asyncio.get_running_loop()
            woken = asyncio.Event()

            def wake() -> None:
                loop.call_soon_threadsafe(woken.set)

            if self.transport.watch(request_id, from_seq, wake):
                try:
                    await asyncio.wait_for(woken.wait(), timeout_s)
                except TimeoutError:
                    pass
                finally:
                    self.transport.unwatch(request_id, wake)
        return self.transport.read_tokens(request_id, from_seq, 0)

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
