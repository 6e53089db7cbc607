"""The api side of the transport, for asyncio: the api's event loop must never block.

`AsyncRedisApiTransport` speaks the Redis layout of `redis_keys.py` with `redis.asyncio` (each
waiting reader holds one pooled connection while it blocks, so the pool is sized to the api's
concurrency). `ThreadedApiTransport` runs any synchronous `ApiTransport` (the in-process one of
`tgq serve`) on its own thread pool. Both honour the contract of `base.ApiTransport`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import redis
import redis.asyncio as aioredis

from batcher.messages import AbortRequest, FinalResult, Heartbeat, SubmitRequest, TokenEvent, encode
from batcher.request import Priority
from batcher.transport.base import ApiTransport, StoredFinal, TransportConfig
from batcher.transport.redis import (
    MAX_ABORT_LOG,
    decode_event,
    decode_final,
    decode_heartbeat,
    entry_id_str,
    started_ids,
)
from batcher.transport.redis_keys import AFTER_EVENTS_ID, END_ID, PERSISTERS, RedisKeys, event_id

_T = TypeVar("_T")


class AsyncApiTransport(Protocol):
    async def submit(self, requests: list[SubmitRequest]) -> None:
        """Enqueues them in one round trip, in order."""
        ...

    async def abort(self, request_id: str, reason: str = "aborted by client") -> None: ...

    async def read_tokens(
        self, request_id: str, from_seq: int, timeout_s: float
    ) -> list[TokenEvent]: ...

    async def read_final(self, request_id: str, timeout_s: float = 0.0) -> FinalResult | None: ...

    async def live_batchers(self) -> list[Heartbeat]: ...

    async def queue_depth(self) -> int: ...

    async def pull_finals(
        self, consumer: str, max_count: int, block_ms: int
    ) -> list[StoredFinal]: ...

    async def ack_finals(self, entry_ids: list[str]) -> None: ...

    async def read_started(
        self, cursor: str | None, max_count: int, block_ms: int
    ) -> tuple[str, list[str]]: ...

    async def close(self) -> None: ...


class ThreadedApiTransport:
    """A synchronous transport behind a thread pool: one thread per waiting reader."""

    def __init__(self, transport: ApiTransport, max_workers: int) -> None:
        self.transport = transport
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="transport")

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

    async def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class AsyncRedisApiTransport:
    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str = "tgq",
        config: TransportConfig | None = None,
        *,
        max_block_ms: int = 4000,
    ) -> None:
        """`max_block_ms` must stay under the client's socket timeout."""
        self.client = client
        self.keys = RedisKeys(prefix)
        self.config = config or TransportConfig()
        self._max_block_ms = max_block_ms
        self._has_group = False
        self._hub = TokenHub(client)

    @classmethod
    def from_url(
        cls,
        url: str,
        prefix: str = "tgq",
        config: TransportConfig | None = None,
        *,
        max_connections: int = 256,
    ) -> AsyncRedisApiTransport:
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=10, socket_timeout=5.0
        )
        return cls(aioredis.Redis(connection_pool=pool), prefix, config)

    async def submit(self, requests: list[SubmitRequest]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for request in requests:
            pipe.xadd(self.keys.queue(request.priority), {"m": encode(request)})
        await pipe.execute()

    async def abort(self, request_id: str, reason: str = "aborted by client") -> None:
        pipe = self.client.pipeline()
        pipe.set(self.keys.abort(request_id), 1, px=_ms(self.config.final_ttl_s))
        message = encode(AbortRequest(request_id, reason))
        pipe.xadd(self.keys.aborts, {"m": message}, maxlen=MAX_ABORT_LOG, approximate=True)
        await pipe.execute()

    async def read_tokens(
        self, request_id: str, from_seq: int, timeout_s: float
    ) -> list[TokenEvent]:
        key = self.keys.tokens(request_id)
        entries: Any
        if timeout_s > 0:
            entries = await self._hub.read(key, from_seq, timeout_s)
        else:
            entries = await self.client.xrange(key, event_id(from_seq), "+")
        return [decode_event(f) for entry_id, f in entries if entry_id_str(entry_id) != END_ID]

    async def read_final(self, request_id: str, timeout_s: float = 0.0) -> FinalResult | None:
        key = self.keys.final(request_id)
        data: Any = await self.client.get(key)
        if data is None and timeout_s > 0:
            tokens = self.keys.tokens(request_id)
            await self.client.xread({tokens: AFTER_EVENTS_ID}, block=self._block(timeout_s))
            data = await self.client.get(key)
        return None if data is None else decode_final(data)

    async def live_batchers(self) -> list[Heartbeat]:
        keys = [key async for key in self.client.scan_iter(match=self.keys.heartbeat("*"))]
        values: Any = await self.client.mget(keys) if keys else []
        return [decode_heartbeat(v) for v in values if v is not None]

    async def queue_depth(self) -> int:
        pipe = self.client.pipeline(transaction=False)
        for priority in Priority:
            pipe.xlen(self.keys.queue(priority))
        return sum(await pipe.execute())

    async def pull_finals(self, consumer: str, max_count: int, block_ms: int) -> list[StoredFinal]:
        stream, lease_ms = self.keys.finals, _ms(self.config.lease_s)
        await self._ensure_group()
        try:
            claimed: Any = await self.client.xautoclaim(
                stream, PERSISTERS, consumer, lease_ms, count=max_count
            )
            entries = list(claimed[1])
            if len(entries) < max_count:
                block = self._block(block_ms / 1000) if block_ms > 0 else None
                found: Any = await self.client.xreadgroup(
                    PERSISTERS, consumer, {stream: ">"}, max_count - len(entries), block
                )
                entries += found[0][1] if found else []
        except redis.ResponseError as error:
            if "NOGROUP" not in str(error):
                raise
            self._has_group = False  # Redis lost the stream; recreated on the next pull
            return []
        return [StoredFinal(entry_id_str(i), decode_final(f[b"m"])) for i, f in entries if f]

    async def _ensure_group(self) -> None:
        if self._has_group:
            return
        try:
            await self.client.xgroup_create(self.keys.finals, PERSISTERS, id="0", mkstream=True)
        except redis.ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise
        self._has_group = True

    async def ack_finals(self, entry_ids: list[str]) -> None:
        if entry_ids:
            pipe = self.client.pipeline()
            pipe.xack(self.keys.finals, PERSISTERS, *entry_ids)
            pipe.xdel(self.keys.finals, *entry_ids)
            await pipe.execute()

    async def read_started(
        self, cursor: str | None, max_count: int, block_ms: int
    ) -> tuple[str, list[str]]:
        stream = self.keys.started
        if cursor is None:
            last: Any = await self.client.xrevrange(stream, "+", "-", count=1)
            return (entry_id_str(last[0][0]) if last else "0-0"), []
        block = self._block(block_ms / 1000) if block_ms > 0 else None
        found: Any = await self.client.xread({stream: cursor}, count=max_count, block=block)
        return started_ids(cursor, found)

    async def close(self) -> None:
        await self._hub.close()
        await self.client.aclose()

    def _block(self, timeout_s: float) -> int:
        return min(_ms(timeout_s), self._max_block_ms)


@dataclass(eq=False, slots=True)
class _Waiter:
    from_seq: int
    found: asyncio.Future[list[Any]]


class TokenHub:
    """Every blocking token read of this replica in one XREAD: a waiter registers (stream,
    first seq) and the hub's loop reads all registered streams at once, handing each waiter its
    entries (the end marker included, so a waiter on a finished request wakes with nothing new).
    Per generated token that is one Redis round trip per engine step, not one per request.
    A waiter registered while the XREAD blocks joins the next one, at most `block_ms` later."""

    def __init__(self, client: aioredis.Redis, *, block_ms: int = 10, max_count: int = 1000):
        self.client = client
        self.block_ms = block_ms
        self.max_count = max_count
        self._waiters: dict[str, list[_Waiter]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def read(self, key: str, from_seq: int, timeout_s: float) -> list[Any]:
        """Entries of `key` from `from_seq` on, as soon as there are any; [] on timeout."""
        waiter = _Waiter(from_seq, asyncio.get_running_loop().create_future())
        self._waiters.setdefault(key, []).append(waiter)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="token-hub")
        self._wake.set()
        try:
            return await asyncio.wait_for(waiter.found, timeout_s)
        except TimeoutError:
            return []
        finally:
            self._forget(key, waiter)

    def _forget(self, key: str, waiter: _Waiter) -> None:
        waiters = self._waiters.get(key, [])
        if waiter in waiters:
            waiters.remove(waiter)
        if not waiters:
            self._waiters.pop(key, None)

    async def _run(self) -> None:
        while True:
            if not self._waiters:
                self._wake.clear()
                await self._wake.wait()
                continue
            streams: dict[Any, Any] = {
                key: f"0-{min(w.from_seq for w in waiters)}"
                for key, waiters in self._waiters.items()
            }
            try:
                found: Any = await self.client.xread(
                    streams, count=self.max_count, block=self.block_ms
                )
            except Exception as error:  # every waiter learns it; the next read retries
                for waiters in list(self._waiters.values()):
                    for waiter in waiters:
                        if not waiter.found.done():
                            waiter.found.set_exception(error)
                await asyncio.sleep(0.1)
                continue
            for key, entries in found or []:
                self._hand_out(key.decode() if isinstance(key, bytes) else key, entries)

    def _hand_out(self, key: str, entries: list[Any]) -> None:
        for waiter in list(self._waiters.get(key, [])):
            # Entry ids are `0-(seq + 1)`, then the end marker `1-0`.
            mine = [e for e in entries if _seq_of(e[0]) >= waiter.from_seq]
            if mine and not waiter.found.done():
                waiter.found.set_result(mine)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def _seq_of(entry_id: Any) -> int:
    """The seq index of a token-stream entry id; the end marker sorts after every event."""
    major, _, minor = entry_id_str(entry_id).partition("-")
    return int(minor) - 1 if major == "0" else 1 << 62


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
