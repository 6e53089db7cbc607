"""Redis-only behaviour behind the contract: the key layout and its expiries, garbage in a queue,
consumer groups lost to a Redis restart, and blocking reads under the socket timeout."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from tests.finals import final_result
from tgq.batcher.messages import FinalResult, Heartbeat, SubmitRequest, TokenEvent
from tgq.batcher.request import StoppingParams
from tgq.batcher.transport.aio import AsyncRedisApiTransport
from tgq.batcher.transport.blocking import BlockingApiTransport
from tgq.batcher.transport.redis import RedisBatcherTransport
from tgq.batcher.transport.redis_wire import block_cap_ms
from tgq.gpu_worker.plan import SamplingParams

REDIS_URL = "redis://127.0.0.1:6379/0"
SOCKET_TIMEOUT_S = 0.6

pytestmark = pytest.mark.timeout(20)


@pytest.fixture
def api(prefix: str) -> Iterator[BlockingApiTransport]:
    with BlockingApiTransport.from_url(REDIS_URL, prefix) as api:
        yield api


@pytest.fixture
def batcher(client: redis.Redis, prefix: str) -> RedisBatcherTransport:
    return RedisBatcherTransport(client, prefix)


def request(request_id: str) -> SubmitRequest:
    return SubmitRequest(
        request_id=request_id,
        prompt_token_ids=[1, 2],
        sampling=SamplingParams(),
        stopping=StoppingParams(),
    )


def final(request_id: str) -> FinalResult:
    return final_result(request_id, [0, 1])


def test_key_layout_and_expiries(
    api: BlockingApiTransport, batcher: RedisBatcherTransport, client: redis.Redis, prefix: str
) -> None:
    api.submit(request("r0"))
    assert batcher.pull("b0", 1, 0)
    batcher.publish_tokens(
        [TokenEvent(request_id="r0", seq_index=i, token_ids=[i], logprobs=[None]) for i in range(2)]
    )
    batcher.publish_final(final("r0"))
    batcher.heartbeat(
        Heartbeat(
            batcher_id="b0",
            num_running=0,
            num_waiting=0,
            num_free_blocks=1,
            max_batch_size=1,
            time=0.0,
        )
    )
    entries: Any = client.xrange(f"{prefix}:tokens:r0")
    assert [entry_id for entry_id, _ in entries] == [b"0-1", b"0-2", b"1-0"]
    expiries = [("tokens:r0", 3600), ("final:r0", 86400), ("known:r0", 86400), ("heartbeat:b0", 10)]
    for key, ttl_s in expiries:
        assert 0.9 * ttl_s * 1000 < client.pttl(f"{prefix}:{key}") <= ttl_s * 1000
    assert client.xinfo_groups(f"{prefix}:queue:interactive")[0]["name"] == b"batchers"
    assert api.pull_finals("api-1", 10, 0)
    assert client.xinfo_groups(f"{prefix}:finals")[0]["name"] == b"persisters"


def test_garbage_in_a_queue_is_dropped(
    api: BlockingApiTransport, batcher: RedisBatcherTransport, client: redis.Redis, prefix: str
) -> None:
    queue = f"{prefix}:queue:interactive"
    client.xadd(queue, {"m": b"\x80\x04not a message"})
    client.xadd(queue, {"other": b"1"})
    api.submit(request("good"))
    deliveries = batcher.pull("b0", 5, 0)
    assert [d.request.request_id for d in deliveries] == ["good"]
    assert client.xlen(queue) == 1
    batcher.ack("b0", deliveries[0])
    assert client.xlen(queue) == 0


def test_queues_lost_to_a_restart_are_recreated_with_what_came_after(
    api: BlockingApiTransport, batcher: RedisBatcherTransport, client: redis.Redis, prefix: str
) -> None:
    """Redis lost the queues and their group (restarted empty): each command that finds the
    group missing creates it, and what was submitted since is pulled by the first pull."""

    def lose_the_queues() -> None:
        client.delete(*client.scan_iter(match=f"{prefix}:queue:*"))

    api.submit(request("before"))
    assert [d.request.request_id for d in batcher.pull("b0", 5, 0)] == ["before"]
    lose_the_queues()
    assert batcher.reclaim("b0") == 0
    lose_the_queues()
    assert batcher.recover("b0") == 0
    lose_the_queues()
    api.submit(request("after"))
    assert [d.request.request_id for d in batcher.pull("b0", 5, 0)] == ["after"]


def test_the_finals_group_lost_to_a_restart_loses_no_final(
    api: BlockingApiTransport, batcher: RedisBatcherTransport, client: redis.Redis, prefix: str
) -> None:
    """A final result stored after Redis lost the persisters' group is persisted by the next
    pull: the group is created where it is found missing, from the stream's first entry."""
    batcher.publish_final(final("r0"))
    (stored,) = api.pull_finals("api-1", 10, 0)
    api.ack_finals([stored.entry_id])
    client.delete(f"{prefix}:finals")
    batcher.publish_final(final("r1"))
    assert [s.result.request_id for s in api.pull_finals("api-1", 10, 0)] == ["r1"]


def test_blocking_reads_return_before_the_socket_timeout(prefix: str) -> None:
    """A read asked to block longer than the client's socket timeout never fails with a
    TimeoutError: the batcher's pull returns empty before it (its caller loops), and the api's
    token and final reads wait their whole timeout in reads shorter than the socket timeout."""
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=SOCKET_TIMEOUT_S)
    batcher = RedisBatcherTransport(client, prefix)
    start = time.monotonic()
    assert batcher.pull("b0", 1, block_ms=3000) == []
    assert time.monotonic() - start < 2 * SOCKET_TIMEOUT_S
    client.close()

    def with_short_timeout() -> AsyncRedisApiTransport:
        pool = aioredis.BlockingConnectionPool.from_url(REDIS_URL, socket_timeout=SOCKET_TIMEOUT_S)
        client = aioredis.Redis(connection_pool=pool)
        return AsyncRedisApiTransport(client, prefix, max_block_ms=block_cap_ms(SOCKET_TIMEOUT_S))

    with BlockingApiTransport(with_short_timeout) as api:
        start = time.monotonic()
        assert api.read_tokens("nobody", 0, timeout_s=1.5) == []
        assert 1.5 <= time.monotonic() - start < 2.5
        start = time.monotonic()
        assert api.read_final("nobody", timeout_s=1.5) is None
        assert 1.5 <= time.monotonic() - start < 2.5


def test_a_flushed_redis_forgets_its_requests(
    api: BlockingApiTransport, client: redis.Redis, prefix: str
) -> None:
    """What the reconciler relies on: after FLUSHALL (here: the prefix's keys deleted) every
    request submitted before is missing."""
    api.submit(request("r0"))
    assert api.missing(["r0"]) == []
    client.delete(*client.scan_iter(match=f"{prefix}:*"))
    assert api.missing(["r0"]) == ["r0"]
