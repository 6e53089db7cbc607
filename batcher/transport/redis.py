"""The batcher's side of the Redis transport (synchronous, as the batcher's step loop is):
pull requests, publish their tokens and final results, ack, heartbeat, reclaim. The api's side
is `aio.AsyncRedisApiTransport`; what both share (key names, entry encoding, consumer groups):
`redis_keys.py` and `redis_wire.py`.

Reclaim uses XPENDING (entries idle >= lease, with their owner) and XCLAIM with the same min idle
time, so of two racing reclaimers only one wins an entry; the winner requeues it with attempt + 1
(XADD + XACK + XDEL in one MULTI) or fails it past `max_attempts`.

Routed queues (`routing.py`): a batcher reads its own routed stream before the shared one, priority
by priority. Once its heartbeat is gone, reclaim moves what was routed to it to the shared queue:
pending entries as above, undelivered ones read through the group (so one reclaimer gets each)
and moved with the same attempt; then one script deletes its emptied streams, unless it beats
again.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.typing import EncodableT, KeyT, StreamIdT

from tgq.batcher.kv_manager import BlockHash
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
    CREATE_GROUPS_LOOP,
    block_cap_ms,
    entry_id_str,
    entry_message,
    is_missing_group,
    message_fields,
    ms,
    stream_entries,
)
from tgq.batcher.transport.routing import summary_member

log = logging.getLogger(__name__)
_T = TypeVar("_T")

EXPIRY_REFRESH_EVERY = 32  # token events; one PEXPIRE per event would double the ops per token
_PRIORITY_ORDER = sorted(Priority, reverse=True)  # interactive first

# A batcher with no heartbeat and empty routed streams is forgotten (streams, prefixes, its id in
# the routed set), in one step: the api's routed XADD checks the same heartbeat.
_FORGET_ROUTED = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
for i = 4, #KEYS do
  if redis.call('XLEN', KEYS[i]) > 0 then return 0 end
end
redis.call('DEL', unpack(KEYS, 3))
redis.call('SREM', KEYS[2], ARGV[1])
return 1
"""

# Up to ARGV[3] new entries from the streams KEYS, in order (a batcher's routed queue, then the
# shared one, priority by priority): exact counts in one round trip, which a multi-stream
# XREADGROUP (COUNT per stream) cannot give. Replies as XREADGROUP's, raw. Missing groups are
# created first (as `CREATE_GROUPS`): a NOGROUP error halfway would strand what was read before.
_READ_IN_ORDER = (
    CREATE_GROUPS_LOOP
    + """
local found, left = {}, tonumber(ARGV[3])
for _, stream in ipairs(KEYS) do
  if left <= 0 then break end
  local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', left, 'STREAMS',
    stream, '>')
  if reply then
    table.insert(found, reply[1])
    left = left - #reply[1][2]
  end
end
return found
"""
)

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
        self._forget_routed = client.register_script(_FORGET_ROUTED)
        self._read_in_order = client.register_script(_READ_IN_ORDER)
        self._held: dict[str, list[Delivery]] = {}  # pulled past max_count, returned next pull
        self._abort_cursors: dict[str, str] = {}
        self._max_block_ms = block_cap_ms(_socket_timeout_s(client))

    @classmethod
    def from_url(
        cls, url: str, prefix: str = "tgq", config: TransportConfig | None = None
    ) -> RedisBatcherTransport:
        return cls(redis.Redis.from_url(url), prefix, config)

    def _in_group(self, command: Callable[[], _T], streams: list[str]) -> _T:
        """Runs a command on `streams`' consumer group, creating the group first where it is
        missing (`redis_wire.py`)."""
        try:
            return command()
        except redis.ResponseError as error:
            if not is_missing_group(error):
                raise
        log.info("no consumer group %r on the request queues (a new or emptied Redis)", GROUP)
        self._create_groups(keys=streams, args=[GROUP])
        return command()

    def _streams(self, batcher_id: str, priorities: list[Priority]) -> list[str]:
        """The queues the batcher reads, in order: per priority, its routed one, then shared."""
        return [
            stream
            for p in priorities
            for stream in (self.keys.routed(p, batcher_id), self.keys.queue(p))
        ]

    def pull(
        self, batcher_id: str, max_count: int, block_ms: int, *, above: Priority | None = None
    ) -> list[Delivery]:
        if above is not None:  # never blocks; what is held for this batcher stays held
            outranking = [p for p in _PRIORITY_ORDER if p > above]
            streams = self._streams(batcher_id, outranking)
            return self._mark_aborted(self._read_streams(batcher_id, streams, max_count))
        held = self._held.pop(batcher_id, [])
        deliveries, rest = held[:max_count], held[max_count:]
        if len(deliveries) < max_count:
            streams = self._streams(batcher_id, _PRIORITY_ORDER)
            deliveries += self._read_streams(batcher_id, streams, max_count - len(deliveries))
        if not deliveries and block_ms > 0:
            # One entry per stream at most; the extra ones are held for the next pull.
            streams = self._streams(batcher_id, _PRIORITY_ORDER)
            found = self._read_group(batcher_id, streams, 1, block_ms)
            deliveries, rest = found[:max_count], found[max_count:]
        if rest:
            self._held[batcher_id] = rest
        return self._mark_aborted(deliveries)

    def _read_group(
        self, batcher_id: str, streams: list[str], count: int, block_ms: int | None
    ) -> list[Delivery]:
        cursors: dict[KeyT, StreamIdT] = {stream: ">" for stream in streams}
        if block_ms is not None:
            block_ms = min(block_ms, self._max_block_ms)
        found: Any = self._in_group(
            lambda: self.client.xreadgroup(GROUP, batcher_id, cursors, count, block_ms), streams
        )
        return self._deliveries(found or [])

    def _read_streams(self, batcher_id: str, streams: list[str], count: int) -> list[Delivery]:
        """Up to `count` new entries of `streams`, in their order, at once."""
        if not streams or count <= 0:
            return []
        found: Any = self._read_in_order(keys=streams, args=[GROUP, batcher_id, count])
        return self._deliveries(
            [
                (
                    stream,
                    [(entry_id, dict(_pairwise_fields(fields))) for entry_id, fields in entries],
                )
                for stream, entries in found
            ]
        )

    def _deliveries(self, found: list[Any]) -> list[Delivery]:
        """The requests of an XREADGROUP reply (stream, [(entry id, fields)]); a malformed entry
        is logged and deleted."""
        deliveries = []
        for stream, entries in found:
            for entry_id, fields in entries:
                try:
                    request = entry_message(fields, SubmitRequest)
                except (KeyError, MessageError) as error:
                    log.error(
                        "dropping malformed queue entry %s: %s", entry_id_str(entry_id), error
                    )
                    self._delete(stream, entry_id)
                    continue
                queue = entry_id_str(stream)
                deliveries.append(Delivery(entry_id_str(entry_id), request, queue=queue))
        return deliveries

    def _mark_aborted(self, deliveries: list[Delivery]) -> list[Delivery]:
        if not deliveries:
            return deliveries
        pipe = self.client.pipeline()
        for delivery in deliveries:
            pipe.exists(self.keys.abort(delivery.request.request_id))
        flags = pipe.execute()
        return [
            dataclasses.replace(d, is_aborted=bool(f))
            for d, f in zip(deliveries, flags, strict=True)
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
        self._delete(delivery.queue, delivery.entry_id)

    def _delete(self, stream: str | bytes, entry_id: str | bytes) -> None:
        pipe = self.client.pipeline()
        pipe.xack(stream, GROUP, entry_id)
        pipe.xdel(stream, entry_id)
        pipe.execute()

    def release(self, batcher_id: str, delivery: Delivery) -> None:
        pipe = self.client.pipeline()
        pipe.xadd(self.keys.queue(delivery.request.priority), message_fields(delivery.request))
        pipe.xack(delivery.queue, GROUP, delivery.entry_id)
        pipe.xdel(delivery.queue, delivery.entry_id)
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

    def publish_prefixes(self, batcher_id: str, keys: list[BlockHash], *, replace: bool) -> None:
        key = self.keys.prefixes(batcher_id)
        pipe = self.client.pipeline()
        if replace:
            pipe.delete(key)
        if keys:
            pipe.sadd(key, *(summary_member(k) for k in keys))
        pipe.pexpire(key, ms(self.config.heartbeat_ttl_s))
        pipe.execute()

    def reclaim(self, batcher_id: str, max_count: int = 100) -> int:
        num_reclaimed = 0
        for priority in _PRIORITY_ORDER:
            num_reclaimed += self._reclaim_stream(self.keys.queue(priority), batcher_id, max_count)
        return num_reclaimed + self._reclaim_routed(batcher_id, max_count)

    def _reclaim_routed(self, batcher_id: str, max_count: int) -> int:
        """What was routed to dead batchers, and routed entries pending to dead consumers, back
        to the shared queues; a dead batcher's emptied streams deleted."""
        members: Any = self.client.smembers(self.keys.routed_batchers)
        owners = sorted(member.decode() for member in members)
        pipe = self.client.pipeline()
        for owner in owners:
            pipe.exists(self.keys.heartbeat(owner))
        num_moved = 0
        for owner, is_alive in zip(owners, pipe.execute(), strict=True):
            streams = [self.keys.routed(p, owner) for p in _PRIORITY_ORDER]
            for priority, stream in zip(_PRIORITY_ORDER, streams, strict=True):
                shared = self.keys.queue(priority)
                num_moved += self._reclaim_stream(stream, batcher_id, max_count, shared)
                if not is_alive:
                    num_moved += self._move_undelivered(stream, batcher_id, max_count, shared)
            if not is_alive:
                keys = [self.keys.heartbeat(owner), self.keys.routed_batchers]
                self._forget_routed(keys=[*keys, self.keys.prefixes(owner), *streams], args=[owner])
        return num_moved

    def _move_undelivered(self, stream: str, batcher_id: str, max_count: int, to: str) -> int:
        """Entries of `stream` nobody pulled yet, to the stream `to`, same attempt (they never
        ran). Read through the group, so racing reclaimers never move one twice; one that dies
        in between leaves them pending to itself, reclaimed after the lease."""
        found: Any = self._in_group(
            lambda: self.client.xreadgroup(GROUP, batcher_id, {stream: ">"}, max_count), [stream]
        )
        entries = stream_entries(found)
        if entries:
            pipe = self.client.pipeline()
            for entry_id, fields in entries:
                pipe.xadd(to, fields)
                pipe.xack(stream, GROUP, entry_id)
                pipe.xdel(stream, entry_id)
            pipe.execute()
        return len(entries)

    def _reclaim_stream(
        self, stream: str, batcher_id: str, max_count: int, to: str | None = None
    ) -> int:
        """Entries of `stream` pending to dead batchers past the lease, requeued to the stream
        `to` (None: the same)."""
        lease_ms = ms(self.config.lease_s)
        pending: Any = self._in_group(
            lambda: self.client.xpending_range(stream, GROUP, "-", "+", max_count, idle=lease_ms),
            [stream],
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
            self._requeue_or_fail(stream, entry_id, fields, batcher_id, to or stream)
        return len(claimed)

    def recover(self, batcher_id: str, max_count: int = 1000) -> int:
        """Its routed entries too, to the shared queue: a new process holds no prefixes."""
        return sum(
            self._recover_stream(stream, batcher_id, max_count, self.keys.queue(priority))
            for priority in _PRIORITY_ORDER
            for stream in (self.keys.routed(priority, batcher_id), self.keys.queue(priority))
        )

    def _recover_stream(self, stream: str, batcher_id: str, max_count: int, to: str) -> int:
        pending: Any = self._in_group(
            lambda: self.client.xpending_range(
                stream, GROUP, "-", "+", max_count, consumername=batcher_id
            ),
            [stream],
        )
        if not pending:
            return 0
        entry_ids = [entry["message_id"] for entry in pending]
        claimed: Any = self.client.xclaim(stream, GROUP, batcher_id, 0, entry_ids)
        for entry_id, fields in claimed:
            self._requeue_or_fail(stream, entry_id, fields, batcher_id, to)
        return len(claimed)

    def _requeue_or_fail(
        self, stream: str, entry_id: bytes, fields: dict[bytes, bytes], batcher_id: str, to: str
    ) -> None:
        request = entry_message(fields, SubmitRequest)  # only submits reach the queue streams
        is_final = self.client.exists(self.keys.final(request.request_id))
        if not is_final and request.attempt >= self.config.max_attempts:
            self.publish_final(failed_result(request, batcher_id))
        pipe = self.client.pipeline()
        if not is_final and request.attempt < self.config.max_attempts:
            retry = dataclasses.replace(request, attempt=request.attempt + 1)
            pipe.xadd(to, message_fields(retry))
        pipe.xack(stream, GROUP, entry_id)
        pipe.xdel(stream, entry_id)
        pipe.execute()


def _pairwise_fields(fields: list[bytes]) -> list[tuple[bytes, bytes]]:
    """A raw reply's flat field list [name, value, ...] as pairs."""
    return list(zip(fields[::2], fields[1::2], strict=True))


def _socket_timeout_s(client: redis.Redis) -> float | None:
    """The client's socket timeout, as its connections have it (redis-py 8 sets 5 s unless told
    otherwise)."""
    connection = client.connection_pool.get_connection()
    try:
        return connection.socket_timeout
    finally:
        client.connection_pool.release(connection)
