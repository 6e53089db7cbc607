"""A batcher started with a hub id serves the snapshot from the Hugging Face cache (offline here):
the same greedy tokens as the model's directory. An id that is neither a directory nor in the
cache stops the batcher at start with a message naming it."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from tests.batcher import test_batcher_process
from tests.batcher.test_batcher_process import (
    follow,
    make_prompts,
    offline_tokens,
    start_batcher,
    submit_all,
)
from tests.gpu_worker.test_loading import hub_cache
from tgq.batcher.transport.blocking import BlockingApiTransport

REPO = "tgq-test/tiny-llama"
redis_prefix = test_batcher_process.redis_prefix  # the fixture: a fresh key prefix per test
api = test_batcher_process.api  # the fixture: the api's side on that prefix


@pytest.mark.timeout(120)
def test_a_hub_id_is_served_from_the_cache(
    model_dirs: dict[str, Path],
    redis_prefix: str,
    api: BlockingApiTransport,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model_dir, prompts = model_dirs["llama3-gqa"], make_prompts(4)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache(tmp_path / "hub", REPO, model_dir)))
    process = start_batcher(Path(REPO), redis_prefix, "b0")
    try:
        submit_all(api, prompts)
        expected = offline_tokens(model_dir, prompts)
        assert [follow(api, f"r{i}") for i in range(len(prompts))] == expected
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 0, stderr.decode()[-2000:]
        assert f"serving {tmp_path / 'hub'}".encode() in stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_an_unknown_model_stops_the_batcher_at_start(
    redis_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    process = start_batcher(Path("tgq-test/missing"), redis_prefix, "b0")
    try:
        _, stderr = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    assert process.returncode == 1
    assert b"batcher: model 'tgq-test/missing' is not a local directory" in stderr
