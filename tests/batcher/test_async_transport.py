"""The api's asyncio transports against the batcher side they talk to: Redis (real server) and
the in-process transport behind a thread pool."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator

import pytest
import redis

from tests.finals import final_result
from tgq.batcher.messages import Heartbeat, SubmitRequest, TokenEvent
from tgq.batcher.request import StoppingParams
from tgq.batcher.transport.aio import AsyncApiTransport, AsyncRedisApiTransport
from tgq.batcher.transport.base import BatcherTransport, TransportConfig
from tgq.batcher.transport.memory import MemoryTransport
from tgq.batcher.transport.redis import RedisBatcherTransport
from tgq.batcher.transport.threaded import ThreadedApiTransport
from tgq.gpu_worker.plan import SamplingParams

REDIS_URL = "redis://127.0.0.1:6379/0"
CONFIG = TransportConfig(lease_s=0.05, heartbeat_ttl_s=0.5)
Pair = tuple[Callable[[], AsyncApiTransport], BatcherTransport]

pytestmark = pytest.mark.timeout(20)


@pytest.fixture(params=["memory", "redis"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    """(a factory of the api side, made inside the event loop; the batcher side)."""
    if request.param == "memory":
        memory = MemoryTransport(CONFIG)
        yield (lambda: ThreadedApiTransport(memory, 8)), memory
        return
    prefix = f"test-{uuid.uuid4().hex}"
    client = redis.Redis.from_url(REDIS_URL)
    yield (
        (lambda: AsyncRedisApiTransport.from_url(REDIS_URL, prefix, CONFIG)),
        RedisBatcherTransport(client, prefix, CONFIG),
    )
    keys = list(client.scan_iter(match=f"{prefix}:*"))
    if keys:
        client.delete(*keys)
    client.close()


def run(pair: Pair, body: Callable[[AsyncApiTransport, BatcherTransport], Awaitable[None]]) -> None:
    async def main() -> None:
        api = pair[0]()
        try:
            await body(api, pair[1])
        finally:
            await api.close()

    asyncio.run(main())


def submit_request(request_id: str) -> SubmitRequest:
    return SubmitRequest(
        request_id=request_id,
        prompt_token_ids=[1, 2],
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=2),
    )


def test_submit_reaches_the_batcher_in_order(pair: Pair) -> None:
    async def body(api: AsyncApiTransport, batcher: BatcherTransport) -> None:
        await api.submit([submit_request(f"r{i}") for i in range(3)])
        assert await api.queue_depth() == 3
        pulled = batcher.pull("b0", 10, 0)
        assert [d.request for d in pulled] == [submit_request(f"r{i}") for i in range(3)]

    run(pair, body)


def test_a_reader_follows_tokens_then_the_final(pair: Pair) -> None:
    async def body(api: AsyncApiTransport, batcher: BatcherTransport) -> None:
        async def produce() -> None:
            for seq in range(3):
                await asyncio.sleep(0.02)
                event = TokenEvent(
                    request_id="r0",
                    seq_index=seq,
                    token_ids=[seq],
                    logprobs=[None],
                    text=f"t{seq}",
                    attempt=1,
                    created_at=time.time(),
                    top_logprobs=[[(5, -1.0)]],
                )
                batcher.publish_tokens([event])
            batcher.publish_final(final_result("r0", [0, 1, 2]))

        producer = asyncio.create_task(produce())
        seen: list[TokenEvent] = []
        while len(seen) < 3:
            seen += await api.read_tokens("r0", len(seen), 2.0)
        assert [e.text for e in seen] == ["t0", "t1", "t2"]
        assert seen[0].top_logprobs == [[(5, -1.0)]]
        final = await api.read_final("r0", 2.0)
        await producer
        assert final is not None and final.token_ids == [0, 1, 2]
        assert await api.read_tokens("r0", 3, 0.05) == []
        stored = await api.pull_finals("api-1", 10, 0)
        assert [s.result.request_id for s in stored] == ["r0"]
        await api.ack_finals([s.entry_id for s in stored])
        assert await api.pull_finals("api-1", 10, 0) == []

    run(pair, body)


def test_abort_and_live_batchers(pair: Pair) -> None:
    async def body(api: AsyncApiTransport, batcher: BatcherTransport) -> None:
        batcher.poll_aborts("b0")
        batcher.heartbeat(
            Heartbeat(
                batcher_id="b0",
                num_running=0,
                num_waiting=0,
                num_free_blocks=10,
                max_batch_size=4,
                time=time.time(),
            )
        )
        assert [b.batcher_id for b in await api.live_batchers()] == ["b0"]
        await api.submit([submit_request("r0")])
        await api.abort("r0")
        assert batcher.poll_aborts("b0") == ["r0"]
        assert batcher.pull("b0", 1, 0)[0].is_aborted

    run(pair, body)


def test_the_started_log(pair: Pair) -> None:
    async def body(api: AsyncApiTransport, batcher: BatcherTransport) -> None:
        cursor, ids = await api.read_started(None, 10, 0)
        assert ids == []
        batcher.publish_tokens(
            [
                TokenEvent(request_id="r0", seq_index=0, token_ids=[5], logprobs=[None]),
                TokenEvent(request_id="r0", seq_index=1, token_ids=[6], logprobs=[None]),
            ]
        )
        cursor, ids = await api.read_started(cursor, 10, 100)
        assert ids == ["r0"]
        assert await api.read_started(cursor, 10, 0) == (cursor, [])

    run(pair, body)


def test_many_readers_at_once_each_get_their_own_stream_in_order(pair: Pair) -> None:
    """Through the Redis side these share one XREAD (the token hub); ordering, finals and
    timeouts hold per reader."""
    num_requests, num_events = 40, 6

    async def follow(api: AsyncApiTransport, request_id: str) -> list[int]:
        token_ids: list[int] = []
        seq = 0
        while True:
            events = await api.read_tokens(request_id, seq, 2.0)
            for event in events:
                assert event.seq_index == seq
                token_ids += event.token_ids
                seq += 1
            if not events and await api.read_final(request_id) is not None:
                return token_ids

    def publish(batcher: BatcherTransport) -> None:
        for seq in range(num_events):
            batcher.publish_tokens(
                [
                    TokenEvent(
                        request_id=f"r{i}",
                        seq_index=seq,
                        token_ids=[i * 100 + seq],
                        logprobs=[None],
                    )
                    for i in range(num_requests)
                ]
            )
            time.sleep(0.01)
        for i in range(num_requests):
            batcher.publish_final(final_result(f"r{i}", [], num_output_tokens=6))

    async def body(api: AsyncApiTransport, batcher: BatcherTransport) -> None:
        readers = [asyncio.create_task(follow(api, f"r{i}")) for i in range(num_requests)]
        await asyncio.sleep(0.05)
        await asyncio.to_thread(publish, batcher)
        results = await asyncio.gather(*readers)
        for i, token_ids in enumerate(results):
            assert token_ids == [i * 100 + seq for seq in range(num_events)]
        started = time.monotonic()
        assert await api.read_tokens("nobody", 0, 0.2) == []  # a timeout is an empty answer
        assert 0.15 < time.monotonic() - started < 1.5

    run(pair, body)


def test_a_reader_from_further_back_reads_the_stream_again(pair: Pair) -> None:
    async def body(api: AsyncApiTransport, batcher: BatcherTransport) -> None:
        batcher.publish_tokens(
            [
                TokenEvent(request_id="r0", seq_index=seq, token_ids=[seq], logprobs=[None])
                for seq in range(3)
            ]
        )
        assert [e.seq_index for e in await api.read_tokens("r0", 0, 1.0)] == [0, 1, 2]
        assert await api.read_tokens("r0", 3, 0.05) == []
        again = await api.read_tokens("r0", 1, 1.0)  # a reconnecting client
        assert [e.seq_index for e in again] == [1, 2]
        batcher.publish_final(final_result("r0", [0, 1, 2]))
        assert await api.read_tokens("r0", 3, 1.0) == []  # ended: nothing new, at once
        assert [e.seq_index for e in await api.read_tokens("r0", 2, 1.0)] == [2]

    run(pair, body)


def test_warm_up_opens_the_connections_ahead(pair: Pair) -> None:
    """The Redis pool holds the warmed connections, connected and idle, for the first burst."""

    async def body(api: AsyncApiTransport, _: BatcherTransport) -> None:
        await api.warm_up(5)
        if isinstance(api, AsyncRedisApiTransport):
            pool = api.client.connection_pool
            idle = pool._available_connections  # redis-py keeps no public count of them
            assert len(idle) == 5 and all(c.is_connected for c in idle)
        await api.submit([submit_request("r-warm")])  # and the transport works as before

    run(pair, body)


def test_in_process_readers_wait_on_the_loop_not_on_threads() -> None:
    """Many streams waiting at once, with one pool thread: each is woken by its own publish (or
    its final result), none waits for another's timeout, none for a free thread; a watcher left
    by a reader that timed out is gone."""
    memory = MemoryTransport(CONFIG)

    async def main() -> None:
        api = ThreadedApiTransport(memory, max_workers=1)
        ids = [f"r{i}" for i in range(20)]
        readers = [asyncio.create_task(api.read_tokens(i, 0, 15.0)) for i in ids]
        await asyncio.sleep(0)  # one turn of the loop: every reader starts and waits
        assert len(memory._watchers) == 20

        def publish() -> None:
            memory.publish_tokens(
                [
                    TokenEvent(request_id=i, seq_index=0, token_ids=[1], logprobs=[None])
                    for i in ids[:-1]
                ]
            )
            memory.publish_final(final_result(ids[-1], []))

        started = time.monotonic()
        await asyncio.to_thread(publish)
        results = await asyncio.gather(*readers)
        assert time.monotonic() - started < 5.0  # far below the readers' 15 s timeout
        assert [len(events) for events in results] == [1] * 19 + [0]
        assert await api.read_tokens("r0", 1, 0.01) == []  # times out: nothing new
        assert not memory._watchers
        await api.close()

    asyncio.run(main())
