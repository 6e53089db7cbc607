"""A real batcher process on a tiny model, fed through the real Redis: 50 requests come back with
exactly the offline engine's greedy tokens, streamed in order, each with one final result; SIGTERM
exits 0."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import pytest
import redis

from tgq.batcher.config import SchedulerConfig
from tgq.batcher.engine import LLMEngine
from tgq.batcher.messages import SubmitRequest
from tgq.batcher.request import Priority, StoppingParams
from tgq.batcher.transport.base import ApiTransport
from tgq.batcher.transport.blocking import BlockingApiTransport
from tgq.gpu_worker.config import model_eos_token_ids
from tgq.gpu_worker.plan import SamplingParams
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig

REDIS_URL = "redis://127.0.0.1:6379/0"
NUM_REQUESTS = 50
NUM_BLOCKS = 256
BLOCK_SIZE = 16
STOPPING = StoppingParams(max_new_tokens=8)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    prefix = f"test-{uuid.uuid4().hex}"
    yield prefix
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{prefix}:*"))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def api(redis_prefix: str) -> Iterator[BlockingApiTransport]:
    """The api's side of Redis on the test's prefix, as the test plays an api replica."""
    with BlockingApiTransport.from_url(REDIS_URL, redis_prefix) as api:
        yield api


def make_prompts(num_prompts: int = NUM_REQUESTS) -> list[list[int]]:
    rng = random.Random(4)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(1, 40))] for _ in range(num_prompts)]


def offline_tokens(
    model_dir: Path, prompts: list[list[int]], stopping: StoppingParams = STOPPING
) -> list[list[int]]:
    config = RunnerConfig(str(model_dir), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    eos_token_ids = model_eos_token_ids(model_dir)
    engine = LLMEngine(ModelRunner(config), SchedulerConfig(), eos_token_ids=eos_token_ids)
    return [g.token_ids for g in engine.generate(prompts, stopping=stopping)]


def start_batcher(
    model_dir: Path,
    prefix: str,
    batcher_id: str,
    *options: str,
    redis_url: str = REDIS_URL,
    stderr: int | IO[bytes] = subprocess.PIPE,
) -> subprocess.Popen[bytes]:
    """The batcher process; its log goes to `stderr` (a pipe, read once it has exited, or a
    file a test reads while it runs)."""
    command = [
        sys.executable, "-m", "tgq.batcher", "--model-id", str(model_dir), "--redis-url", redis_url,
        "--prefix", prefix, "--batcher-id", batcher_id, "--num-blocks", str(NUM_BLOCKS),
        "--block-size", str(BLOCK_SIZE), "--max-batch-size", "16", *options,
    ]  # fmt: skip
    # PYTHONFAULTHANDLER: SIGABRT prints every thread's stack (`exit_code` does, on a hang)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    return subprocess.Popen(command, cwd=ROOT, env=env, stderr=stderr)


def exit_code(process: subprocess.Popen[bytes], timeout_s: float) -> int:
    """The batcher's exit code; if it has not exited within `timeout_s`, the test fails with
    where each of its threads is (its stderr's tail)."""
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        _, stderr = process.communicate(timeout=30)
        pytest.fail(f"the batcher did not exit within {timeout_s} s:\n{stderr.decode()[-6000:]}")


def submit_all(
    transport: ApiTransport,
    prompts: list[list[int]],
    stopping: StoppingParams = STOPPING,
    *,
    priority_of: Callable[[int], Priority] = lambda _: Priority.INTERACTIVE,
) -> None:
    """Prompt i as request `r{i}`, greedy, at `priority_of(i)`."""
    for i, prompt in enumerate(prompts):
        transport.submit(
            SubmitRequest(
                request_id=f"r{i}",
                prompt_token_ids=prompt,
                sampling=SamplingParams(),
                stopping=stopping,
                priority=priority_of(i),
            )
        )


def follow(transport: ApiTransport, request_id: str) -> list[int]:
    """A streaming reader: token ids of every event in order, until the final result."""
    token_ids: list[int] = []
    seq_index = 0
    while transport.read_final(request_id) is None or transport.read_tokens(
        request_id, seq_index, 0
    ):
        for event in transport.read_tokens(request_id, seq_index, 5.0):
            assert event.seq_index == seq_index
            token_ids += event.token_ids
            seq_index += 1
    return token_ids


@pytest.mark.timeout(180)
def test_fifty_requests_through_redis_match_the_offline_engine(
    model_dirs: dict[str, Path], redis_prefix: str, api: BlockingApiTransport
) -> None:
    model_dir, prompts = model_dirs["llama3-gqa"], make_prompts()
    process = start_batcher(model_dir, redis_prefix, "b0")
    try:
        expected = offline_tokens(model_dir, prompts)
        submit_all(
            api,
            prompts,
            priority_of=lambda i: Priority.BULK if i % 3 == 0 else Priority.INTERACTIVE,
        )
        for i, reference in enumerate(expected):
            assert follow(api, f"r{i}") == reference
            result = api.read_final(f"r{i}", 60)
            assert result is not None
            assert result.token_ids == reference
            assert (result.attempt, result.batcher_id) == (1, "b0")
            assert result.finish_reason in ("length", "stop")
        assert [b.batcher_id for b in api.live_batchers()] == ["b0"]
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 0, stderr.decode()[-2000:]
        assert b"drained" in stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
