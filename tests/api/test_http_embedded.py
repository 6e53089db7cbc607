"""The embedded mode: no `REDIS_URL`, SQLite, so the api runs its batcher in-process (what `tgq
serve` on a laptop starts). Same routes, same greedy tokens as the offline engine, jobs
persisted in the SQLite file."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.stack import Stack
from tests.api.test_http_routes import encode, offline
from tests.polling import eventually

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def embedded(text_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("embedded")
    url = f"sqlite+aiosqlite:///{root / 'tgq.db'}"
    running = Stack(text_model_dir, url, root, redis_url=None, api_env={"AUTO_MIGRATE": "true"})
    try:
        running.start_api()
        yield running
    finally:
        running.stop()


def test_greedy_tokens_equal_the_offline_engine(embedded: Stack) -> None:
    prompt = "The Python language"
    params = {"max_new_tokens": 10, "details": True}
    answer = httpx.post(
        f"{embedded.url}/generate", json={"inputs": prompt, "parameters": params}, timeout=60
    ).json()
    expected = offline(embedded.model_dir, [encode(embedded.model_dir, prompt)], max_new=10)[0]
    assert [t["id"] for t in answer["details"]["tokens"]] == expected


def test_jobs_are_persisted_in_sqlite(embedded: Stack) -> None:
    body = {"prompt": ["a", "b"], "parameters": {"max_new_tokens": 3}}
    job = httpx.post(f"{embedded.url}/v1/jobs", json=body, timeout=60).json()

    def status() -> dict[str, Any]:
        answer: dict[str, Any] = httpx.get(f"{embedded.url}/v1/jobs/{job['id']}", timeout=10).json()
        return answer

    eventually(lambda: status()["status"] == "succeeded", 60, lambda: f"job succeeded: {status()}")
    assert len(status()["results"]) == 2
    database = embedded.database_url.removeprefix("sqlite+aiosqlite:///")
    with sqlite3.connect(database) as conn:
        rows = conn.execute("SELECT count(*) FROM results WHERE job_id = ?", (job["id"],))
        assert rows.fetchone() == (2,)


def test_structured_output_runs_embedded(embedded: Stack) -> None:
    """The in-process batcher compiles grammars too (`tgq serve` on a laptop)."""
    body = {
        "messages": [{"role": "user", "content": "Pick one"}],
        "guided_choice": ["alpha", "beta"],
        "temperature": 1.5,
        "max_tokens": 8,
    }
    answer = httpx.post(f"{embedded.url}/v1/chat/completions", json=body, timeout=60).json()
    assert answer["choices"][0]["message"]["content"] in ("alpha", "beta")
    assert answer["choices"][0]["finish_reason"] == "stop"


def test_key_limits_and_usage_embedded(text_model_dir: Path, tmp_path: Path) -> None:
    """Keys in SQLite, limits counted in memory (no Redis): the same rule and the same usage."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'tgq.db'}"
    env = {"AUTO_MIGRATE": "true", "REQUIRE_API_KEYS": "true", "API_KEY": "admin"}
    stack = Stack(text_model_dir, url, tmp_path, redis_url=None, api_env=env)
    try:
        stack.start_api()
        admin = {"Authorization": "Bearer admin"}
        limits = {"name": "laptop", "rpm": 2, "max_queued_jobs": 1}
        key = httpx.post(f"{stack.url}/admin/keys", json=limits, headers=admin).json()["key"]
        headers = {"Authorization": f"Bearer {key}"}
        body = {"inputs": "Hello", "parameters": {"max_new_tokens": 3, "ignore_eos": True}}
        answers = [httpx.post(f"{stack.url}/generate", json=body, headers=headers, timeout=60)
                   for _ in range(3)]  # fmt: skip
        assert [a.status_code for a in answers] == [200, 200, 429]
        assert [a.headers["x-ratelimit-remaining-requests"] for a in answers] == ["1", "0", "0"]
        assert answers[2].json()["error"] == (
            "Rate limit reached for this API key: 2 requests per minute"
        )

        def usage() -> dict[str, Any] | None:
            rows = httpx.get(f"{stack.url}/v1/usage", headers=headers).json()["data"]
            return rows[0] if rows and rows[0]["requests"] == 2 else None

        row = eventually(usage, 30, "the two answered requests in /v1/usage")
        assert row is not None and (row["completion_tokens"], row["model"]) == (6, "tgq-test")
        job = {"prompt": ["a"] * 16, "parameters": {"max_new_tokens": 32}}
        first = httpx.post(f"{stack.url}/v1/jobs", json=job, headers=headers, timeout=60)
        second = httpx.post(f"{stack.url}/v1/jobs", json=job, headers=headers, timeout=60)
        assert (first.status_code, second.status_code) == (202, 429)
    finally:
        stack.stop()
