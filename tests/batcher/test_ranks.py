"""`ShardedRunner`'s pipes to its ranks, on real pipes and a real process that neither reads nor
beats (as a SIGSTOPped rank): a plan larger than the pipe cannot block the batcher past the hang
timeout, and a rank that answered before its first heartbeat is held to the hang timeout, not
to the start-up one."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tgq.batcher.ranks import ShardConfig, ShardedRunner, WorkerLostError, _Rank
from tgq.gpu_worker import rank_protocol as protocol

pytestmark = pytest.mark.timeout(30)


@dataclass
class DeafRank:
    rank: _Rank
    answer_write: int  # the rank's end of its answer pipe: the test answers in its place


@pytest.fixture
def deaf() -> Iterator[DeafRank]:
    """A live process that neither reads its plans nor beats, yet to beat for the first time."""
    process = subprocess.Popen(["sleep", "60"])
    plan_read, plan_write = os.pipe()
    answer_read, answer_write = os.pipe()
    beat_read, beat_write = os.pipe()
    for fd in (plan_write, beat_read):
        os.set_blocking(fd, False)
    rank = _Rank(0, process, plan_write, answer_read, beat_read, time.monotonic())
    yield DeafRank(rank, answer_write)
    process.kill()
    process.wait()
    for fd in (plan_read, plan_write, answer_read, answer_write, beat_read, beat_write):
        os.close(fd)


def runner_of(rank: _Rank) -> ShardedRunner:
    runner = object.__new__(ShardedRunner)  # the pipes alone: no rank processes to start
    runner.config = ShardConfig("model", num_shard=2, hang_timeout_s=0.5, start_timeout_s=600)
    runner._ranks = [rank]
    return runner


def test_a_plan_larger_than_the_pipe_to_a_stopped_rank_is_a_lost_rank(deaf: DeafRank) -> None:
    deaf.rank.has_beaten = True
    runner = runner_of(deaf.rank)
    started = time.monotonic()
    with pytest.raises(WorkerLostError, match="rank 0 hung: no heartbeat"):
        runner._send_all(b"x" * (4 << 20))  # far more than a pipe holds (64 KiB on Linux)
    assert time.monotonic() - started < 5


def test_a_rank_that_answered_before_beating_is_held_to_the_hang_timeout(deaf: DeafRank) -> None:
    """Its `ready` came before its first beat; then it stopped: 5 s, not the 600 of start-up."""
    runner = runner_of(deaf.rank)
    protocol.write(deaf.answer_write, protocol.encode({"type": "ready"}))
    assert runner._expect(deaf.rank, "ready", timeout_s=600) == {"type": "ready"}
    started = time.monotonic()
    with pytest.raises(WorkerLostError, match="rank 0 hung: no heartbeat"):
        runner._answer(deaf.rank)
    assert time.monotonic() - started < 5
