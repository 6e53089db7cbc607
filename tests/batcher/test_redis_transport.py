"""Redis-only behaviour behind the contract: the key layout and its expiries, garbage in a queue,
and streams lost to a Redis restart."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from tgq.batcher.messages import FinalResult, Heartbeat, SubmitRequest, TokenEvent
from tgq.batcher.request import StoppingParams
from tgq.batcher.transport.redis import RedisTransport
from tgq.gpu_worker.plan import SamplingParams

REDIS_URL = "redis://127.0.0.1:6379/0"

pytestmark = pytest.mark.timeout(20)


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    yield client
    client.close()


@pytest.fixture
def transport(client: redis.Redis) -> Iterator[RedisTransport]:
    prefix = f"test-{uuid.uuid4().hex}"
    yield RedisTransport(client, prefix)
    keys = list(client.scan_iter(match=f"{prefix}:*"))
    if keys:
        client.delete(*keys)


def request(request_id: str) -> SubmitRequest:
    return SubmitRequest(request_id, [1, 2], SamplingParams(), StoppingParams())


def test_key_layout_and_expiries(transport: RedisTransport, client: redis.Redis) -> None:
    p = transport.prefix
    transport.publish_tokens([TokenEvent("r0", i, [i], [None]) for i in range(2)])
    transport.publish_final(FinalResult("r0", [0, 1], "length", None, 2, 2, 0, 1, "b0"))
    transport.heartbeat(Heartbeat("b0", 0, 0, 1, 1, 0.0))
    entries: Any = client.xrange(f"{p}:tokens:r0")
    assert [entry_id for entry_id, _ in entries] == [b"0-1", b"0-2", b"1-0"]
    for key, ttl_s in [("tokens:r0", 3600), ("final:r0", 86400), ("heartbeat:b0", 10)]:
        assert 0.9 * ttl_s * 1000 < client.pttl(f"{p}:{key}") <= ttl_s * 1000
    assert client.xinfo_groups(f"{p}:queue:interactive")[0]["name"] == b"batchers"


def test_garbage_in_a_queue_is_dropped(transport: RedisTransport, client: redis.Redis) -> None:
    queue = f"{transport.prefix}:queue:interactive"
    client.xadd(queue, {"m": b"\x80\x04not a message"})
    client.xadd(queue, {"other": b"1"})
    transport.submit(request("good"))
    deliveries = transport.pull("b0", 5, 0)
    assert [d.request.request_id for d in deliveries] == ["good"]
    assert client.xlen(queue) == 1
    transport.ack("b0", deliveries[0])
    assert client.xlen(queue) == 0


def test_streams_lost_to_a_restart_are_recreated(
    transport: RedisTransport, client: redis.Redis
) -> None:
    client.delete(*client.scan_iter(match=f"{transport.prefix}:queue:*"))
    assert transport.pull("b0", 5, 0) == []
    assert transport.reclaim("b0") == 0
    transport.submit(request("after"))
    assert [d.request.request_id for d in transport.pull("b0", 5, 0)] == ["after"]


def test_blocking_reads_return_before_the_socket_timeout() -> None:
    """A read asked to block longer than the client's socket timeout never fails with a
    TimeoutError: token and queue reads return empty before it (their callers loop), and
    `read_final` waits its whole timeout in reads shorter than the socket timeout."""
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=1.0)
    prefix = f"test-{uuid.uuid4().hex}"
    transport = RedisTransport(client, prefix)
    start = time.monotonic()
    assert transport.read_tokens("nobody", 0, timeout_s=3.0) == []
    assert transport.pull("b0", 1, block_ms=3000) == []
    assert time.monotonic() - start < 2 * 1.0
    start = time.monotonic()
    assert transport.read_final("nobody", timeout_s=3.0) is None
    assert 3.0 <= time.monotonic() - start < 4.0
    client.delete(*client.scan_iter(match=f"{prefix}:*"))
    client.close()


def test_a_flushed_redis_forgets_its_requests() -> None:
    """What the reconciler relies on: after FLUSHALL (here: the prefix's keys deleted) every
    request submitted before is missing."""
    prefix = f"test-{uuid.uuid4().hex}"
    client = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    transport = RedisTransport(client, prefix)
    request = SubmitRequest("r0", [1], SamplingParams(), StoppingParams())
    transport.submit(request)
    assert transport.missing(["r0"]) == []
    client.delete(*client.scan_iter(match=f"{prefix}:*"))
    assert transport.missing(["r0"]) == ["r0"]
    client.close()
