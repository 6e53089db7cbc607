"""The transport contract: the same tests against the in-process and the Redis transport (the
real server on 127.0.0.1:6379, a random key prefix per test, deleted afterwards)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from tgq.batcher.messages import FinalResult, Heartbeat, SubmitRequest, TokenEvent
from tgq.batcher.request import Priority, StoppingParams
from tgq.batcher.transport.base import Transport, TransportConfig
from tgq.batcher.transport.memory import MemoryTransport
from tgq.batcher.transport.redis import RedisTransport
from tgq.gpu_worker.plan import SamplingParams

REDIS_URL = "redis://127.0.0.1:6379/0"
LEASE_S = 0.05
HEARTBEAT_TTL_S = 0.15
CONFIG = TransportConfig(max_attempts=2, lease_s=LEASE_S, heartbeat_ttl_s=HEARTBEAT_TTL_S)

pytestmark = pytest.mark.timeout(20)


@pytest.fixture(params=["memory", "redis"])
def transport(request: pytest.FixtureRequest) -> Iterator[Transport]:
    if request.param == "memory":
        yield MemoryTransport(CONFIG)
        return
    client = redis.Redis.from_url(REDIS_URL)
    prefix = f"test-{uuid.uuid4().hex}"
    yield RedisTransport(client, prefix, CONFIG)
    keys = list(client.scan_iter(match=f"{prefix}:*"))
    if keys:
        client.delete(*keys)
    client.close()


def submit(
    transport: Transport, request_id: str, priority: Priority = Priority.INTERACTIVE
) -> SubmitRequest:
    request = SubmitRequest(
        request_id, [1, 2, 3], SamplingParams(), StoppingParams(max_new_tokens=4), priority
    )
    transport.submit(request)
    return request


def event(request_id: str, seq_index: int, attempt: int = 1) -> TokenEvent:
    return TokenEvent(request_id, seq_index, [100 + seq_index], [None], f"t{seq_index}", attempt)


def final(request_id: str, batcher_id: str = "b0") -> FinalResult:
    return FinalResult(request_id, [7, 8], "length", None, 3, 2, 0, 1, batcher_id)


def beat(transport: Transport, batcher_id: str) -> None:
    transport.heartbeat(Heartbeat(batcher_id, 0, 0, 10, 4, time.time()))


def pulled_ids(transport: Transport, batcher_id: str, max_count: int = 10) -> list[str]:
    return [d.request.request_id for d in transport.pull(batcher_id, max_count, 0)]


def test_a_pull_above_a_priority_takes_only_what_outranks_it(transport: Transport) -> None:
    submit(transport, "bulk-0", Priority.BULK)
    submit(transport, "chat-0")
    submit(transport, "chat-1")
    outranking = transport.pull("b0", 1, 0, above=Priority.BULK)
    assert [d.request.request_id for d in outranking] == ["chat-0"]
    assert transport.pull("b0", 10, 0, above=Priority.INTERACTIVE) == []
    assert pulled_ids(transport, "b0") == ["chat-1", "bulk-0"]


def test_requests_come_out_in_submit_order(transport: Transport) -> None:
    for i in range(5):
        submit(transport, f"r{i}")
    deliveries = transport.pull("b0", 10, 0)
    assert [d.request.request_id for d in deliveries] == [f"r{i}" for i in range(5)]
    assert all(d.request.attempt == 1 and not d.is_aborted for d in deliveries)
    assert deliveries[0].request == SubmitRequest(
        "r0", [1, 2, 3], SamplingParams(), StoppingParams(max_new_tokens=4)
    )
    assert transport.pull("b0", 10, 0) == []


def test_interactive_before_bulk_and_max_count(transport: Transport) -> None:
    submit(transport, "bulk-0", Priority.BULK)
    submit(transport, "bulk-1", Priority.BULK)
    submit(transport, "chat-0")
    assert pulled_ids(transport, "b0", 2) == ["chat-0", "bulk-0"]
    submit(transport, "chat-1")
    assert pulled_ids(transport, "b0", 1) == ["chat-1"]
    assert pulled_ids(transport, "b0", 5) == ["bulk-1"]


def test_batchers_share_the_queue_without_overlap(transport: Transport) -> None:
    for i in range(4):
        submit(transport, f"r{i}")
    first, second = pulled_ids(transport, "b0", 2), pulled_ids(transport, "b1", 5)
    assert first == ["r0", "r1"]
    assert second == ["r2", "r3"]


def test_pull_blocks_only_when_the_queue_is_empty(transport: Transport) -> None:
    start = time.monotonic()
    assert transport.pull("b0", 4, 100) == []
    assert time.monotonic() - start >= 0.09
    timer = threading.Timer(0.05, submit, (transport, "late", Priority.BULK))
    timer.start()
    start = time.monotonic()
    deliveries = transport.pull("b0", 4, 5000)
    timer.join()
    assert [d.request.request_id for d in deliveries] == ["late"]
    assert time.monotonic() - start < 2


def test_a_released_request_goes_back_to_the_queue(transport: Transport) -> None:
    submit(transport, "r0")
    (delivery,) = transport.pull("draining", 1, 0)
    transport.release("draining", delivery)
    (again,) = transport.pull("b1", 1, 0)
    assert again.request == delivery.request
    time.sleep(LEASE_S * 2)
    assert transport.reclaim("b2") == 1  # b1 holds it now, "draining" does not


def test_token_events_catch_up_from_a_seq_index(transport: Transport) -> None:
    transport.publish_tokens([event("r0", i) for i in range(5)])
    assert transport.read_tokens("r0", 0, 0) == [event("r0", i) for i in range(5)]
    assert transport.read_tokens("r0", 3, 0) == [event("r0", 3), event("r0", 4)]
    assert transport.read_tokens("r0", 5, 0) == []
    assert transport.read_tokens("other", 0, 0) == []


def test_a_rerun_replays_no_seq_index_twice(transport: Transport) -> None:
    transport.publish_tokens([event("r0", 0), event("r0", 1)])
    transport.publish_tokens([event("r0", i, attempt=2) for i in range(4)])
    assert transport.read_tokens("r0", 0, 0) == [
        event("r0", 0),
        event("r0", 1),
        event("r0", 2, attempt=2),
        event("r0", 3, attempt=2),
    ]


def test_a_waiting_reader_wakes_on_the_next_event(transport: Transport) -> None:
    transport.publish_tokens([event("r0", 0)])
    timer = threading.Timer(0.05, transport.publish_tokens, ([event("r0", 1)],))
    timer.start()
    assert transport.read_tokens("r0", 1, 5) == [event("r0", 1)]
    timer.join()


def test_one_final_result_and_nothing_after_it(transport: Transport) -> None:
    transport.publish_tokens([event("r0", 0)])
    assert transport.read_final("r0") is None
    assert transport.publish_final(final("r0", "b0"))
    assert not transport.publish_final(final("r0", "b1"))
    assert transport.read_final("r0") == final("r0", "b0")
    transport.publish_tokens([event("r0", 1)])
    assert transport.read_tokens("r0", 0, 0) == [event("r0", 0)]
    start = time.monotonic()
    assert transport.read_tokens("r0", 1, 5) == []  # final: no wait
    assert time.monotonic() - start < 1


def test_a_waiting_reader_wakes_on_the_final_result(transport: Transport) -> None:
    timer = threading.Timer(0.05, transport.publish_final, (final("r0"),))
    timer.start()
    assert transport.read_final("r0", 5) == final("r0")
    timer.join()


def test_abort_reaches_queued_and_running_requests(transport: Transport) -> None:
    for batcher_id in ("b0", "b1"):
        assert transport.poll_aborts(batcher_id) == []
    submit(transport, "running")
    submit(transport, "queued")
    running = transport.pull("b0", 1, 0)
    transport.abort("queued")
    transport.abort("running", "client disconnected")
    assert [d.is_aborted for d in running] == [False]
    (queued,) = transport.pull("b1", 1, 0)
    assert queued.request.request_id == "queued"
    assert queued.is_aborted
    assert transport.poll_aborts("b0") == ["queued", "running"]
    assert transport.poll_aborts("b1") == ["queued", "running"]  # a broadcast
    assert transport.poll_aborts("b0") == []


def test_an_entry_of_a_live_batcher_is_never_reclaimed(transport: Transport) -> None:
    submit(transport, "r0")
    beat(transport, "b0")
    transport.pull("b0", 1, 0)
    time.sleep(LEASE_S * 2)
    beat(transport, "b0")
    assert transport.reclaim("b1") == 0
    assert pulled_ids(transport, "b1") == []


def test_a_dead_batchers_entries_are_rerun_after_the_lease(transport: Transport) -> None:
    submit(transport, "r0")
    submit(transport, "r1", Priority.BULK)
    beat(transport, "dead")
    assert len(transport.pull("dead", 2, 0)) == 2
    assert transport.reclaim("b1") == 0  # within the lease, heartbeat alive
    time.sleep(HEARTBEAT_TTL_S + 0.05)
    beat(transport, "b1")
    assert transport.reclaim("b1") == 2
    assert transport.reclaim("b1") == 0
    retried = transport.pull("b1", 5, 0)
    assert [(d.request.request_id, d.request.attempt) for d in retried] == [("r0", 2), ("r1", 2)]
    transport.publish_final(final("r0", "b1"))
    transport.ack("b1", retried[0])
    time.sleep(HEARTBEAT_TTL_S + 0.05)
    assert transport.reclaim("b2") == 1  # only r1 was still pending
    assert transport.read_final("r0") == final("r0", "b1")


def test_a_restarted_batcher_recovers_what_its_previous_process_held(
    transport: Transport,
) -> None:
    submit(transport, "r0")
    submit(transport, "r1")
    beat(transport, "b0")
    transport.pull("b0", 1, 0)
    assert transport.recover("b0") == 1
    assert transport.recover("b0") == 0
    deliveries = transport.pull("b0", 5, 0)
    assert [(d.request.request_id, d.request.attempt) for d in deliveries] == [("r1", 1), ("r0", 2)]


def test_a_presumed_dead_batcher_finishing_late_changes_nothing(transport: Transport) -> None:
    submit(transport, "r0")
    (zombie,) = transport.pull("slow", 1, 0)
    time.sleep(LEASE_S * 2)
    assert transport.reclaim("b1") == 1
    (rerun,) = transport.pull("b1", 1, 0)
    transport.publish_tokens([event("r0", 0, attempt=2), event("r0", 1, attempt=2)])
    assert transport.publish_final(final("r0", "b1"))
    transport.ack("b1", rerun)
    transport.publish_tokens([event("r0", 0), event("r0", 1), event("r0", 2)])
    assert not transport.publish_final(final("r0", "slow"))  # the duplicate is dropped
    transport.ack("slow", zombie)
    assert transport.read_final("r0") == final("r0", "b1")
    assert [e.attempt for e in transport.read_tokens("r0", 0, 0)] == [2, 2]
    time.sleep(LEASE_S * 2)
    assert transport.reclaim("b2") == 0
    assert pulled_ids(transport, "b2") == []


def test_acked_only_after_final_so_a_lost_ack_does_not_rerun(transport: Transport) -> None:
    submit(transport, "r0")
    transport.pull("dead", 1, 0)
    transport.publish_final(final("r0", "dead"))
    time.sleep(LEASE_S * 2)
    assert transport.reclaim("b1") == 1
    assert pulled_ids(transport, "b1") == []
    assert transport.read_final("r0") == final("r0", "dead")


def test_a_request_that_keeps_killing_batchers_fails(transport: Transport) -> None:
    submit(transport, "poison")
    for attempt in (1, 2):
        (delivery,) = transport.pull(f"dead-{attempt}", 1, 0)
        assert delivery.request.attempt == attempt
        time.sleep(LEASE_S * 2)
        assert transport.reclaim("b1") == 1
    assert pulled_ids(transport, "b1") == []
    result = transport.read_final("poison")
    assert result is not None
    assert result.finish_reason == "failed"
    assert result.finish_detail == "failed after 2 attempts: the batcher running it died each time"
    assert (result.attempt, result.batcher_id, result.token_ids) == (2, "b1", [])


def test_heartbeats_list_live_batchers_and_expire(transport: Transport) -> None:
    beat(transport, "b0")
    beat(transport, "b1")
    assert sorted(b.batcher_id for b in transport.live_batchers()) == ["b0", "b1"]
    time.sleep(HEARTBEAT_TTL_S + 0.05)
    beat(transport, "b1")
    assert [b.batcher_id for b in transport.live_batchers()] == ["b1"]


def test_queue_depth_counts_queued_and_running_until_acked(transport: Transport) -> None:
    for i in range(3):
        submit(transport, f"r{i}")
    assert transport.queue_depth() == 3
    delivery = transport.pull("b0", 1, 0)[0]
    assert transport.queue_depth() == 3  # running still counts
    transport.publish_final(final(delivery.request.request_id))
    transport.ack("b0", delivery)
    assert transport.queue_depth() == 2


def test_every_stored_final_is_queued_once_for_the_persisters(transport: Transport) -> None:
    for i in range(3):
        transport.publish_final(final(f"r{i}"))
    transport.publish_final(final("r0", "b1"))  # a second final: dropped, not queued again
    taken = transport.pull_finals("api-1", 2, 0)
    assert [s.result.request_id for s in taken] == ["r0", "r1"]
    assert taken[0].result == final("r0")
    rest = transport.pull_finals("api-2", 10, 0)
    assert [s.result.request_id for s in rest] == ["r2"]  # pending ones go to nobody else
    transport.ack_finals([s.entry_id for s in taken + rest])
    time.sleep(LEASE_S * 2)
    assert transport.pull_finals("api-2", 10, 0) == []


def test_finals_a_dead_persister_held_go_to_another_after_the_lease(transport: Transport) -> None:
    transport.publish_final(final("r0"))
    assert len(transport.pull_finals("api-1", 10, 0)) == 1  # then api-1 dies without acking
    assert transport.pull_finals("api-2", 10, 0) == []
    time.sleep(LEASE_S * 2)
    again = transport.pull_finals("api-2", 10, 0)
    assert [s.result.request_id for s in again] == ["r0"]
    transport.ack_finals([s.entry_id for s in again])


def test_a_failed_result_after_max_attempts_is_queued_to_persist(transport: Transport) -> None:
    submit(transport, "r0")
    for attempt in range(CONFIG.max_attempts):
        assert transport.pull(f"b{attempt}", 1, 0)
        time.sleep(LEASE_S * 2 + HEARTBEAT_TTL_S)
        transport.reclaim("reclaimer")
    stored = transport.pull_finals("api-1", 10, 0)
    assert [(s.result.request_id, s.result.finish_reason) for s in stored] == [("r0", "failed")]


def test_a_waiting_persister_wakes_on_a_new_final(transport: Transport) -> None:
    timer = threading.Timer(0.05, lambda: transport.publish_final(final("r0")))
    timer.start()
    started = time.monotonic()
    stored = transport.pull_finals("api-1", 10, 2000)
    timer.join()
    assert [s.result.request_id for s in stored] == ["r0"]
    assert time.monotonic() - started < 1.0


def test_the_started_log_names_each_request_at_its_first_event(transport: Transport) -> None:
    transport.publish_tokens([event("r-old", 0)])
    cursor, ids = transport.read_started(None, 10, 0)  # from now on
    assert ids == []
    transport.publish_tokens([event("r0", 0), event("r1", 0)])
    transport.publish_tokens([event("r0", 1), event("r0", 2)])  # later events: not again
    cursor, ids = transport.read_started(cursor, 10, 0)
    assert ids == ["r0", "r1"]
    transport.publish_tokens([event("r2", 0)])
    other_cursor, _ = transport.read_started(None, 10, 0)
    cursor, ids = transport.read_started(cursor, 1, 0)
    assert ids == ["r2"]
    assert transport.read_started(cursor, 10, 0) == (cursor, [])
    assert transport.read_started(other_cursor, 10, 0)[1] == []  # each reader its own cursor


def test_a_waiting_started_reader_wakes_on_a_first_event(transport: Transport) -> None:
    cursor, _ = transport.read_started(None, 10, 0)
    timer = threading.Timer(0.05, lambda: transport.publish_tokens([event("r0", 0)]))
    timer.start()
    started = time.monotonic()
    _, ids = transport.read_started(cursor, 10, 2000)
    timer.join()
    assert ids == ["r0"] and time.monotonic() - started < 1.0


def test_missing_names_the_requests_the_transport_never_saw(transport: Transport) -> None:
    submit(transport, "r0")
    submit(transport, "r1", Priority.BULK)
    assert transport.missing(["r0", "r1", "r2"]) == ["r2"]
    assert transport.missing([]) == []
