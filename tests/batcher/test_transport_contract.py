"""The transport contract: the same tests against the in-process and the Redis transport (the
real server on 127.0.0.1:6379, a random key prefix per test, deleted afterwards). The api side
of Redis is `AsyncRedisApiTransport`, called here through `BlockingApiTransport`; its batcher
side is `RedisBatcherTransport`. The in-process transport is both sides in one object.

Leases and heartbeats are short, and no test sleeps for them: one that needs a lease or a
heartbeat to lapse polls for what that makes true (`eventually`, `reclaim_all`). A test that
needs one not to lapse keeps its margin large: a beat lasts `HEARTBEAT_TTL_S`, and the lease is
`HELD` where a test checks what happens within it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import redis

from tests.finals import final_result
from tgq.batcher.messages import FinalResult, Heartbeat, SubmitRequest, TokenEvent
from tgq.batcher.request import Priority, StoppingParams
from tgq.batcher.transport.base import (
    ApiTransport,
    BatcherTransport,
    StoredFinal,
    TransportConfig,
)
from tgq.batcher.transport.blocking import BlockingApiTransport
from tgq.batcher.transport.memory import MemoryTransport
from tgq.batcher.transport.redis import RedisBatcherTransport
from tgq.gpu_worker.plan import SamplingParams

REDIS_URL = "redis://127.0.0.1:6379/0"
LEASE_S = 0.05
HEARTBEAT_TTL_S = 0.5
CONFIG = TransportConfig(max_attempts=2, lease_s=LEASE_S, heartbeat_ttl_s=HEARTBEAT_TTL_S)
HELD = dataclasses.replace(CONFIG, lease_s=60.0)  # a lease that lasts longer than any test
DEADLINE_S = 5.0

pytestmark = pytest.mark.timeout(20)


@dataclass(frozen=True, slots=True)
class Sides:
    api: ApiTransport
    batcher: BatcherTransport


@pytest.fixture
def config() -> TransportConfig:
    """`CONFIG`; a test parametrizes `config` to run with another."""
    return CONFIG


@pytest.fixture(params=["memory", "redis"])
def sides(request: pytest.FixtureRequest, config: TransportConfig) -> Iterator[Sides]:
    if request.param == "memory":
        memory = MemoryTransport(config)
        yield Sides(memory, memory)
        return
    client = redis.Redis.from_url(REDIS_URL)
    prefix = f"test-{uuid.uuid4().hex}"
    with BlockingApiTransport.from_url(REDIS_URL, prefix, config) as api:
        yield Sides(api, RedisBatcherTransport(client, prefix, config))
    keys = list(client.scan_iter(match=f"{prefix}:*"))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def api(sides: Sides) -> ApiTransport:
    return sides.api


@pytest.fixture
def batcher(sides: Sides) -> BatcherTransport:
    return sides.batcher


def eventually(condition: Callable[[], bool], timeout_s: float = DEADLINE_S) -> None:
    """Polls `condition` until it holds; fails the test if `timeout_s` passes first. (Local to
    this module: `tests/` has no shared helper for it yet.)"""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"still not true after {timeout_s} s: {condition.__doc__ or condition}")
        time.sleep(0.01)


def reclaim_all(batcher: BatcherTransport, reclaimer: str, expected: int) -> None:
    """Reclaims until `expected` entries were (their lease lapses meanwhile), and not one more."""
    num_reclaimed = 0

    def reclaimed_enough() -> bool:
        nonlocal num_reclaimed
        num_reclaimed += batcher.reclaim(reclaimer)
        return num_reclaimed >= expected

    eventually(reclaimed_enough)
    assert num_reclaimed == expected


def take_over(api: ApiTransport, consumer: str) -> list[str]:
    """The final results `consumer` takes once another persister's lease lapsed; acked."""
    stored: list[StoredFinal] = []

    def took_some() -> bool:
        stored[:] = api.pull_finals(consumer, 10, 0)
        return bool(stored)

    eventually(took_some)
    api.ack_finals([s.entry_id for s in stored])
    return [s.result.request_id for s in stored]


def submit(
    api: ApiTransport, request_id: str, priority: Priority = Priority.INTERACTIVE
) -> SubmitRequest:
    request = SubmitRequest(
        request_id=request_id,
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=4),
        priority=priority,
    )
    api.submit(request)
    return request


def event(request_id: str, seq_index: int, attempt: int = 1) -> TokenEvent:
    return TokenEvent(
        request_id=request_id,
        seq_index=seq_index,
        token_ids=[100 + seq_index],
        logprobs=[None],
        text=f"t{seq_index}",
        attempt=attempt,
    )


def final(request_id: str, batcher_id: str = "b0") -> FinalResult:
    return final_result(request_id, [7, 8], num_prompt_tokens=3, batcher_id=batcher_id)


def beat(batcher: BatcherTransport, batcher_id: str) -> None:
    batcher.heartbeat(
        Heartbeat(
            batcher_id=batcher_id,
            num_running=0,
            num_waiting=0,
            num_free_blocks=10,
            max_batch_size=4,
            time=time.time(),
        )
    )


def pulled_ids(batcher: BatcherTransport, batcher_id: str, max_count: int = 10) -> list[str]:
    return [d.request.request_id for d in batcher.pull(batcher_id, max_count, 0)]


def live_ids(api: ApiTransport) -> list[str]:
    return sorted(b.batcher_id for b in api.live_batchers())


def test_a_pull_above_a_priority_takes_only_what_outranks_it(
    api: ApiTransport, batcher: BatcherTransport
) -> None:
    submit(api, "bulk-0", Priority.BULK)
    submit(api, "chat-0")
    submit(api, "chat-1")
    outranking = batcher.pull("b0", 1, 0, above=Priority.BULK)
    assert [d.request.request_id for d in outranking] == ["chat-0"]
    assert batcher.pull("b0", 10, 0, above=Priority.INTERACTIVE) == []
    assert pulled_ids(batcher, "b0") == ["chat-1", "bulk-0"]


def test_requests_come_out_in_submit_order(api: ApiTransport, batcher: BatcherTransport) -> None:
    for i in range(5):
        submit(api, f"r{i}")
    deliveries = batcher.pull("b0", 10, 0)
    assert [d.request.request_id for d in deliveries] == [f"r{i}" for i in range(5)]
    assert all(d.request.attempt == 1 and not d.is_aborted for d in deliveries)
    assert deliveries[0].request == SubmitRequest(
        request_id="r0",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=4),
    )
    assert batcher.pull("b0", 10, 0) == []


def test_interactive_before_bulk_and_max_count(
    api: ApiTransport, batcher: BatcherTransport
) -> None:
    submit(api, "bulk-0", Priority.BULK)
    submit(api, "bulk-1", Priority.BULK)
    submit(api, "chat-0")
    assert pulled_ids(batcher, "b0", 2) == ["chat-0", "bulk-0"]
    submit(api, "chat-1")
    assert pulled_ids(batcher, "b0", 1) == ["chat-1"]
    assert pulled_ids(batcher, "b0", 5) == ["bulk-1"]


def test_batchers_share_the_queue_without_overlap(
    api: ApiTransport, batcher: BatcherTransport
) -> None:
    for i in range(4):
        submit(api, f"r{i}")
    first, second = pulled_ids(batcher, "b0", 2), pulled_ids(batcher, "b1", 5)
    assert first == ["r0", "r1"]
    assert second == ["r2", "r3"]


def test_pull_blocks_only_when_the_queue_is_empty(
    api: ApiTransport, batcher: BatcherTransport
) -> None:
    start = time.monotonic()
    assert batcher.pull("b0", 4, 100) == []
    assert time.monotonic() - start >= 0.09
    timer = threading.Timer(0.05, submit, (api, "late", Priority.BULK))
    timer.start()
    start = time.monotonic()
    deliveries = batcher.pull("b0", 4, 5000)
    timer.join()
    assert [d.request.request_id for d in deliveries] == ["late"]
    assert time.monotonic() - start < 2


def test_a_released_request_goes_back_to_the_queue(
    api: ApiTransport, batcher: BatcherTransport
) -> None:
    submit(api, "r0")
    (delivery,) = batcher.pull("draining", 1, 0)
    batcher.release("draining", delivery)
    (again,) = batcher.pull("b1", 1, 0)
    assert again.request == delivery.request
    reclaim_all(batcher, "b2", 1)  # b1 (no heartbeat) holds it now, "draining" does not


def test_token_events_catch_up_from_a_seq_index(
    api: ApiTransport, batcher: BatcherTransport
) -> None:
    batcher.publish_tokens([event("r0", i) for i in range(5)])
    assert api.read_tokens("r0", 0, 0) == [event("r0", i) for i in range(5)]
    assert api.read_tokens("r0", 3, 0) == [event("r0", 3), event("r0", 4)]
    assert api.read_tokens("r0", 5, 0) == []
    assert api.read_tokens("other", 0, 0) == []


def test_a_rerun_replays_no_seq_index_twice(api: ApiTransport, batcher: BatcherTransport) -> None:
    batcher.publish_tokens([event("r0", 0), event("r0", 1)])
    batcher.publish_tokens([event("r0", i, attempt=2) for i in range(4)])
    assert api.read_tokens("r0", 0, 0) == [
        event("r0", 0),
        event("r0", 1),
        event("r0", 2, attempt=2),
        event("r0", 3, attempt=2),
    ]


def test_a_waiting_reader_wakes_on_the_next_event(
    api: ApiTransport, batcher: BatcherTransport
) -> None:
    batcher.publish_tokens([event("r0", 0)])
    timer = threading.Timer(0.05, batcher.publish_tokens, ([event("r0", 1)],))
    timer.start()
    assert api.read_tokens("r0", 1, 5) == [event("r0", 1)]
    timer.join()


def test_one_final_result_and_nothing_after_it(
    api: ApiTransport, batcher: BatcherTransport
) -> None:
    batcher.publish_tokens([event("r0", 0)])
    assert api.read_final("r0") is None
    assert batcher.publish_final(final("r0", "b0"))
    assert not batcher.publish_final(final("r0", "b1"))
    assert api.read_final("r0") == final("r0", "b0")
    batcher.publish_tokens([event("r0", 1)])
    assert api.read_tokens("r0", 0, 0) == [event("r0", 0)]
    start = time.monotonic()
    assert api.read_tokens("r0", 1, 5) == []  # final: no wait
    assert time.monotonic() - start < 1


def test_a_waiting_reader_wakes_on_the_final_result(
    api: ApiTransport, batcher: BatcherTransport
) -> None:
    timer = threading.Timer(0.05, batcher.publish_final, (final("r0"),))
    timer.start()
    assert api.read_final("r0", 5) == final("r0")
    timer.join()


def test_abort_reaches_queued_and_running_requests(
    api: ApiTransport, batcher: BatcherTransport
) -> None:
    for batcher_id in ("b0", "b1"):
        assert batcher.poll_aborts(batcher_id) == []
    submit(api, "running")
    submit(api, "queued")
    running = batcher.pull("b0", 1, 0)
    api.abort("queued")
    api.abort("running", "client disconnected")
    assert [d.is_aborted for d in running] == [False]
    (queued,) = batcher.pull("b1", 1, 0)
    assert queued.request.request_id == "queued"
    assert queued.is_aborted
    assert batcher.poll_aborts("b0") == ["queued", "running"]
    assert batcher.poll_aborts("b1") == ["queued", "running"]  # a broadcast
    assert batcher.poll_aborts("b0") == []


def test_an_entry_of_a_live_batcher_is_never_reclaimed(
    api: ApiTransport, batcher: BatcherTransport
) -> None:
    submit(api, "kept")
    submit(api, "witness")
    beat(batcher, "b0")
    assert pulled_ids(batcher, "b0", 1) == ["kept"]
    assert pulled_ids(batcher, "dead", 1) == ["witness"]  # never beats

    def lease_lapsed() -> bool:
        """the witness, pulled after "kept", is reclaimed"""
        beat(batcher, "b0")
        return batcher.reclaim("b1") > 0

    eventually(lease_lapsed)
    assert pulled_ids(batcher, "b1") == ["witness"]  # "kept" stays with b0


def test_a_dead_batchers_entries_are_rerun_after_the_lease(
    api: ApiTransport, batcher: BatcherTransport
) -> None:
    submit(api, "r0")
    submit(api, "r1", Priority.BULK)
    beat(batcher, "dead")
    assert len(batcher.pull("dead", 2, 0)) == 2
    assert batcher.reclaim("b1") == 0  # its heartbeat keeps them
    reclaim_all(batcher, "b1", 2)  # once the heartbeat (and the lease) lapsed
    assert live_ids(api) == []
    assert batcher.reclaim("b1") == 0
    retried = batcher.pull("b1", 5, 0)
    assert [(d.request.request_id, d.request.attempt) for d in retried] == [("r0", 2), ("r1", 2)]
    batcher.publish_final(final("r0", "b1"))
    batcher.ack("b1", retried[0])
    reclaim_all(batcher, "b2", 1)  # b1 never beats: only r1 was still pending to it
    assert api.read_final("r0") == final("r0", "b1")


def test_a_restarted_batcher_recovers_what_its_previous_process_held(
    api: ApiTransport, batcher: BatcherTransport
) -> None:
    submit(api, "r0")
    submit(api, "r1")
    beat(batcher, "b0")
    batcher.pull("b0", 1, 0)
    assert batcher.recover("b0") == 1
    assert batcher.recover("b0") == 0
    deliveries = batcher.pull("b0", 5, 0)
    assert [(d.request.request_id, d.request.attempt) for d in deliveries] == [("r1", 1), ("r0", 2)]


def test_a_presumed_dead_batcher_finishing_late_changes_nothing(
    api: ApiTransport, batcher: BatcherTransport
) -> None:
    submit(api, "r0")
    (zombie,) = batcher.pull("slow", 1, 0)
    reclaim_all(batcher, "b1", 1)
    (rerun,) = batcher.pull("b1", 1, 0)
    batcher.publish_tokens([event("r0", 0, attempt=2), event("r0", 1, attempt=2)])
    assert batcher.publish_final(final("r0", "b1"))
    batcher.ack("b1", rerun)
    batcher.publish_tokens([event("r0", 0), event("r0", 1), event("r0", 2)])
    assert not batcher.publish_final(final("r0", "slow"))  # the duplicate is dropped
    batcher.ack("slow", zombie)
    assert api.read_final("r0") == final("r0", "b1")
    assert [e.attempt for e in api.read_tokens("r0", 0, 0)] == [2, 2]
    assert api.queue_depth() == 0  # nothing queued or pending: nothing to reclaim, ever
    assert pulled_ids(batcher, "b2") == []


def test_acked_only_after_final_so_a_lost_ack_does_not_rerun(
    api: ApiTransport, batcher: BatcherTransport
) -> None:
    submit(api, "r0")
    batcher.pull("dead", 1, 0)
    batcher.publish_final(final("r0", "dead"))
    reclaim_all(batcher, "b1", 1)
    assert pulled_ids(batcher, "b1") == []
    assert api.read_final("r0") == final("r0", "dead")


def test_a_request_that_keeps_killing_batchers_fails(
    api: ApiTransport, batcher: BatcherTransport
) -> None:
    submit(api, "poison")
    for attempt in (1, 2):
        (delivery,) = batcher.pull(f"dead-{attempt}", 1, 0)
        assert delivery.request.attempt == attempt
        reclaim_all(batcher, "b1", 1)
    assert pulled_ids(batcher, "b1") == []
    result = api.read_final("poison")
    assert result is not None
    assert result.finish_reason == "failed"
    assert result.finish_detail == "failed after 2 attempts: the batcher running it died each time"
    assert (result.attempt, result.batcher_id, result.token_ids) == (2, "b1", [])


def test_heartbeats_list_live_batchers_and_expire(
    api: ApiTransport, batcher: BatcherTransport
) -> None:
    beat(batcher, "b0")
    beat(batcher, "b1")
    assert live_ids(api) == ["b0", "b1"]

    def only_b1_left() -> bool:
        """b0's heartbeat lapsed while b1 kept beating"""
        beat(batcher, "b1")
        return live_ids(api) == ["b1"]

    eventually(only_b1_left)


def test_queue_depth_counts_queued_and_running_until_acked(
    api: ApiTransport, batcher: BatcherTransport
) -> None:
    for i in range(3):
        submit(api, f"r{i}")
    assert api.queue_depth() == 3
    delivery = batcher.pull("b0", 1, 0)[0]
    assert api.queue_depth() == 3  # running still counts
    batcher.publish_final(final(delivery.request.request_id))
    batcher.ack("b0", delivery)
    assert api.queue_depth() == 2


@pytest.mark.parametrize("config", [HELD])
def test_every_stored_final_is_queued_once_for_the_persisters(
    api: ApiTransport, batcher: BatcherTransport
) -> None:
    for i in range(3):
        batcher.publish_final(final(f"r{i}"))
    batcher.publish_final(final("r0", "b1"))  # a second final: dropped, not queued again
    taken = api.pull_finals("api-1", 2, 0)
    assert [s.result.request_id for s in taken] == ["r0", "r1"]
    assert taken[0].result == final("r0")
    rest = api.pull_finals("api-2", 10, 0)
    assert [s.result.request_id for s in rest] == ["r2"]  # pending ones go to nobody else
    api.ack_finals([s.entry_id for s in taken + rest])
    assert api.pull_finals("api-2", 10, 0) == []


def test_finals_a_dead_persister_held_go_to_another_after_the_lease(
    api: ApiTransport, batcher: BatcherTransport
) -> None:
    batcher.publish_final(final("r0"))
    assert len(api.pull_finals("api-1", 10, 0)) == 1  # then api-1 dies without acking
    assert take_over(api, "api-2") == ["r0"]
    batcher.publish_final(final("r1"))
    assert len(api.pull_finals("api-3", 10, 0)) == 1  # api-3 dies too
    assert take_over(api, "api-4") == ["r1"]  # the acked r0 never comes back


def test_a_failed_result_after_max_attempts_is_queued_to_persist(
    api: ApiTransport, batcher: BatcherTransport
) -> None:
    submit(api, "r0")
    for attempt in range(CONFIG.max_attempts):
        assert batcher.pull(f"b{attempt}", 1, 0)
        reclaim_all(batcher, "reclaimer", 1)
    stored = api.pull_finals("api-1", 10, 0)
    assert [(s.result.request_id, s.result.finish_reason) for s in stored] == [("r0", "failed")]


def test_a_waiting_persister_wakes_on_a_new_final(
    api: ApiTransport, batcher: BatcherTransport
) -> None:
    timer = threading.Timer(0.05, lambda: batcher.publish_final(final("r0")))
    timer.start()
    started = time.monotonic()
    stored = api.pull_finals("api-1", 10, 2000)
    timer.join()
    assert [s.result.request_id for s in stored] == ["r0"]
    assert time.monotonic() - started < 1.0


def test_the_started_log_names_each_request_at_its_first_event(
    api: ApiTransport, batcher: BatcherTransport
) -> None:
    batcher.publish_tokens([event("r-old", 0)])
    cursor, ids = api.read_started(None, 10, 0)  # from now on
    assert ids == []
    batcher.publish_tokens([event("r0", 0), event("r1", 0)])
    batcher.publish_tokens([event("r0", 1), event("r0", 2)])  # later events: not again
    cursor, ids = api.read_started(cursor, 10, 0)
    assert ids == ["r0", "r1"]
    batcher.publish_tokens([event("r2", 0)])
    other_cursor, _ = api.read_started(None, 10, 0)
    cursor, ids = api.read_started(cursor, 1, 0)
    assert ids == ["r2"]
    assert api.read_started(cursor, 10, 0) == (cursor, [])
    assert api.read_started(other_cursor, 10, 0)[1] == []  # each reader its own cursor


def test_a_waiting_started_reader_wakes_on_a_first_event(
    api: ApiTransport, batcher: BatcherTransport
) -> None:
    cursor, _ = api.read_started(None, 10, 0)
    timer = threading.Timer(0.05, lambda: batcher.publish_tokens([event("r0", 0)]))
    timer.start()
    started = time.monotonic()
    _, ids = api.read_started(cursor, 10, 2000)
    timer.join()
    assert ids == ["r0"] and time.monotonic() - started < 1.0


def test_missing_names_the_requests_the_transport_never_saw(api: ApiTransport) -> None:
    submit(api, "r0")
    submit(api, "r1", Priority.BULK)
    assert api.missing(["r0", "r1", "r2"]) == ["r2"]
    assert api.missing([]) == []
