"""In-process transport (`tgq serve` without Redis, fast tests): the Redis contract in a lock.

Thread-safe: one lock guards all state and one condition wakes every waiter on any change.
Unlike Redis, token events and final results never expire: they live as long as the process.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from tgq.batcher.kv_manager import BlockHash
from tgq.batcher.messages import FinalResult, Heartbeat, SubmitRequest, TokenEvent
from tgq.batcher.request import Priority
from tgq.batcher.transport.base import (
    MAX_STARTED_LOG,
    Delivery,
    StoredFinal,
    TransportConfig,
    failed_result,
)

_PRIORITY_ORDER = sorted(Priority, reverse=True)  # interactive first


@dataclass(slots=True)
class _Pending:
    owner: str
    since: float  # monotonic time of the (latest) delivery
    request: SubmitRequest


class MemoryTransport:
    def __init__(self, config: TransportConfig | None = None) -> None:
        self.config = config or TransportConfig()
        self._changed = threading.Condition(threading.Lock())
        self._queues: dict[Priority, deque[tuple[str, SubmitRequest]]] = {
            p: deque() for p in Priority
        }
        self._pending: dict[str, _Pending] = {}
        self._events: dict[str, list[TokenEvent]] = {}
        self._finals: dict[str, FinalResult] = {}
        self._aborted: set[str] = set()
        self._abort_log: list[str] = []
        self._abort_cursors: dict[str, int] = {}
        self._heartbeats: dict[str, tuple[Heartbeat, float]] = {}  # beat, monotonic expiry
        self._entry_ids = itertools.count(1)
        self._unpersisted: deque[StoredFinal] = deque()  # finals no persister has taken yet
        self._watchers: dict[str, list[Callable[[], object]]] = {}  # see watch()
        self._persisting: dict[str, tuple[str, float, StoredFinal]] = {}  # consumer, since
        self._started: list[str] = []  # request ids, in the order of their first event
        self._known: set[str] = set()  # every request id ever submitted (nothing is lost here)
        self._started_base = 0  # how many the cap has dropped from the front

    # api side

    def submit(self, request: SubmitRequest) -> None:
        with self._changed:
            self._known.add(request.request_id)
            self._queues[request.priority].append((str(next(self._entry_ids)), request))
            self._changed.notify_all()

    def abort(self, request_id: str, reason: str = "aborted by client") -> None:
        with self._changed:
            self._aborted.add(request_id)
            self._abort_log.append(request_id)
            self._changed.notify_all()

    def read_tokens(self, request_id: str, from_seq: int, timeout_s: float) -> list[TokenEvent]:
        with self._changed:
            self._changed.wait_for(
                lambda: (
                    len(self._events.get(request_id, ())) > from_seq or request_id in self._finals
                ),
                timeout_s,
            )
            return self._events.get(request_id, [])[from_seq:]

    def watch(self, request_id: str, from_seq: int, wake: Callable[[], object]) -> bool:
        """For a reader on an event loop: False when `read_tokens(request_id, from_seq, 0)`
        has something now (events past `from_seq`, or the final result); else `wake` is called
        once, from the publishing thread, when it does, and True is returned. `wake` must not
        block (e.g. `loop.call_soon_threadsafe(...)`); `unwatch` drops it unused."""
        with self._changed:
            if len(self._events.get(request_id, ())) > from_seq or request_id in self._finals:
                return False
            self._watchers.setdefault(request_id, []).append(wake)
            return True

    def unwatch(self, request_id: str, wake: Callable[[], object]) -> None:
        with self._changed:
            waiting = self._watchers.get(request_id, [])
            if wake in waiting:
                waiting.remove(wake)
            if not waiting:
                self._watchers.pop(request_id, None)

    def _wake(self, request_id: str) -> None:
        """Under the lock: the watchers of `request_id`, once each."""
        for wake in self._watchers.pop(request_id, ()):
            wake()

    def read_final(self, request_id: str, timeout_s: float = 0.0) -> FinalResult | None:
        with self._changed:
            self._changed.wait_for(lambda: request_id in self._finals, timeout_s)
            return self._finals.get(request_id)

    def live_batchers(self) -> list[Heartbeat]:
        now = time.monotonic()
        with self._changed:
            return [beat for beat, expiry in self._heartbeats.values() if expiry > now]

    def queue_depth(self) -> int:
        with self._changed:
            return sum(len(queue) for queue in self._queues.values()) + len(self._pending)

    def pull_finals(self, consumer: str, max_count: int, block_ms: int) -> list[StoredFinal]:
        with self._changed:
            self._changed.wait_for(lambda: bool(self._unpersisted), block_ms / 1000)
            now = time.monotonic()
            stale = [
                entry_id
                for entry_id, (owner, since, _) in self._persisting.items()
                if owner != consumer and now - since >= self.config.lease_s
            ]
            taken = [self._persisting.pop(entry_id)[2] for entry_id in stale[:max_count]]
            while self._unpersisted and len(taken) < max_count:
                taken.append(self._unpersisted.popleft())
            for stored in taken:
                self._persisting[stored.entry_id] = (consumer, now, stored)
            return taken

    def ack_finals(self, entry_ids: list[str]) -> None:
        with self._changed:
            for entry_id in entry_ids:
                self._persisting.pop(entry_id, None)

    def missing(self, request_ids: list[str]) -> list[str]:
        with self._changed:
            return [r for r in request_ids if r not in self._known]

    def read_started(
        self, cursor: str | None, max_count: int, block_ms: int
    ) -> tuple[str, list[str]]:
        with self._changed:
            end = self._started_base + len(self._started)
            if cursor is None:
                return str(end), []
            start = max(int(cursor), self._started_base)
            self._changed.wait_for(
                lambda: self._started_base + len(self._started) > start, block_ms / 1000
            )
            offset = start - self._started_base
            ids = self._started[offset : offset + max_count]
            return str(start + len(ids)), ids

    # batcher side

    def pull(
        self, batcher_id: str, max_count: int, block_ms: int, *, above: Priority | None = None
    ) -> list[Delivery]:
        with self._changed:
            if above is None:
                self._changed.wait_for(lambda: any(self._queues.values()), block_ms / 1000)
            deliveries: list[Delivery] = []
            for priority in _PRIORITY_ORDER:
                if above is not None and priority <= above:
                    break
                queue = self._queues[priority]
                while queue and len(deliveries) < max_count:
                    entry_id, request = queue.popleft()
                    self._pending[entry_id] = _Pending(batcher_id, time.monotonic(), request)
                    is_aborted = request.request_id in self._aborted
                    deliveries.append(Delivery(entry_id, request, is_aborted))
            return deliveries

    def publish_tokens(self, events: list[TokenEvent]) -> None:
        with self._changed:
            for event in events:
                published = self._events.setdefault(event.request_id, [])
                # First event per seq index wins; nothing after the final result.
                if event.seq_index == len(published) and event.request_id not in self._finals:
                    published.append(event)
                    self._wake(event.request_id)
                if event.seq_index == 0:
                    self._started.append(event.request_id)
            if len(self._started) > MAX_STARTED_LOG:  # the oldest half goes, as Redis caps it
                dropped = len(self._started) // 2
                del self._started[:dropped]
                self._started_base += dropped
            self._changed.notify_all()

    def publish_final(self, result: FinalResult) -> bool:
        with self._changed:
            if result.request_id in self._finals:
                return False
            self._store_final(result)
            self._changed.notify_all()
            return True

    def _store_final(self, result: FinalResult) -> None:
        self._finals[result.request_id] = result
        self._wake(result.request_id)
        self._unpersisted.append(StoredFinal(str(next(self._entry_ids)), result))

    def ack(self, batcher_id: str, delivery: Delivery) -> None:
        with self._changed:
            pending = self._pending.get(delivery.entry_id)
            if pending is not None and pending.owner == batcher_id:
                del self._pending[delivery.entry_id]

    def release(self, batcher_id: str, delivery: Delivery) -> None:
        with self._changed:
            pending = self._pending.get(delivery.entry_id)
            if pending is not None and pending.owner == batcher_id:
                del self._pending[delivery.entry_id]
                entry = (str(next(self._entry_ids)), pending.request)
                self._queues[pending.request.priority].append(entry)
                self._changed.notify_all()

    def poll_aborts(self, batcher_id: str) -> list[str]:
        with self._changed:
            start = self._abort_cursors.get(batcher_id, len(self._abort_log))
            self._abort_cursors[batcher_id] = len(self._abort_log)
            return self._abort_log[start:]

    def heartbeat(self, beat: Heartbeat) -> None:
        expiry = time.monotonic() + self.config.heartbeat_ttl_s
        with self._changed:
            self._heartbeats[beat.batcher_id] = (beat, expiry)

    def publish_prefixes(self, batcher_id: str, keys: list[BlockHash], *, replace: bool) -> None:
        """Nothing to route to: one process runs one batcher."""

    def reclaim(self, batcher_id: str, max_count: int = 100) -> int:
        now = time.monotonic()
        with self._changed:
            live = {b for b, (_, expiry) in self._heartbeats.items() if expiry > now}
            expired = [
                entry_id
                for entry_id, p in self._pending.items()
                if p.owner not in live and now - p.since >= self.config.lease_s
            ][:max_count]
            for entry_id in expired:
                self._requeue_or_fail(entry_id, batcher_id)
            self._changed.notify_all()
            return len(expired)

    def recover(self, batcher_id: str, max_count: int = 1000) -> int:
        with self._changed:
            own = [e for e, p in self._pending.items() if p.owner == batcher_id][:max_count]
            for entry_id in own:
                self._requeue_or_fail(entry_id, batcher_id)
            self._changed.notify_all()
            return len(own)

    def _requeue_or_fail(self, entry_id: str, batcher_id: str) -> None:
        request = self._pending.pop(entry_id).request
        if request.request_id in self._finals:
            return  # it finished; only the ack was lost
        if request.attempt >= self.config.max_attempts:
            self._store_final(failed_result(request, batcher_id))
            return
        retry = replace(request, attempt=request.attempt + 1)
        self._queues[request.priority].append((str(next(self._entry_ids)), retry))
