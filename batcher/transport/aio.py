"""The api side of the transport, for asyncio: the api's event loop must never block.

`AsyncRedisApiTransport` is the one implementation of the api's side of Redis: enqueue, abort,
follow token streams (through the replica's `TokenHub`), read and persist final results, the
started log, the epoch. It speaks `redis_keys.py`'s layout and `redis_wire.py`'s entry format
and consumer-group rule with `redis.asyncio` (a waiting final or started reader holds one pooled
connection while it blocks, so the pool is sized to the api's concurrency); the batcher's side
is `redis.RedisBatcherTransport`. `threaded.ThreadedApiTransport` runs the in-process transport
(`tgq serve`) on its own thread pool. Both honour `base.ApiTransport`'s contract, awaited
(`AsyncApiTransport`); `blocking.BlockingApiTransport` serves either to synchronous callers.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.driver_info import DriverInfo

from tgq.batcher.messages import AbortRequest, FinalResult, Heartbeat, SubmitRequest, TokenEvent
from tgq.batcher.request import Priority
from tgq.batcher.transport.base import StoredFinal, TransportConfig
from tgq.batcher.transport.redis_keys import (
    AFTER_EVENTS_ID,
    END_ID,
    MAX_ABORT_LOG,
    PERSISTERS,
    RedisKeys,
    event_id,
)
from tgq.batcher.transport.redis_wire import (
    CREATE_GROUPS,
    block_cap_ms,
    decode_as,
    entry_id_str,
    entry_message,
    is_missing_group,
    message_fields,
    ms,
    stream_entries,
)
from tgq.batcher.transport.router import PrefixRouter
from tgq.batcher.transport.token_hub import TokenHub

log = logging.getLogger(__name__)
_T = TypeVar("_T")
HEALTH_CHECK_S = 1
SOCKET_TIMEOUT_S = 5.0
HUB_BLOCK_MS = 1000  # the token hub's XREAD: a new reader wakes it sooner (`TokenHub`)


@dataclass(frozen=True, slots=True)
class Epoch:
    """The generation of the transport's data. A new `token` means that what the transport held
    before (queues, token streams, finals, markers) is gone: Redis restarted without
    persistence, or was flushed. `is_new`: the call that returned it started it."""

    token: str
    started_at: float  # unix time
    is_new: bool

    @classmethod
    def start(cls) -> Epoch:
        now = time.time()
        return cls(f"{now:.3f}:{uuid.uuid4().hex}", now, is_new=True)

    @classmethod
    def parse(cls, token: str, *, is_new: bool) -> Epoch:
        head, _, _ = token.partition(":")
        try:
            started_at = float(head)
        except ValueError:  # not one of ours: as old as can be
            started_at = 0.0
        return cls(token, started_at, is_new)


class AsyncApiTransport(Protocol):
    """The api side, awaited: `base.ApiTransport`'s contract (each call's meaning is there),
    plus a warm-up of connections, the epoch and close."""

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

    async def missing(self, request_ids: list[str]) -> list[str]: ...

    async def read_started(
        self, cursor: str | None, max_count: int, block_ms: int
    ) -> tuple[str, list[str]]: ...

    async def warm_up(self, num_connections: int) -> None:
        """Opens up to `num_connections` connections now, so that a burst does not pay for them."""
        ...

    async def epoch(self) -> Epoch:
        """The current epoch, started by this call when there was none (one round trip)."""
        ...

    async def close(self) -> None: ...


class AsyncRedisApiTransport:
    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str = "tgq",
        config: TransportConfig | None = None,
        *,
        max_block_ms: int = block_cap_ms(SOCKET_TIMEOUT_S),
        cache_routing: bool = True,
    ) -> None:
        """`max_block_ms` must stay under the client's socket timeout (`block_cap_ms`);
        `cache_routing`: enqueue a request for the batcher that holds its prefix (`routing.py`),
        else always to the shared queue."""
        self.client = client
        self.keys = RedisKeys(prefix)
        self.config = config or TransportConfig()
        self._max_block_ms = max_block_ms
        self._create_groups = client.register_script(CREATE_GROUPS)
        hub_block_ms = min(HUB_BLOCK_MS, max_block_ms)
        self._hub = TokenHub(client, self.keys.hub_wake(uuid.uuid4().hex), block_ms=hub_block_ms)
        self._router = None
        if cache_routing:
            self._router = PrefixRouter(client, self.keys, self.live_batchers)

    @classmethod
    def from_url(
        cls,
        url: str,
        prefix: str = "tgq",
        config: TransportConfig | None = None,
        *,
        max_connections: int = 256,
        cache_routing: bool = True,
    ) -> AsyncRedisApiTransport:
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=10,
            socket_timeout=SOCKET_TIMEOUT_S,
            # A connection idle this long is PINGed before its next command, and reconnected
            # (the one retry) when Redis restarted meanwhile: without it, a connection kept
            # through a restart failed its first command after it ("Connection closed by
            # server"). Commands themselves are not retried: an XADD is not idempotent.
            health_check_interval=HEALTH_CHECK_S,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
            # One for the pool: by default each new connection reads redis-py's version from
            # the installed package's metadata (files on disk).
            driver_info=DriverInfo(),
        )
        client = aioredis.Redis(connection_pool=pool)
        return cls(client, prefix, config, cache_routing=cache_routing)

    async def submit(self, requests: list[SubmitRequest]) -> None:
        router = self._router
        targets = await router.targets(requests) if router else [None] * len(requests)
        pipe = self.client.pipeline(transaction=False)
        known_ms = ms(self.config.final_ttl_s)
        for request, target in zip(requests, targets, strict=True):
            if router is not None and target is not None:
                router.enqueue(pipe, request, target)
            else:
                pipe.xadd(self.keys.queue(request.priority), message_fields(request))
            pipe.set(self.keys.known(request.request_id), 1, px=known_ms)
        await pipe.execute()

    async def missing(self, request_ids: list[str]) -> list[str]:
        pipe = self.client.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.exists(self.keys.known(request_id))
        found = await pipe.execute()
        return [r for r, known in zip(request_ids, found, strict=True) if not known]

    async def abort(self, request_id: str, reason: str = "aborted by client") -> None:
        pipe = self.client.pipeline()
        pipe.set(self.keys.abort(request_id), 1, px=ms(self.config.final_ttl_s))
        message = message_fields(AbortRequest(request_id, reason))
        pipe.xadd(self.keys.aborts, message, maxlen=MAX_ABORT_LOG, approximate=True)
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
        return [
            entry_message(fields, TokenEvent)
            for entry_id, fields in entries
            if entry_id_str(entry_id) != END_ID
        ]

    async def read_final(self, request_id: str, timeout_s: float = 0.0) -> FinalResult | None:
        """The final result, waiting up to `timeout_s` for it: in blocking reads of at most
        the client's cap, so a long wait is not cut to one cap."""
        key, deadline = self.keys.final(request_id), time.monotonic() + timeout_s
        data: Any = await self.client.get(key)
        while data is None and (left_s := deadline - time.monotonic()) > 0:
            tokens = self.keys.tokens(request_id)
            ended: Any = await self.client.xread(
                {tokens: AFTER_EVENTS_ID}, block=max(1, self._block(left_s))
            )
            data = await self.client.get(key)
            if ended and data is None:  # the end marker without a final: none will come
                break
        return None if data is None else decode_as(data, FinalResult)

    async def live_batchers(self) -> list[Heartbeat]:
        keys = [key async for key in self.client.scan_iter(match=self.keys.heartbeat("*"))]
        values: Any = await self.client.mget(keys) if keys else []
        return [decode_as(v, Heartbeat) for v in values if v is not None]

    async def queue_depth(self) -> int:
        routed: Any = await self.client.smembers(self.keys.routed_batchers)
        pipe = self.client.pipeline(transaction=False)
        for priority in Priority:
            pipe.xlen(self.keys.queue(priority))
            for batcher_id in routed:
                pipe.xlen(self.keys.routed(priority, batcher_id.decode()))
        return sum(await pipe.execute())

    async def pull_finals(self, consumer: str, max_count: int, block_ms: int) -> list[StoredFinal]:
        stream, lease_ms = self.keys.finals, ms(self.config.lease_s)
        claimed: Any = await self._in_group(
            lambda: self.client.xautoclaim(stream, PERSISTERS, consumer, lease_ms, count=max_count)
        )
        entries = list(claimed[1])
        if len(entries) < max_count:
            block = self._block(block_ms / 1000) if block_ms > 0 else None
            found: Any = await self._in_group(
                lambda: self.client.xreadgroup(
                    PERSISTERS, consumer, {stream: ">"}, max_count - len(entries), block
                )
            )
            entries += stream_entries(found)
        return [
            StoredFinal(entry_id_str(entry_id), entry_message(fields, FinalResult))
            for entry_id, fields in entries
            if fields  # an entry deleted while pending: nothing left to persist
        ]

    async def _in_group(self, command: Callable[[], Awaitable[_T]]) -> _T:
        """Runs a command on the persisters' consumer group, creating the group first when it
        is missing (`redis_wire.py`)."""
        try:
            return await command()
        except redis.ResponseError as error:
            if not is_missing_group(error):
                raise
        log.info("no consumer group %r on the finals stream (a new or emptied Redis)", PERSISTERS)
        await self._create_groups(keys=[self.keys.finals], args=[PERSISTERS])
        return await command()

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
        entries = stream_entries(found)
        if not entries:
            return cursor, []
        ids = [fields[b"r"].decode() for _, fields in entries]
        return entry_id_str(entries[-1][0]), ids

    async def epoch(self) -> Epoch:
        candidate = Epoch.start()
        pipe = self.client.pipeline(transaction=True)
        pipe.set(self.keys.epoch, candidate.token, nx=True)
        pipe.get(self.keys.epoch)
        created, token = await pipe.execute()
        if created:
            return candidate
        return Epoch.parse(token.decode(), is_new=False)

    async def warm_up(self, num_connections: int) -> None:
        pool = self.client.connection_pool
        opened = await asyncio.gather(
            *(pool.get_connection() for _ in range(num_connections))  # type: ignore[no-untyped-call]
        )
        for connection in opened:
            await pool.release(connection)

    async def close(self) -> None:
        await self._hub.close()
        await self.client.aclose()

    def _block(self, timeout_s: float) -> int:
        return min(ms(timeout_s), self._max_block_ms)
