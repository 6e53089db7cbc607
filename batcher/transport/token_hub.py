"""One api replica's token hub: every blocking token read of the replica through one XREAD."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from tgq.batcher.transport.redis_keys import END_ID
from tgq.batcher.transport.redis_wire import entry_id_str

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
