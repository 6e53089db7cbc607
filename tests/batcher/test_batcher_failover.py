"""Batcher processes losing a peer or their Redis: `kill -9` of one of two batchers mid-generation
and a Redis restart mid-run both end with every request complete, with exactly the offline
engine's greedy tokens and one final result each."""

from __future__ import annotations

import signal
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.api.stack import delete_keys
from tests.batcher.test_batcher_process import (
    REDIS_URL,
    follow,
    make_prompts,
    offline_tokens,
    start_batcher,
    submit_all,
)
from tests.polling import eventually
from tests.reliability.redis_server import private_redis
from tgq.batcher.messages import FinalResult
from tgq.batcher.request import Priority, StoppingParams
from tgq.batcher.transport.base import ApiTransport
from tgq.batcher.transport.blocking import BlockingApiTransport
from tgq.batcher.transport.redis_keys import GROUP, RedisKeys

STOPPING = StoppingParams(max_new_tokens=64, ignore_eos=True)
FAST_FAILOVER = ("--heartbeat-ttl-s", "1", "--lease-s", "1", "--max-batch-size", "6")


def check_results(transport: ApiTransport, expected: list[list[int]]) -> list[FinalResult]:
    results = []
    for i, reference in enumerate(expected):
        assert follow(transport, f"r{i}") == reference
        result = transport.read_final(f"r{i}")
        assert result is not None
        assert (result.token_ids, result.finish_reason) == (reference, "length")
        results.append(result)
    return results


def drain(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, (stderr or b"(its log went to a file)").decode()[-2000:]


@pytest.mark.timeout(240)
def test_kill_9_of_one_batcher_loses_nothing(
    model_dirs: dict[str, Path], processes: list[subprocess.Popen[bytes]]
) -> None:
    model_dir, prompts = model_dirs["llama3-gqa"], make_prompts(30)
    prefix = f"test-{uuid.uuid4().hex}"
    client = redis.Redis.from_url(REDIS_URL)
    transport = BlockingApiTransport.from_url(REDIS_URL, prefix)
    try:
        processes += [start_batcher(model_dir, prefix, b, *FAST_FAILOVER) for b in ("b0", "b1")]
        expected = offline_tokens(model_dir, prompts, STOPPING)
        eventually(
            lambda: len(transport.live_batchers()) == 2,
            60,
            lambda: f"two batchers live: {transport.live_batchers()}",
        )
        submit_all(transport, prompts, STOPPING)
        # b1 holds unacknowledged requests, i.e. unfinished ones: watched on the consumer group
        # itself, since a tiny model can finish a request between two heartbeats.
        eventually(
            lambda: _holds_requests(client, prefix, "b1"),
            60,
            lambda: f"b1 holds requests; live: {transport.live_batchers()}",
            interval_s=0.002,
        )
        processes[1].kill()  # mid-generation
        results = check_results(transport, expected)
        assert any(r.batcher_id == "b0" and r.attempt == 1 for r in results)
        assert any(r.batcher_id == "b0" and r.attempt == 2 for r in results)  # b1's, rerun
        drain(processes[0])
    finally:
        transport.close()
        client.close()
        delete_keys(REDIS_URL, prefix)


def _holds_requests(client: redis.Redis, prefix: str, batcher_id: str) -> bool:
    for priority in Priority:
        pending: Any = client.xpending_range(
            RedisKeys(prefix).queue(priority), GROUP, "-", "+", 1, consumername=batcher_id
        )
        if pending:
            return True
    return False


@pytest.mark.timeout(240)
def test_a_redis_restart_mid_run_is_survived(
    model_dirs: dict[str, Path], processes: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    model_dir, prompts = model_dirs["llama3-gqa"], make_prompts(20)
    log_path = tmp_path / "b0.log"
    with private_redis(tmp_path) as server:
        with log_path.open("wb") as log:  # the batcher keeps its own copy of the file
            processes.append(
                start_batcher(model_dir, "tgq", "b0", redis_url=server.url, stderr=log)
            )
        transport = BlockingApiTransport.from_url(server.url, "tgq")
        expected = offline_tokens(model_dir, prompts, STOPPING)
        submit_all(transport, prompts, STOPPING)
        assert transport.read_final("r0", 60) is not None
        assert transport.read_final(f"r{len(prompts) - 1}") is None  # mid-run
        server.stop()  # a clean shutdown keeps the AOF
        eventually(  # the outage itself: the batcher's calls fail, then Redis is back
            lambda: b"transport unavailable" in log_path.read_bytes(),
            30,
            lambda: f"the batcher never saw Redis gone: {log_path.read_text()[-2000:]}",
        )
        server.start()
        results = check_results(transport, expected)
        assert processes[0].poll() is None  # the same batcher process, no crash loop
        assert {r.batcher_id for r in results} == {"b0"}
        drain(processes[0])
        transport.close()
