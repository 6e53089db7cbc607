"""The api side of the transport, for asyncio: the api's event loop must never block.

`AsyncRedisApiTransport` speaks the Redis layout of `redis_keys.py` with `redis.asyncio` (each
waiting reader holds one pooled connection while it blocks, so the pool is sized to the api's
concurrency). `ThreadedApiTransport` runs any synchronous `ApiTransport` (the in-process one of
`tgq serve`) on its own thread pool. Both honour the contract of `base.ApiTransport`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.driver_info import DriverInfo

from tgq.batcher.messages import (
    AbortRequest,
    FinalResult,
    Heartbeat,
    SubmitRequest,
    TokenEvent,
    encode,
)
from tgq.batcher.request import Priority
from tgq.batcher.transport.base import ApiTransport, StoredFinal, TransportConfig
from tgq.batcher.transport.redis import (
    MAX_ABORT_LOG,
    decode_event,
    decode_final,
    decode_heartbeat,
    entry_id_str,
    started_ids,
)
from tgq.batcher.transport.redis_keys import (
    AFTER_EVENTS_ID,
    END_ID,
    PERSISTERS,
    RedisKeys,
    event_id,
)

_T = TypeVar("_T")
HEALTH_CHECK_S = 1


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
        self._hub = TokenHub(client, self.keys.hub_wake(uuid.uuid4().hex))

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
            url,
            max_connections=max_connections,
            timeout=10,
            socket_timeout=5.0,
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
        return cls(aioredis.Redis(connection_pool=pool), prefix, config)

    async def submit(self, requests: list[SubmitRequest]) -> None:
        pipe = self.client.pipeline(transaction=False)
        known_ms = _ms(self.config.final_ttl_s)
        for request in requests:
            pipe.xadd(self.keys.queue(request.priority), {"m": encode(request)})
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
        key, deadline = self.keys.final(request_id), time.monotonic() + timeout_s
        data: Any = await self.client.get(key)
        while data is None and (left_s := deadline - time.monotonic()) > 0:  # as RedisTransport
            tokens = self.keys.tokens(request_id)
            ended: Any = await self.client.xread(
                {tokens: AFTER_EVENTS_ID}, block=max(1, self._block(left_s))
            )
            data = await self.client.get(key)
            if ended and data is None:  # the end marker without a final: none will come
                break
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

    async def epoch(self) -> Epoch:
        candidate = Epoch.start()
        pipe = self.client.pipeline(transaction=True)
        pipe.set(self.keys.epoch, candidate.token, nx=True)
        pipe.get(self.keys.epoch)
        created, token = await pipe.execute()
        if created:
            self._has_group = False  # the finals stream and its group went with the data
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
        return min(_ms(timeout_s), self._max_block_ms)


WAKE_TTL_S = 86400  # a replica's wake stream outlives its last wake-up by a day at most


@dataclass(eq=False, slots=True)
class _Waiter:
    from_seq: int
    found: asyncio.Future[list[Any]]


@dataclass(eq=False, slots=True)
class _Stream:
    """One followed token stream: what the hub has read of it and who waits for more."""

    next_seq: int  # the hub's XREAD cursor: entries from this seq on are not read yet
    entries: list[Any] = field(default_factory=list)  # read, not yet passed by every reader
    waiters: list[_Waiter] = field(default_factory=list)
    last_wanted: float = 0.0  # monotonic time a reader last asked
    is_ended: bool = False  # the end marker was read: nothing more will come

    @property
    def first_seq(self) -> int:
        """The oldest seq this stream can still hand out without reading Redis again."""
        return min([self.next_seq, *(_seq_of(e[0]) for e in self.entries[:1])])

    def take(self, from_seq: int) -> list[Any]:
        """Buffered entries from `from_seq` on; older ones are dropped (readers move forward)."""
        self.entries = [e for e in self.entries if _seq_of(e[0]) >= from_seq]
        return list(self.entries)


class TokenHub:
    """Every blocking token read of this replica through one XREAD over all followed streams.

    A stream joins when a reader first asks for it and stays while readers keep asking (and
    `linger_s` after), so the XREAD's key set is stable while tokens flow: about one round trip
    per engine step for all requests, not one per request per token. Entries that arrive between
    two reads of a reader wait in the stream's buffer. A reader of a stream the hub does not read
    yet wakes the blocked XREAD through the hub's own wake stream (one XADD per new request)."""

    def __init__(
        self, client: aioredis.Redis, wake_key: str, *, block_ms: int = 1000, linger_s: float = 5.0
    ) -> None:
        self.client = client
        self.wake_key = wake_key
        self.block_ms = block_ms
        self.linger_s = linger_s
        self._streams: dict[str, _Stream] = {}
        self._wake_seen = "$"
        self._idle = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._is_closing = False

    async def read(self, key: str, from_seq: int, timeout_s: float) -> list[Any]:
        """Entries of `key` from `from_seq` on, as soon as there are any; [] on timeout."""
        stream = self._streams.get(key)
        is_new = stream is None or from_seq < stream.first_seq
        if stream is None:
            stream = self._streams[key] = _Stream(from_seq)
        elif is_new:  # a reader from further back (a reconnect): read the stream again from there
            stream.next_seq, stream.entries, stream.is_ended = from_seq, [], False
        stream.last_wanted = time.monotonic()
        buffered = stream.take(from_seq)
        if buffered:
            return buffered
        waiter = _Waiter(from_seq, asyncio.get_running_loop().create_future())
        stream.waiters.append(waiter)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="token-hub")
        self._idle.set()
        if is_new:  # the blocked XREAD does not read this stream yet
            await self._wake()
        try:
            return await asyncio.wait_for(waiter.found, timeout_s)
        except TimeoutError:
            return []
        finally:
            if waiter in stream.waiters:
                stream.waiters.remove(waiter)

    async def _run(self) -> None:
        while not self._is_closing:
            self._forget_idle_streams()
            if not self._streams:
                self._idle.clear()
                await self._idle.wait()
                continue
            cursors: dict[Any, Any] = {
                key: f"0-{stream.next_seq}"
                for key, stream in self._streams.items()
                if not stream.is_ended
            }
            cursors[self.wake_key] = self._wake_seen
            try:
                found: Any = await self.client.xread(cursors, count=1000, block=self.block_ms)
            except Exception as error:  # every waiter learns it; the next read retries
                self._fail_all(error)
                await asyncio.sleep(0.1)
                continue
            for raw_key, entries in found or []:
                key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
                if key == self.wake_key:
                    self._wake_seen = entry_id_str(entries[-1][0])
                elif (stream := self._streams.get(key)) is not None:
                    self._hand_out(stream, entries)

    def _hand_out(self, stream: _Stream, entries: list[Any]) -> None:
        stream.entries += entries
        if entry_id_str(entries[-1][0]) == END_ID:
            stream.is_ended = True  # kept in the buffer: every later reader sees the end
        else:
            stream.next_seq = _seq_of(entries[-1][0]) + 1
        for waiter in list(stream.waiters):
            mine = stream.take(waiter.from_seq) if not waiter.found.done() else []
            if mine:
                waiter.found.set_result(mine)
                stream.waiters.remove(waiter)

    def _forget_idle_streams(self) -> None:
        horizon = time.monotonic() - self.linger_s
        for key, stream in list(self._streams.items()):
            if not stream.waiters and stream.last_wanted < horizon:
                del self._streams[key]

    def _fail_all(self, error: Exception) -> None:
        for stream in self._streams.values():
            for waiter in stream.waiters:
                if not waiter.found.done():
                    waiter.found.set_exception(error)

    async def close(self) -> None:
        """Stops the loop by waking its XREAD rather than cancelling it: cancelling a blocked
        redis-py read can leave the awaiting task hanging on this machine's redis 8.1."""
        self._is_closing = True
        self._idle.set()
        if self._task is None or self._task.done():
            return
        with contextlib.suppress(Exception):
            await self._wake()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), 2 * self.block_ms / 1000)
        except TimeoutError:
            self._task.cancel()

    async def _wake(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.xadd(self.wake_key, {"k": ""}, maxlen=100, approximate=True)
        pipe.expire(self.wake_key, WAKE_TTL_S)
        await pipe.execute()


def _seq_of(entry_id: Any) -> int:
    """The seq index of a token-stream entry id; the end marker sorts after every event."""
    major, _, minor = entry_id_str(entry_id).partition("-")
    return int(minor) - 1 if major == "0" else 1 << 62


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
