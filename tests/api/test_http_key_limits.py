"""Per-key limits and usage through HTTP: three api replicas (one Redis, one Postgres, one
batcher) serve one key whose limits hold across them; the openai SDK honours the 429's
`Retry-After` and then succeeds; a bulk key's job runs at bulk priority and its queued-jobs limit
holds; `/v1/usage` adds up to the usage the clients were answered with."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.api.stack import Stack, create_api_key, free_port, migrated_database
from tests.polling import eventually
from tgq.api.key_policy import KeyLimits

ADMIN = "admin-key"
OPEN = ("queued", "running")
WINDOW_S = 2.0  # the replicas' per-minute window, short for the test


@dataclass
class Replicas:
    stacks: list[Stack]
    database_url: str

    @property
    def urls(self) -> list[str]:
        return [stack.url for stack in self.stacks]

    def new_key(self, name: str, limits: KeyLimits) -> str:
        return create_api_key(self.database_url, name, limits)


@pytest.fixture(scope="module")
def replicas(text_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    logs = tmp_path_factory.mktemp("logs")
    settings = {
        "REQUIRE_API_KEYS": "true",
        "API_KEY": ADMIN,
        "RATE_LIMIT_WINDOW_S": str(WINDOW_S),
    }
    with migrated_database() as url:
        first = Stack(text_model_dir, url, logs, api_env=settings, name="api0")
        stacks = [first] + [
            Stack(text_model_dir, url, logs, prefix=first.prefix, port=free_port(),
                  api_env=settings, name=f"api{i}")
            for i in (1, 2)
        ]  # fmt: skip
        try:
            first.start_batcher()
            for stack in stacks:
                stack.start_api()
            yield Replicas(stacks, url)
        finally:
            for stack in reversed(stacks):
                stack.stop()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_concurrency_across_three_replicas_never_exceeds_the_keys_limit(
    replicas: Replicas,
) -> None:
    """Random bursts of streams, each to a random replica: the spans during which a client
    receives tokens (within the time its request holds a lease) never overlap more than the
    key's `max_concurrent`; every refusal is a 429 naming the limit, with its headers."""
    key = replicas.new_key("bursty", KeyLimits(max_concurrent=2, rpm=1000))
    rng = random.Random(3)
    spans: list[tuple[float, float]] = []
    refusals: list[httpx.Response] = []
    lock = threading.Lock()

    def stream(url: str, num_tokens: int) -> None:
        body = {"inputs": "Hello", "parameters": {"max_new_tokens": num_tokens}}
        with httpx.stream(
            "POST", f"{url}/generate_stream", json=body, headers=bearer(key), timeout=60
        ) as response:
            if response.status_code == 429:
                response.read()
                with lock:
                    refusals.append(response)
                return
            assert response.status_code == 200, response.read()
            assert response.headers["x-ratelimit-limit-requests"] == "1000"
            first = None
            for _ in response.iter_bytes():
                first = first or time.monotonic()
            with lock:
                spans.append((first or time.monotonic(), time.monotonic()))

    for _ in range(8):
        threads = [
            threading.Thread(target=stream, args=(rng.choice(replicas.urls), rng.randint(4, 24)))
            for _ in range(rng.randint(3, 8))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert spans and refusals
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    running = max_running = 0
    for _, step in events:
        running += step
        max_running = max(max_running, running)
    assert max_running <= 2
    for refused in refusals:
        assert refused.json()["error"] == (
            "Rate limit reached for this API key: 2 concurrent requests"
        )
        assert refused.headers["Retry-After"] == "1"
        assert int(refused.headers["x-ratelimit-remaining-requests"]) >= 0
    limited = [httpx.get(f"{url}/metrics").text for url in replicas.urls]
    assert any('tgq_key_rate_limited{key="bursty",limit="concurrent"}' in m for m in limited)


def test_the_openai_sdk_waits_as_told_and_then_succeeds(replicas: Replicas) -> None:
    key = replicas.new_key("patient", KeyLimits(rpm=1))
    statuses: list[int] = []
    hooks = {"response": [lambda response: statuses.append(response.status_code)]}
    client = openai.OpenAI(
        base_url=f"{replicas.urls[1]}/v1",
        api_key=key,
        max_retries=3,
        http_client=openai.DefaultHttpxClient(event_hooks=hooks),
    )
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi"}]
    first = client.chat.completions.create(model="tgq-test", messages=messages, max_tokens=2)
    start = time.monotonic()
    second = client.chat.completions.create(model="tgq-test", messages=messages, max_tokens=2)
    assert first.usage is not None and second.usage is not None
    assert statuses[0] == 200 and statuses[-1] == 200 and 429 in statuses
    assert time.monotonic() - start > 0.2  # it waited for the window to free a request


def test_a_bulk_keys_jobs_run_at_bulk_priority_within_its_queued_jobs_limit(
    replicas: Replicas,
) -> None:
    key = replicas.new_key("nightly", KeyLimits(max_queued_jobs=1, priority="bulk"))
    job = {"prompt": ["Once"] * 32, "priority": "interactive", "parameters": {"max_new_tokens": 64}}
    created = httpx.post(f"{replicas.urls[0]}/v1/jobs", json=job, headers=bearer(key))
    assert created.status_code == 202 and created.json()["priority"] == "bulk"
    refused = httpx.post(f"{replicas.urls[2]}/v1/jobs", json=job, headers=bearer(key))
    assert refused.status_code == 429
    assert refused.json()["error"]["message"] == (
        "Rate limit reached for this API key: 1 jobs and batches are open (max_queued_jobs=1)"
    )
    job_url = f"{replicas.urls[0]}/v1/jobs/{created.json()['id']}"
    eventually(
        lambda: httpx.get(job_url, headers=bearer(key)).json()["status"] not in OPEN,
        120,
        "the first job finished",
    )
    again = httpx.post(f"{replicas.urls[2]}/v1/jobs", json=job, headers=bearer(key))
    assert again.status_code == 202


def test_usage_adds_up_to_what_the_clients_were_answered(replicas: Replicas) -> None:
    key = replicas.new_key("counted", KeyLimits())
    answered = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}
    for i, url in enumerate(replicas.urls * 2):
        body = {"model": "tgq-test", "prompt": "Count " * (i + 1), "max_tokens": 3 + i, "n": 1}
        usage = httpx.post(f"{url}/v1/completions", json=body, headers=bearer(key)).json()["usage"]
        answered["requests"] += 1
        answered["prompt_tokens"] += usage["prompt_tokens"]
        answered["completion_tokens"] += usage["completion_tokens"]

    def usage_rows() -> list[dict[str, Any]] | None:
        rows: list[dict[str, Any]] = httpx.get(
            f"{replicas.urls[1]}/v1/usage", headers=bearer(key)
        ).json()["data"]
        totals = {name: sum(row[name] for row in rows) for name in answered}
        return rows if totals == answered else None

    # Results are written by the replicas' persisters, just after the answers.
    rows = eventually(usage_rows, 30, f"usage equal to the answers' {answered}")
    assert rows is not None
    assert [row["model"] for row in rows] == ["tgq-test"] and "api_key_id" not in rows[0]
    every = httpx.get(f"{replicas.urls[2]}/v1/usage", headers=bearer(ADMIN)).json()["data"]
    assert len({row["api_key_id"] for row in every}) >= 2  # the admin sees every key
    metrics = httpx.get(f"{replicas.urls[0]}/metrics").text  # each replica its own requests
    assert 'tgq_key_requests{key="counted"} 2.0' in metrics


def test_the_admin_creates_keys_and_sets_their_limits(replicas: Replicas) -> None:
    url = replicas.urls[0]
    created = httpx.post(
        f"{url}/admin/keys", json={"name": "team-a", "rpm": 5}, headers=bearer(ADMIN)
    )
    assert created.status_code == 201 and created.json()["limits"]["rpm"] == 5
    key, key_id = created.json()["key"], created.json()["id"]
    assert httpx.get(f"{url}/admin/keys", headers=bearer(key)).status_code == 404  # not admin
    changed = httpx.put(
        f"{url}/admin/keys/{key_id}/limits", json={"tpm": 900}, headers=bearer(ADMIN)
    )
    assert changed.json()["limits"] == {
        "rpm": None, "tpm": 900, "max_concurrent": None, "max_queued_jobs": None,
        "priority": None, "adapters": None,
    }  # fmt: skip

    def generate() -> httpx.Response | None:  # new limits apply within KEY_CACHE_S (1 s)
        answer = httpx.post(
            f"{url}/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}},
            headers=bearer(key),
        )  # fmt: skip
        return answer if "x-ratelimit-limit-tokens" in answer.headers else None

    answer = eventually(generate, 10, "the key's new limits applied")
    assert answer is not None and answer.headers["x-ratelimit-limit-tokens"] == "900"
    assert "x-ratelimit-limit-requests" not in answer.headers
    bad = httpx.put(f"{url}/admin/keys/{key_id}/limits", json={"rpm": 0}, headers=bearer(ADMIN))
    assert bad.status_code == 422
    missing = httpx.put(f"{url}/admin/keys/999/limits", json={}, headers=bearer(ADMIN))
    assert (missing.status_code, missing.json()["error"]) == (404, "No API key 999")
