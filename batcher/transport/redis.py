"""Redis transport: many api replicas and batchers on one Redis. The key layout and why each
key is what it is: `batcher/transport/redis_keys.py`.

Reclaim uses XPENDING (entries idle >= lease, with their owner) and XCLAIM with the same min idle
time, so of two racing reclaimers only one wins an entry; the winner requeues it with attempt + 1
(XADD + XACK + XDEL in one MULTI) or fails it past `max_attempts`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
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
    decode,
    encode,
)
from tgq.batcher.request import Priority
from tgq.batcher.transport.base import (
    MAX_STARTED_LOG,
    Delivery,
    StoredFinal,
    TransportConfig,
    failed_result,
)
from tgq.batcher.transport.redis_keys import (
    AFTER_EVENTS_ID,
    END_ID,
    GROUP,
    PERSISTERS,
    RedisKeys,
    event_id,
)

log = logging.getLogger(__name__)
_M = TypeVar("_M", TokenEvent, FinalResult, Heartbeat, AbortRequest)

MAX_ABORT_LOG = 10_000
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


class RedisTransport:
    def __init__(
        self, client: redis.Redis, prefix: str = "tgq", config: TransportConfig | None = None
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.keys = RedisKeys(prefix)
        self.config = config or TransportConfig()
        self._publish_final = client.register_script(_PUBLISH_FINAL)
        self._held: dict[str, list[Delivery]] = {}  # pulled past max_count, returned next pull
        self._abort_cursors: dict[str, str] = {}
        self._max_block_ms = _max_block_ms(client)
        self._create_groups()

    def _create_groups(self) -> None:
        """Idempotent; run again when Redis lost the streams (restarted without persistence)."""
        groups = [(self.keys.queue(p), GROUP) for p in Priority] + [(self.keys.finals, PERSISTERS)]
        for stream, group in groups:
            try:
                self.client.xgroup_create(stream, group, id="0", mkstream=True)
            except redis.ResponseError as error:
                if "BUSYGROUP" not in str(error):
                    raise

    def _recreated_lost_groups(self, error: redis.ResponseError) -> bool:
        if "NOGROUP" not in str(error):
            return False
        log.warning("the request streams are gone (Redis restarted empty?); recreating them")
        self._create_groups()
        return True

    @classmethod
    def from_url(
        cls, url: str, prefix: str = "tgq", config: TransportConfig | None = None
    ) -> RedisTransport:
        return cls(redis.Redis.from_url(url), prefix, config)

    # api side

    def submit(self, request: SubmitRequest) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.xadd(self.keys.queue(request.priority), {"m": encode(request)})
        pipe.set(self.keys.known(request.request_id), 1, px=_ms(self.config.final_ttl_s))
        pipe.execute()

    def missing(self, request_ids: list[str]) -> list[str]:
        pipe = self.client.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.exists(self.keys.known(request_id))
        return [r for r, known in zip(request_ids, pipe.execute(), strict=True) if not known]

    def abort(self, request_id: str, reason: str = "aborted by client") -> None:
        pipe = self.client.pipeline()
        pipe.set(self.keys.abort(request_id), 1, px=_ms(self.config.final_ttl_s))
        message = encode(AbortRequest(request_id, reason))
        pipe.xadd(self.keys.aborts, {"m": message}, maxlen=MAX_ABORT_LOG, approximate=True)
        pipe.execute()

    def read_tokens(self, request_id: str, from_seq: int, timeout_s: float) -> list[TokenEvent]:
        key = self.keys.tokens(request_id)
        entries: Any
        if timeout_s > 0:  # one command: XREAD returns at once when entries are already there
            found: Any = self.client.xread({key: f"0-{from_seq}"}, block=self._block(timeout_s))
            entries = found[0][1] if found else []
        else:
            entries = self.client.xrange(key, event_id(from_seq), "+")
        return [
            decode_event(fields) for entry_id, fields in entries if entry_id_str(entry_id) != END_ID
        ]

    def read_final(self, request_id: str, timeout_s: float = 0.0) -> FinalResult | None:
        """The final result, waiting up to `timeout_s` for it: in blocking reads of at most
        the client's cap, so a long wait is not cut to one cap."""
        key, deadline = self.keys.final(request_id), time.monotonic() + timeout_s
        data: Any = self.client.get(key)
        while data is None and (left_s := deadline - time.monotonic()) > 0:
            tokens = self.keys.tokens(request_id)
            ended: Any = self.client.xread(
                {tokens: AFTER_EVENTS_ID}, block=max(1, self._block(left_s))
            )
            data = self.client.get(key)
            if ended and data is None:  # the end marker without a final: none will come
                break
        return None if data is None else decode_final(data)

    def live_batchers(self) -> list[Heartbeat]:
        keys = list(self.client.scan_iter(match=self.keys.heartbeat("*")))
        values: Any = self.client.mget(keys) if keys else []
        return [decode_heartbeat(v) for v in values if v is not None]

    def queue_depth(self) -> int:
        pipe = self.client.pipeline(transaction=False)
        for priority in Priority:
            pipe.xlen(self.keys.queue(priority))
        return sum(pipe.execute())

    def pull_finals(self, consumer: str, max_count: int, block_ms: int) -> list[StoredFinal]:
        stream, lease_ms = self.keys.finals, _ms(self.config.lease_s)
        try:
            claimed: Any = self.client.xautoclaim(
                stream, PERSISTERS, consumer, lease_ms, count=max_count
            )
            entries = list(claimed[1])
            if len(entries) < max_count:
                block = self._block(block_ms / 1000) if block_ms > 0 else None
                found: Any = self.client.xreadgroup(
                    PERSISTERS, consumer, {stream: ">"}, max_count - len(entries), block
                )
                entries += found[0][1] if found else []
        except redis.ResponseError as error:
            if not self._recreated_lost_groups(error):
                raise
            return []
        return [
            StoredFinal(entry_id_str(entry_id), decode_final(f[b"m"]))
            for entry_id, f in entries
            if f
        ]

    def ack_finals(self, entry_ids: list[str]) -> None:
        if entry_ids:
            pipe = self.client.pipeline()
            pipe.xack(self.keys.finals, PERSISTERS, *entry_ids)
            pipe.xdel(self.keys.finals, *entry_ids)
            pipe.execute()

    def read_started(
        self, cursor: str | None, max_count: int, block_ms: int
    ) -> tuple[str, list[str]]:
        stream = self.keys.started
        if cursor is None:
            last: Any = self.client.xrevrange(stream, "+", "-", count=1)
            return (entry_id_str(last[0][0]) if last else "0-0"), []
        block = self._block(block_ms / 1000) if block_ms > 0 else None
        found: Any = self.client.xread({stream: cursor}, count=max_count, block=block)
        return started_ids(cursor, found)

    # batcher side

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
        try:
            if block_ms is not None:
                block_ms = min(block_ms, self._max_block_ms)
            found: Any = self.client.xreadgroup(GROUP, batcher_id, streams, count, block_ms)
        except redis.ResponseError as error:
            if not self._recreated_lost_groups(error):
                raise
            return []
        deliveries = []
        for stream, entries in found or []:
            for entry_id, fields in entries:
                try:
                    request = decode(fields[b"m"])
                    if not isinstance(request, SubmitRequest):
                        raise MessageError(f"a {type(request).__name__} in a request queue")
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
            pipe.xadd(key, {"m": encode(event)}, id=event_id(event.seq_index))
            if event.seq_index % EXPIRY_REFRESH_EVERY == 0:
                pipe.pexpire(key, _ms(self.config.token_ttl_s))
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
            _ms(config.final_ttl_s),
            _ms(config.token_ttl_s),
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
        pipe.xadd(stream, {"m": encode(delivery.request)})
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
        found: Any = self.client.xread({stream: cursor}, count=MAX_ABORT_LOG)
        entries = found[0][1] if found else []
        if entries:
            self._abort_cursors[batcher_id] = entry_id_str(entries[-1][0])
        return [_abort(fields).request_id for _, fields in entries]

    def heartbeat(self, beat: Heartbeat) -> None:
        key = self.keys.heartbeat(beat.batcher_id)
        self.client.set(key, encode(beat), px=_ms(self.config.heartbeat_ttl_s))

    def reclaim(self, batcher_id: str, max_count: int = 100) -> int:
        num_reclaimed = 0
        for priority in _PRIORITY_ORDER:
            num_reclaimed += self._reclaim_stream(self.keys.queue(priority), batcher_id, max_count)
        return num_reclaimed

    def _reclaim_stream(self, stream: str, batcher_id: str, max_count: int) -> int:
        lease_ms = _ms(self.config.lease_s)
        try:
            pending: Any = self.client.xpending_range(
                stream, GROUP, "-", "+", max_count, idle=lease_ms
            )
        except redis.ResponseError as error:
            if not self._recreated_lost_groups(error):
                raise
            return 0
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
        num_recovered = 0
        for priority in _PRIORITY_ORDER:
            stream = self.keys.queue(priority)
            pending: Any = self.client.xpending_range(
                stream, GROUP, "-", "+", max_count, consumername=batcher_id
            )
            if pending:
                entry_ids = [entry["message_id"] for entry in pending]
                claimed: Any = self.client.xclaim(stream, GROUP, batcher_id, 0, entry_ids)
                for entry_id, fields in claimed:
                    self._requeue_or_fail(stream, entry_id, fields, batcher_id)
                num_recovered += len(claimed)
        return num_recovered

    def _requeue_or_fail(
        self, stream: str, entry_id: bytes, fields: dict[bytes, bytes], batcher_id: str
    ) -> None:
        request = decode(fields[b"m"])
        assert isinstance(request, SubmitRequest)  # only submits reach the queue streams
        is_final = self.client.exists(self.keys.final(request.request_id))
        if not is_final and request.attempt >= self.config.max_attempts:
            self.publish_final(failed_result(request, batcher_id))
        pipe = self.client.pipeline()
        if not is_final and request.attempt < self.config.max_attempts:
            retry = dataclasses.replace(request, attempt=request.attempt + 1)
            pipe.xadd(stream, {"m": encode(retry)})
        pipe.xack(stream, GROUP, entry_id)
        pipe.xdel(stream, entry_id)
        pipe.execute()

    def _block(self, timeout_s: float) -> int:
        return min(_ms(timeout_s), self._max_block_ms)


def started_ids(cursor: str, found: Any) -> tuple[str, list[str]]:
    """(next cursor, request ids) of an XREAD on the started log."""
    entries = found[0][1] if found else []
    if not entries:
        return cursor, []
    ids = [fields[b"r"].decode() for _, fields in entries]
    return entry_id_str(entries[-1][0]), ids


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _max_block_ms(client: redis.Redis) -> int:
    """The longest a blocking read may wait: half a second under the client's socket timeout
    (redis-py 8 sets 5 s by default), or the read fails with a TimeoutError instead of returning
    empty. Blocking reads return early then; their callers loop."""
    connection = client.connection_pool.get_connection()
    try:
        timeout = connection.socket_timeout
    finally:
        client.connection_pool.release(connection)
    return 2**31 - 1 if timeout is None else max(1, round(timeout * 1000) - 500)


def entry_id_str(entry_id: bytes | str) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id


def _typed(data: bytes, kind: type[_M]) -> _M:
    message = decode(data)
    if not isinstance(message, kind):
        raise MessageError(f"expected a {kind.__name__}, got a {type(message).__name__}")
    return message


def decode_event(fields: dict[bytes, bytes]) -> TokenEvent:
    return _typed(fields[b"m"], TokenEvent)


def decode_final(data: bytes) -> FinalResult:
    return _typed(data, FinalResult)


def decode_heartbeat(data: bytes) -> Heartbeat:
    return _typed(data, Heartbeat)


def _abort(fields: dict[bytes, bytes]) -> AbortRequest:
    return _typed(fields[b"m"], AbortRequest)
