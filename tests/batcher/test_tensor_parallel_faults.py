"""A batcher with `--num-shard 2` losing a rank, or dying itself: `kill -9` of a rank mid-
generation, or a rank that hangs (SIGSTOP), makes the batcher hand its requests back and exit
non-zero (3), and another batcher completes them with the offline engine's greedy tokens;
`kill -9` of the batcher takes its ranks down with it within 10 s (no orphan holds the model's
memory)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.batcher.test_batcher_failover import (
    FAST_FAILOVER,
    STOPPING,
    _holds_requests,
    check_results,
    drain,
)
from tests.batcher.test_batcher_process import (
    REDIS_URL,
    api,
    exit_code,
    make_prompts,
    offline_tokens,
    redis_prefix,
    start_batcher,
    submit_all,
)
from tests.polling import eventually
from tgq.batcher.transport.blocking import BlockingApiTransport

__all__ = ["api", "redis_prefix"]  # the fixtures (`processes`: conftest.py)
SHARDED = ("--num-shard", "2", "--threads-per-rank", "1")
EXIT_RANK_LOST = 3


def ranks_of(process: subprocess.Popen[bytes]) -> list[int]:
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
    return [int(pid) for pid in children]


def is_running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    yield client
    client.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("signal_name", "rank"),
    [("KILL", 1), ("STOP", 0)],  # a rank that dies; one that hangs (no exit, no heartbeat)
)
def test_a_lost_rank_hands_the_work_to_another_batcher(
    signal_name: str,
    rank: int,
    model_dirs: dict[str, Path],
    processes: list[subprocess.Popen[bytes]],
    redis_prefix: str,
    api: BlockingApiTransport,
    client: redis.Redis,
) -> None:
    model_dir, prompts = model_dirs["llama3-gqa"], make_prompts(24)
    prefix = redis_prefix
    processes.append(start_batcher(model_dir, prefix, "b0", *FAST_FAILOVER, *SHARDED))
    expected = offline_tokens(model_dir, prompts, STOPPING)
    eventually(
        lambda: len(api.live_batchers()) == 1,
        60,
        lambda: f"one batcher live: {api.live_batchers()}",
    )
    ranks = ranks_of(processes[0])
    assert len(ranks) == 2
    submit_all(api, prompts, STOPPING)
    eventually(
        lambda: _holds_requests(client, prefix, "b0"), 60, "b0 holds requests", interval_s=0.002
    )
    subprocess.run(["kill", f"-{signal_name}", str(ranks[rank])], check=True)  # mid-generation
    lost_at = time.monotonic()
    code = exit_code(processes[0], 60)
    noticed_s = time.monotonic() - lost_at
    print(f"rank {rank} SIG{signal_name}: the batcher exited {code} after {noticed_s:.1f} s")
    assert code == EXIT_RANK_LOST, processes[0].stderr.read().decode()[-3000:]  # type: ignore[union-attr]
    assert noticed_s < 10  # a hang: the 5 s heartbeat timeout
    eventually(  # the batcher killed them
        lambda: not any(is_running(pid) for pid in ranks), 10, f"ranks {ranks} gone"
    )
    processes.append(start_batcher(model_dir, prefix, "b1", *FAST_FAILOVER))
    results = check_results(api, expected)
    assert any(r.batcher_id == "b1" for r in results)
    drain(processes[1])


@pytest.mark.timeout(120)
def test_kill_9_of_the_batcher_takes_its_ranks_down(
    model_dirs: dict[str, Path],
    processes: list[subprocess.Popen[bytes]],
    redis_prefix: str,
    api: BlockingApiTransport,
) -> None:
    model_dir = model_dirs["llama3-gqa"]
    processes.append(start_batcher(model_dir, redis_prefix, "b0", *SHARDED))
    eventually(
        lambda: len(api.live_batchers()) == 1,
        60,
        lambda: f"one batcher live: {api.live_batchers()}",
    )
    ranks = ranks_of(processes[0])
    assert len(ranks) == 2 and all(is_running(pid) for pid in ranks)
    processes[0].kill()
    processes[0].wait()
    killed_at = time.monotonic()
    eventually(lambda: not any(is_running(pid) for pid in ranks), 10, f"ranks {ranks} gone")
    print(f"ranks gone {time.monotonic() - killed_at:.2f} s after the batcher")
