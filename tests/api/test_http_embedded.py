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
