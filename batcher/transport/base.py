"""The transport contract, as both sides see it. Two backends honour it, and
`tests/batcher/test_transport_contract.py` runs the same tests against both: in process
(`memory.MemoryTransport`, both sides in one object) and Redis, whose batcher side is
`redis.RedisBatcherTransport` (synchronous, the batcher's) and whose api side is
`aio.AsyncRedisApiTransport` (asyncio, the api's; `blocking.BlockingApiTransport` serves it to
synchronous callers).

Lifecycle of a request:

    api: submit ──▶ queue[priority] ──pull──▶ batcher (pending, owned by it)
                                               │ publish_tokens (seq 0, 1, ...)
                                               │ publish_final  (durable; first one wins)
                                               ▼ ack            (only after publish_final)

Every stored final result is also queued for the api's persisters (`pull_finals`, `ack_finals`):
the record in Postgres is written from there, whether or not a client still waits for it.

A request pulled but not acked stays pending to its batcher. When that batcher's heartbeat expires
and the entry has been pending longer than the lease, any batcher's `reclaim` requeues it with
`attempt + 1`, or, past `max_attempts`, publishes a "failed" final result and acks it. A rerun
replays seq indices from 0: the transport keeps the first event per (request, seq index), so a
reader never sees an index twice (with greedy or seeded sampling the rerun's events are the same).
Anything published after a request's final result is dropped, and so is a second final result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tgq.batcher.kv_manager import BlockHash
from tgq.batcher.messages import FinalResult, Heartbeat, SubmitRequest, TokenEvent
from tgq.batcher.request import FinishReason, Priority

MAX_STARTED_LOG = 100_000  # the started log keeps about this many of the latest ids


@dataclass(frozen=True, slots=True)
class TransportConfig:
    max_attempts: int = 3
    lease_s: float = 30.0  # a pending entry is reclaimable only after this long
    heartbeat_ttl_s: float = 10.0  # a batcher silent this long is presumed dead
    token_ttl_s: float = 3600.0  # token events live this long after the last one
    final_ttl_s: float = 86400.0  # a final result lives this long (the api persists it sooner)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")


@dataclass(frozen=True, slots=True)
class Delivery:
    """A pulled request, pending to the batcher until acked. `entry_id` is the transport's handle;
    `is_aborted`: an abort for it arrived before it was pulled; `queue`: the transport's queue
    that holds it (Redis: the shared stream or the batcher's routed one; "" in process)."""

    entry_id: str
    request: SubmitRequest
    is_aborted: bool = False
    queue: str = ""


@dataclass(frozen=True, slots=True)
class StoredFinal:
    """A final result waiting to be persisted; `entry_id` acks it."""

    entry_id: str
    result: FinalResult


def failed_result(request: SubmitRequest, batcher_id: str) -> FinalResult:
    detail = f"failed after {request.attempt} attempts: the batcher running it died each time"
    return FinalResult(
        request_id=request.request_id,
        token_ids=[],
        finish_reason=FinishReason.FAILED,
        finish_detail=detail,
        num_prompt_tokens=len(request.prompt_token_ids),
        num_output_tokens=0,
        num_cached_tokens=0,
        attempt=request.attempt,
        batcher_id=batcher_id,
    )


class ApiTransport(Protocol):
    """What the api does: enqueue, cancel, follow a request's tokens, read its result. The api
    awaits these calls (`aio.AsyncApiTransport`); this synchronous form is the in-process
    backend's, which the api runs on threads, and `BlockingApiTransport`'s."""

    def submit(self, request: SubmitRequest) -> None: ...

    def abort(self, request_id: str, reason: str = "aborted by client") -> None: ...

    def read_tokens(self, request_id: str, from_seq: int, timeout_s: float) -> list[TokenEvent]:
        """Events with seq index >= `from_seq`, in order; waits up to `timeout_s` for the first
        one, returns [] on timeout or when the request is final and has no more."""
        ...

    def read_final(self, request_id: str, timeout_s: float = 0.0) -> FinalResult | None: ...

    def live_batchers(self) -> list[Heartbeat]: ...

    def queue_depth(self) -> int:
        """Requests submitted and not yet finished (queued or running), over all replicas."""
        ...

    def pull_finals(self, consumer: str, max_count: int, block_ms: int) -> list[StoredFinal]:
        """Final results to persist: new ones, and ones another consumer took but did not ack
        within the lease (it died). Each stays pending to `consumer` until `ack_finals`."""
        ...

    def ack_finals(self, entry_ids: list[str]) -> None: ...

    def missing(self, request_ids: list[str]) -> list[str]:
        """Those of `request_ids` this transport has no trace of (never submitted, or lost with
        a Redis flush or restart): the reconciler enqueues them again."""
        ...

    def read_started(
        self, cursor: str | None, max_count: int, block_ms: int
    ) -> tuple[str, list[str]]:
        """Request ids whose first token event was published after `cursor` (None: from now on),
        and the cursor to pass next time. A status signal, not a record: a rerun repeats an id,
        and ids older than the log's cap are gone."""
        ...


class BatcherTransport(Protocol):
    """What a batcher does: pull work (interactive before bulk), publish, ack, reclaim."""

    def pull(
        self, batcher_id: str, max_count: int, block_ms: int, *, above: Priority | None = None
    ) -> list[Delivery]:
        """Up to `max_count` requests, interactive first; waits up to `block_ms` only when none
        is queued (0: never waits). With `above`, only requests of a higher priority, at once
        (a full batcher still takes what may preempt its work)."""
        ...

    def publish_tokens(self, events: list[TokenEvent]) -> None: ...

    def publish_final(self, result: FinalResult) -> bool:
        """Stores the result durably; False when the request already had one (dropped)."""
        ...

    def ack(self, batcher_id: str, delivery: Delivery) -> None: ...

    def release(self, batcher_id: str, delivery: Delivery) -> None:
        """Hands an unfinished request back to the queue, same attempt (a draining batcher)."""
        ...

    def poll_aborts(self, batcher_id: str) -> list[str]:
        """Request ids aborted since this batcher's previous poll (broadcast to every batcher)."""
        ...

    def heartbeat(self, beat: Heartbeat) -> None: ...

    def publish_prefixes(self, batcher_id: str, keys: list[BlockHash], *, replace: bool) -> None:
        """Advertises prefix-cache keys this batcher holds, for cache-aware routing
        (`routing.py`): added to its set, or replacing it (which lapses with the heartbeat)."""
        ...

    def reclaim(self, batcher_id: str, max_count: int = 100) -> int:
        """Requeues (or fails, past max attempts) entries of dead batchers, and moves what was
        routed to them to the shared queue; returns how many."""
        ...

    def recover(self, batcher_id: str, max_count: int = 1000) -> int:
        """At start-up, before the first pull: requeues (or fails) what is still pending to this
        batcher id. A previous process with the same id left it; its heartbeat (ours now) would
        keep `reclaim` off it forever."""
        ...
