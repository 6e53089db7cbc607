"""Cache-aware routing: the rule (`routing.choose_batcher`), and on Redis the router's choice
from what batchers advertise, a batcher reading its routed queue first, and a dead batcher's
routed requests moved to the shared queue, each exactly once."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis

from tests.polling import eventually
from tgq.batcher.messages import Heartbeat, SubmitRequest
from tgq.batcher.prefix_hashes import prompt_block_hashes
from tgq.batcher.request import Priority, StoppingParams
from tgq.batcher.transport.aio import AsyncRedisApiTransport
from tgq.batcher.transport.base import TransportConfig
from tgq.batcher.transport.blocking import BlockingApiTransport
from tgq.batcher.transport.redis import RedisBatcherTransport
from tgq.batcher.transport.redis_keys import RedisKeys
from tgq.batcher.transport.routing import BUSY_FACTOR, BUSY_MARGIN, Candidate, choose_batcher
from tgq.gpu_worker.plan import SamplingParams

REDIS_URL = "redis://127.0.0.1:6379/0"
BLOCK_SIZE = 4
PROMPT = list(range(100, 117))  # 4 full blocks before the last token's
CONFIG = TransportConfig(lease_s=0.2, heartbeat_ttl_s=30)

pytestmark = pytest.mark.timeout(30)


def test_the_longest_match_wins_unless_its_holder_is_much_busier() -> None:
    assert choose_batcher([Candidate("b0", 0, 0), Candidate("b1", 0, 0)]) is None
    assert choose_batcher([Candidate("b0", 2, 3), Candidate("b1", 5, 4)]) == "b1"
    assert choose_batcher([Candidate("b0", 5, 3), Candidate("b1", 5, 1)]) == "b1"
    busiest_routed = int(BUSY_FACTOR * 2 + BUSY_MARGIN)
    assert choose_batcher([Candidate("b0", 0, 2), Candidate("b1", 5, busiest_routed)]) == "b1"
    assert choose_batcher([Candidate("b0", 0, 2), Candidate("b1", 5, busiest_routed + 1)]) is None


@pytest.fixture
def batchers(client: redis.Redis, prefix: str) -> RedisBatcherTransport:
    """One transport, as batchers b0 and b1 would each use theirs."""
    return RedisBatcherTransport(client, prefix, CONFIG)


def submit_request(request_id: str, prompt: list[int] = PROMPT) -> SubmitRequest:
    return SubmitRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=1),
    )


def submit(prefix: str, *request_ids: str, prompt: list[int] = PROMPT) -> None:
    """One at a time, from a new api replica (its router's view of the batchers is fresh)."""
    with BlockingApiTransport.from_url(REDIS_URL, prefix, CONFIG) as api:
        for request_id in request_ids:
            api.submit(submit_request(request_id, prompt))


def beat(transport: RedisBatcherTransport, batcher_id: str) -> None:
    transport.heartbeat(
        Heartbeat(
            batcher_id=batcher_id, num_running=0, num_waiting=0, num_free_blocks=10,
            max_batch_size=8, time=time.time(), kv_block_size=BLOCK_SIZE,
        )
    )  # fmt: skip


def pulled(transport: RedisBatcherTransport, batcher_id: str) -> list[str]:
    return [d.request.request_id for d in transport.pull(batcher_id, 10, 0)]


def test_a_request_goes_to_the_batcher_holding_its_prefix(
    batchers: RedisBatcherTransport, client: redis.Redis, prefix: str
) -> None:
    beat(batchers, "b0")
    beat(batchers, "b1")
    batchers.publish_prefixes("b1", prompt_block_hashes(PROMPT, BLOCK_SIZE)[:2], replace=True)
    submit(prefix, "r0")
    assert pulled(batchers, "b0") == []  # not in the shared queue
    [delivery] = batchers.pull("b1", 10, 0)
    assert delivery.queue == RedisKeys(prefix).routed(Priority.INTERACTIVE, "b1")
    batchers.release("b1", delivery)  # b1 drains: what it held goes to the shared queue
    assert client.xlen(delivery.queue) == 0
    [released] = batchers.pull("b0", 10, 0)
    assert released.request == delivery.request
    batchers.ack("b0", released)
    assert client.xlen(released.queue) == 0


def test_a_much_busier_or_dead_holder_leaves_it_to_the_shared_queue(
    batchers: RedisBatcherTransport, client: redis.Redis, prefix: str
) -> None:
    beat(batchers, "b0")
    beat(batchers, "b1")
    busy_ids = [f"busy-{i}" for i in range(BUSY_MARGIN + 1)]
    submit(prefix, *busy_ids, prompt=[1, 2])
    assert pulled(batchers, "b1") == busy_ids  # b1 runs them: its load
    batchers.publish_prefixes("b1", prompt_block_hashes(PROMPT, BLOCK_SIZE), replace=True)
    submit(prefix, "r0")
    assert pulled(batchers, "b0") == ["r0"]
    client.delete(RedisKeys(prefix).heartbeat("b1"))  # its prefixes are still there
    submit(prefix, "r1")
    assert pulled(batchers, "b0") == ["r1"]


def test_a_dead_batchers_routed_requests_run_elsewhere_exactly_once(
    batchers: RedisBatcherTransport, client: redis.Redis, prefix: str
) -> None:
    keys = RedisKeys(prefix)
    beat(batchers, "b0")
    beat(batchers, "b1")
    batchers.publish_prefixes("b1", prompt_block_hashes(PROMPT, BLOCK_SIZE), replace=True)
    submit(prefix, "r0", "r1", "r2")
    with BlockingApiTransport.from_url(REDIS_URL, prefix, CONFIG) as api:
        assert api.queue_depth() == 3
    [taken] = batchers.pull("b1", 1, 0)  # running on b1 when it dies
    client.delete(keys.heartbeat("b1"))
    moved: list[Any] = []

    def all_moved() -> bool:
        moved.append(batchers.reclaim("b0"))
        return sum(moved) == 3  # two never pulled, at once; the pending one past the lease

    eventually(all_moved, 10, "b1's three requests back in the shared queue")
    deliveries = batchers.pull("b0", 10, 0)
    attempts = {d.request.request_id: d.request.attempt for d in deliveries}
    assert attempts == {"r0": 1, "r1": 1, "r2": 1, taken.request.request_id: 2}
    assert all(d.queue == keys.queue(Priority.INTERACTIVE) for d in deliveries)
    assert batchers.reclaim("b0") == 0
    assert not client.sismember(keys.routed_batchers, "b1")
    assert not client.exists(keys.routed(Priority.INTERACTIVE, "b1"), keys.prefixes("b1"))


def test_one_submit_of_many_counts_each_routed_request_towards_the_load(
    batchers: RedisBatcherTransport, prefix: str
) -> None:
    """As a job's or a batch's requests are enqueued: past the margin, the rest spill."""
    beat(batchers, "b0")
    beat(batchers, "b1")
    batchers.publish_prefixes("b1", prompt_block_hashes(PROMPT, BLOCK_SIZE), replace=True)
    request_ids = [f"r{i}" for i in range(BUSY_MARGIN + 3)]

    async def submit_all() -> None:
        api = AsyncRedisApiTransport.from_url(REDIS_URL, prefix, CONFIG)
        await api.submit([submit_request(request_id) for request_id in request_ids])
        await api.close()

    asyncio.run(submit_all())
    routed = request_ids[: BUSY_MARGIN + 1]  # the last of them: b1 at 4 above b0
    assert pulled(batchers, "b0") == request_ids[len(routed) :]
    assert pulled(batchers, "b1") == routed
