"""Cache-aware routing with batcher processes: requests that share a long prefix run on the
batcher that holds it (their results count its prefix-cache hits), and routed requests of a
batcher killed with `kill -9` (one running there, one still queued for it) complete once each,
with the offline engine's greedy tokens."""

from __future__ import annotations

import random
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.batcher.test_batcher_process import (
    BLOCK_SIZE,
    REDIS_URL,
    follow,
    offline_tokens,
    start_batcher,
)
from tests.polling import eventually
from tgq.batcher.messages import FinalResult, SubmitRequest
from tgq.batcher.prefix_hashes import prompt_block_hashes
from tgq.batcher.request import Priority, StoppingParams
from tgq.batcher.transport.blocking import BlockingApiTransport
from tgq.batcher.transport.redis_keys import GROUP, RedisKeys
from tgq.batcher.transport.routing import summary_member
from tgq.gpu_worker.plan import SamplingParams

STOPPING = StoppingParams(max_new_tokens=8, ignore_eos=True)
PREFIX = [random.Random(5).randrange(3, 512) for _ in range(10 * BLOCK_SIZE)]
FAILOVER = ("--heartbeat-ttl-s", "2", "--lease-s", "1")


def prompt(i: int) -> list[int]:
    return [*PREFIX, 3 + i, 4 + i, 5 + i]


def submit(transport: BlockingApiTransport, request_id: str, stopping: StoppingParams) -> None:
    request = SubmitRequest(
        request_id=request_id,
        prompt_token_ids=prompt(int(request_id[1:])),
        sampling=SamplingParams(),
        stopping=stopping,
    )
    transport.submit(request)


def final(transport: BlockingApiTransport, request_id: str) -> FinalResult:
    result = transport.read_final(request_id, 60.0)
    assert result is not None, f"{request_id} has no final result"
    return result


def warm_up(client: redis.Redis, prefix: str) -> tuple[str, RedisKeys]:
    """Runs r0 on either batcher; returns the one that ran it, once it advertises the prefix.
    (From an api replica of its own: another one's view of the prefixes is not 50 ms old.)"""
    with BlockingApiTransport.from_url(REDIS_URL, prefix) as transport:
        eventually(lambda: len(transport.live_batchers()) == 2, 60, "two batchers live")
        submit(transport, "r0", STOPPING)
        holder, keys = final(transport, "r0").batcher_id, RedisKeys(prefix)
    last = summary_member(prompt_block_hashes(PREFIX, BLOCK_SIZE)[-1])
    eventually(lambda: client.smismember(keys.prefixes(holder), [last])[0], 10, "prefix advertised")
    return holder, keys


@pytest.mark.timeout(240)
def test_requests_sharing_a_prefix_run_where_it_is_cached(
    model_dirs: dict[str, Path], processes: list[subprocess.Popen[bytes]], prefix: str
) -> None:
    model_dir = model_dirs["llama3-gqa"]
    processes += [start_batcher(model_dir, prefix, b) for b in ("b0", "b1")]
    client = redis.Redis.from_url(REDIS_URL)
    holder, _ = warm_up(client, prefix)
    with BlockingApiTransport.from_url(REDIS_URL, prefix) as transport:
        request_ids = [f"r{i}" for i in range(1, 5)]  # within the busy margin of an idle peer
        for request_id in request_ids:
            submit(transport, request_id, STOPPING)
        results = [final(transport, request_id) for request_id in request_ids]
    client.close()
    assert {r.batcher_id for r in results} == {holder}
    assert all(r.num_cached_tokens == len(PREFIX) for r in results)


@pytest.mark.timeout(240)
def test_a_killed_batchers_routed_requests_complete_once(
    model_dirs: dict[str, Path], processes: list[subprocess.Popen[bytes]], prefix: str
) -> None:
    model_dir = model_dirs["llama3-gqa"]
    long_stopping = StoppingParams(max_new_tokens=200, ignore_eos=True)
    expected = offline_tokens(model_dir, [prompt(1), prompt(2)], long_stopping)
    ids = ("b0", "b1")
    processes += [start_batcher(model_dir, prefix, b, *FAILOVER) for b in ids]
    client = redis.Redis.from_url(REDIS_URL)
    holder, keys = warm_up(client, prefix)
    with BlockingApiTransport.from_url(REDIS_URL, prefix) as transport:
        routed = keys.routed(Priority.INTERACTIVE, holder)
        submit(transport, "r1", long_stopping)
        eventually(
            lambda: _pending(client, routed), 60, "r1 running on its holder", interval_s=0.002
        )
        processes[ids.index(holder)].kill()
        submit(transport, "r2", long_stopping)  # its heartbeat lives on: queued for it
        assert client.xlen(routed) == 2
        assert [follow(transport, r) for r in ("r1", "r2")] == expected
        results = [final(transport, r) for r in ("r1", "r2")]
        assert [r.attempt for r in results] == [2, 1]  # r1 reran, r2 had not started
        assert {r.batcher_id for r in results} == set(ids) - {holder}
        eventually(lambda: transport.queue_depth() == 0, 10, "nothing left in any queue")
    assert not client.exists(routed)
    client.close()


def _pending(client: redis.Redis, stream: str) -> bool:
    summary: Any = client.xpending(stream, GROUP)
    return bool(summary["pending"])
