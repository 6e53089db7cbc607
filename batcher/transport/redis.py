"""The batcher's side of the Redis transport (synchronous, as the batcher's step loop is):
pull requests, publish their tokens and final results, ack, heartbeat, reclaim. The api's side
is `aio.AsyncRedisApiTransport`; what both share (key names, entry encoding, consumer groups):
`redis_keys.py` and `redis_wire.py`.

Reclaim uses XPENDING (entries idle >= lease, with their owner) and XCLAIM with the same min idle
time, so of two racing reclaimers only one wins an entry; the winner requeues it with attempt + 1
(XADD + XACK + XDEL in one MULTI) or fails it past `max_attempts`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.typing import EncodableT, KeyT, StreamIdT

from tgq.batcher.messages import (
    AbortRequest,
    FinalResult,
    Heartbeat,
    MessageError,
    SubmitRequest,
    TokenEvent,
    encode,
)
from tgq.batcher.request import Priority
from tgq.batcher.transport.base import MAX_STARTED_LOG, Delivery, TransportConfig, failed_result
from tgq.batcher.transport.redis_keys import END_ID, GROUP, MAX_ABORT_LOG, RedisKeys, event_id
from tgq.batcher.transport.redis_wire import (
    CREATE_GROUPS,
    block_cap_ms,
    entry_id_str,
    entry_message,
    is_missing_group,
    message_fields,
    ms,
    stream_entries,
)

log = logging.getLogger(__name__)
_T = TypeVar("_T")

EXPIRY_REFRESH_EVERY = 32  # token events; one PEXPIRE per event would double the ops per token
_PRIORITY_ORDER = sorted(Priority, reverse=True)  # interactive first

# SET NX the final result; only the winner closes the token stream and queues it to persist.
_PUBLISH_FINAL = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  redis.call('XADD', KEYS[2], ARGV[4], 'end', '1')
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  redis.call('XADD', KEYS[3], '*', 'm', ARGV[1])
  return 1
end
return 0
"""


class RedisBatcherTransport:
    """`base.BatcherTransport` on Redis: one instance per batcher process, any number of them
    on one Redis."""

    def __init__(
        self, client: redis.Redis, prefix: str = "tgq", config: TransportConfig | None = None
    ) -> None:
        self.client = client
        self.keys = RedisKeys(prefix)
        self.config = config or TransportConfig()
        self._publish_final = client.register_script(_PUBLISH_FINAL)
        self._create_groups = client.register_script(CREATE_GROUPS)
        self._held: dict[str, list[Delivery]] = {}  # pulled past max_count, returned next pull
        self._abort_cursors: dict[str, str] = {}
        self._max_block_ms = block_cap_ms(_socket_timeout_s(client))

    @classmethod
    def from_url(
        cls, url: str, prefix: str = "tgq", config: TransportConfig | None = None
    ) -> RedisBatcherTransport:
        return cls(redis.Redis.from_url(url), prefix, config)

    def _in_group(self, command: Callable[[], _T]) -> _T:
        """Runs a command on the queues' consumer group, creating the group first when it is
        missing (`redis_wire.py`)."""
        try:
            return command()
        except redis.ResponseError as error:
            if not is_missing_group(error):
                raise
        log.info("no consumer group %r on the request queues (a new or emptied Redis)", GROUP)
        self._create_groups(keys=[self.keys.queue(p) for p in Priority], args=[GROUP])
        return command()

    def pull(
        self, batcher_id: str, max_count: int, block_ms: int, *, above: Priority | None = None
    ) -> list[Delivery]:
        if above is not None:  # never blocks; what is held for this batcher stays held
            outranking = [p for p in _PRIORITY_ORDER if p > above]
            found = self._read_group(batcher_id, outranking, max_count, None) if outranking else []
            return self._mark_aborted(found)
        held = self._held.pop(batcher_id, [])
        deliveries, rest = held[:max_count], held[max_count:]
        for priority in _PRIORITY_ORDER:
            if len(deliveries) < max_count:
                num_wanted = max_count - len(deliveries)
                deliveries += self._read_group(batcher_id, [priority], num_wanted, None)
        if not deliveries and block_ms > 0:
            # One entry per stream at most; an extra one is held for the next pull.
            found = self._read_group(batcher_id, _PRIORITY_ORDER, 1, block_ms)
            deliveries, rest = found[:max_count], found[max_count:]
        if rest:
            self._held[batcher_id] = rest
        return self._mark_aborted(deliveries)

    def _read_group(
        self, batcher_id: str, priorities: list[Priority], count: int, block_ms: int | None
    ) -> list[Delivery]:
        streams: dict[KeyT, StreamIdT] = {self.keys.queue(p): ">" for p in priorities}
        if block_ms is not None:
            block_ms = min(block_ms, self._max_block_ms)
        found: Any = self._in_group(
            lambda: self.client.xreadgroup(GROUP, batcher_id, streams, count, block_ms)
        )
        deliveries = []
        for stream, entries in found or []:
            for entry_id, fields in entries:
                try:
                    request = entry_message(fields, SubmitRequest)
                except (KeyError, MessageError) as error:
                    log.error(
                        "dropping malformed queue entry %s: %s", entry_id_str(entry_id), error
                    )
                    self._delete(stream, entry_id)
                    continue
                deliveries.append(Delivery(entry_id_str(entry_id), request))
        return deliveries

    def _mark_aborted(self, deliveries: list[Delivery]) -> list[Delivery]:
        if not deliveries:
            return deliveries
        pipe = self.client.pipeline()
        for delivery in deliveries:
            pipe.exists(self.keys.abort(delivery.request.request_id))
        flags = pipe.execute()
        return [
            Delivery(d.entry_id, d.request, bool(f)) for d, f in zip(deliveries, flags, strict=True)
        ]

    def publish_tokens(self, events: list[TokenEvent]) -> None:
        if not events:
            return
        pipe = self.client.pipeline(transaction=False)
        for event in events:
            key = self.keys.tokens(event.request_id)
            pipe.xadd(key, message_fields(event), id=event_id(event.seq_index))
            if event.seq_index % EXPIRY_REFRESH_EVERY == 0:
                pipe.pexpire(key, ms(self.config.token_ttl_s))
            if event.seq_index == 0:
                started: dict[EncodableT, EncodableT] = {"r": event.request_id}
                pipe.xadd(self.keys.started, started, maxlen=MAX_STARTED_LOG, approximate=True)
        for outcome in pipe.execute(raise_on_error=False):
            # A rejected id is a replayed or late event: dropped by design.
            if isinstance(outcome, Exception) and "equal or smaller" not in str(outcome):
                raise outcome

    def publish_final(self, result: FinalResult) -> bool:
        keys = [
            self.keys.final(result.request_id),
            self.keys.tokens(result.request_id),
            self.keys.finals,
        ]
        config = self.config
        args: list[EncodableT] = [
            encode(result),
            ms(config.final_ttl_s),
            ms(config.token_ttl_s),
            END_ID,
        ]
        return bool(self._publish_final(keys=keys, args=args))

    def ack(self, batcher_id: str, delivery: Delivery) -> None:
        self._delete(self.keys.queue(delivery.request.priority), delivery.entry_id)

    def _delete(self, stream: str | bytes, entry_id: str | bytes) -> None:
        pipe = self.client.pipeline()
        pipe.xack(stream, GROUP, entry_id)
        pipe.xdel(stream, entry_id)
        pipe.execute()

    def release(self, batcher_id: str, delivery: Delivery) -> None:
        stream = self.keys.queue(delivery.request.priority)
        pipe = self.client.pipeline()
        pipe.xadd(stream, message_fields(delivery.request))
        pipe.xack(stream, GROUP, delivery.entry_id)
        pipe.xdel(stream, delivery.entry_id)
        pipe.execute()

    def poll_aborts(self, batcher_id: str) -> list[str]:
        stream = self.keys.aborts
        cursor = self._abort_cursors.get(batcher_id)
        if cursor is None:
            last: Any = self.client.xrevrange(stream, "+", "-", count=1)
            self._abort_cursors[batcher_id] = entry_id_str(last[0][0]) if last else "0-0"
            return []
        entries = stream_entries(self.client.xread({stream: cursor}, count=MAX_ABORT_LOG))
        if entries:
            self._abort_cursors[batcher_id] = entry_id_str(entries[-1][0])
        return [entry_message(fields, AbortRequest).request_id for _, fields in entries]

    def heartbeat(self, beat: Heartbeat) -> None:
        key = self.keys.heartbeat(beat.batcher_id)
        self.client.set(key, encode(beat), px=ms(self.config.heartbeat_ttl_s))

    def reclaim(self, batcher_id: str, max_count: int = 100) -> int:
        num_reclaimed = 0
        for priority in _PRIORITY_ORDER:
            num_reclaimed += self._reclaim_stream(self.keys.queue(priority), batcher_id, max_count)
        return num_reclaimed

    def _reclaim_stream(self, stream: str, batcher_id: str, max_count: int) -> int:
        lease_ms = ms(self.config.lease_s)
        pending: Any = self._in_group(
            lambda: self.client.xpending_range(stream, GROUP, "-", "+", max_count, idle=lease_ms)
        )
        owners = sorted({entry["consumer"] for entry in pending})
        pipe = self.client.pipeline()
        for owner in owners:
            pipe.exists(self.keys.heartbeat(owner.decode()))
        dead = {owner for owner, alive in zip(owners, pipe.execute(), strict=True) if not alive}
        entry_ids = [entry["message_id"] for entry in pending if entry["consumer"] in dead]
        if not entry_ids:
            return 0
        claimed: Any = self.client.xclaim(stream, GROUP, batcher_id, lease_ms, entry_ids)
        for entry_id, fields in claimed:
            self._requeue_or_fail(stream, entry_id, fields, batcher_id)
        return len(claimed)

    def recover(self, batcher_id: str, max_count: int = 1000) -> int:
        return sum(
            self._recover_stream(self.keys.queue(priority), batcher_id, max_count)
            for priority in _PRIORITY_ORDER
        )

    def _recover_stream(self, stream: str, batcher_id: str, max_count: int) -> int:
        pending: Any = self._in_group(
            lambda: self.client.xpending_range(
                stream, GROUP, "-", "+", max_count, consumername=batcher_id
            )
        )
        if not pending:
            return 0
        entry_ids = [entry["message_id"] for entry in pending]
        claimed: Any = self.client.xclaim(stream, GROUP, batcher_id, 0, entry_ids)
        for entry_id, fields in claimed:
            self._requeue_or_fail(stream, entry_id, fields, batcher_id)
        return len(claimed)

    def _requeue_or_fail(
        self, stream: str, entry_id: bytes, fields: dict[bytes, bytes], batcher_id: str
    ) -> None:
        request = entry_message(fields, SubmitRequest)  # only submits reach the queue streams
        is_final = self.client.exists(self.keys.final(request.request_id))
        if not is_final and request.attempt >= self.config.max_attempts:
            self.publish_final(failed_result(request, batcher_id))
        pipe = self.client.pipeline()
        if not is_final and request.attempt < self.config.max_attempts:
            retry = dataclasses.replace(request, attempt=request.attempt + 1)
            pipe.xadd(stream, message_fields(retry))
        pipe.xack(stream, GROUP, entry_id)
        pipe.xdel(stream, entry_id)
        pipe.execute()


def _socket_timeout_s(client: redis.Redis) -> float | None:
    """The client's socket timeout, as its connections have it (redis-py 8 sets 5 s unless told
    otherwise)."""
    connection = client.connection_pool.get_connection()
    try:
        return connection.socket_timeout
    finally:
        client.connection_pool.release(connection)
