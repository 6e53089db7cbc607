"""Usage under faults (issue 30, must-show 2): two api replicas and two batchers serve one key's
mixed traffic (OpenAI completions, streamed chat with `include_usage`, TGI `/generate`, and
jobs); mid-run one batcher is killed with -9 while it holds requests, and one api replica is
restarted (SIGTERM: it drains what it admitted, then a new process takes its port). Afterwards
the key's usage in Postgres (`/v1/usage`) equals, exactly, the sum of the usage fields of the
answers the clients received.

Why exactly: a usage row is written with an item's result, once per item (results are unique),
and a rerun after the kill is greedy, so it reports the tokens the client is answered with.
"""

from __future__ import annotations

import json
import random
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.api.stack import REDIS_URL, Stack, create_api_key, free_port, migrated_database
from tests.batcher.test_batcher_failover import _holds_requests
from tests.polling import eventually
from tests.reliability.test_infra_faults import scalar

FAST_FAILOVER = ("--heartbeat-ttl-s", "1", "--lease-s", "1", "--max-batch-size", "6")
SETTINGS = {"REQUIRE_API_KEYS": "true", "API_KEY": "admin"}
Usage = dict[str, int]


def completion(client: httpx.Client, url: str, rng: random.Random) -> Usage:
    body = {"model": "tgq-test", "prompt": "Count " * rng.randint(1, 40),
            "max_tokens": rng.randint(8, 40), "temperature": 0}  # fmt: skip
    answer = client.post(f"{url}/v1/completions", json=body)
    answer.raise_for_status()
    usage = answer.json()["usage"]
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
    }


def streamed_chat(client: httpx.Client, url: str, rng: random.Random) -> Usage:
    message = {"role": "user", "content": "Hi " * rng.randint(1, 30)}
    body = {"model": "tgq-test", "messages": [message],
            "max_tokens": rng.randint(8, 40), "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    usage = None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line.removeprefix("data: ")).get("usage") or usage
    assert usage is not None, "the stream ended without its usage chunk"
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
    }


def tgi_generate(client: httpx.Client, url: str, rng: random.Random) -> Usage:
    body = {"inputs": "Tell " * rng.randint(1, 30),
            "parameters": {"max_new_tokens": rng.randint(8, 40), "details": True,
                           "decoder_input_details": True}}  # fmt: skip
    answer = client.post(f"{url}/generate", json=body)
    answer.raise_for_status()
    details = answer.json()["details"]
    return {"prompt_tokens": len(details["prefill"]),
            "completion_tokens": details["generated_tokens"]}  # fmt: skip


def job(client: httpx.Client, url: str, rng: random.Random) -> Usage:
    body = {"prompt": ["Once " * rng.randint(1, 20) for _ in range(rng.randint(1, 4))],
            "parameters": {"max_new_tokens": rng.randint(8, 40)}}  # fmt: skip
    created = client.post(f"{url}/v1/jobs", json=body)
    created.raise_for_status()
    job_url = f"{url}/v1/jobs/{created.json()['id']}"
    # The job is durable: its usage is read from whichever replica answers once it finished.
    usage = eventually(
        lambda: _finished(client, job_url), 120, f"job {created.json()['id']} finished"
    )
    assert usage is not None  # `eventually` returns a truthy value
    return _tokens(usage)


def _finished(client: httpx.Client, job_url: str) -> dict[str, int] | None:
    try:
        answer = client.get(job_url)
    except httpx.TransportError:  # its replica restarting: asked again
        return None
    if answer.status_code != 200:  # 503 from a replica draining: asked again
        return None
    view = answer.json()
    if view["status"] in ("queued", "running"):
        return None
    assert view["status"] == "succeeded", view
    usage: dict[str, int] = view["usage"]
    return usage


def _tokens(usage: dict[str, Any]) -> Usage:
    return {name: usage[name] for name in ("prompt_tokens", "completion_tokens")}


KINDS: list[Callable[[httpx.Client, str, random.Random], Usage]] = [
    completion, streamed_chat, tgi_generate, job,
]  # fmt: skip


@pytest.mark.timeout(400)
def test_usage_equals_what_the_clients_received_after_a_batcher_kill_and_an_api_restart(
    text_model_dir: Path, tmp_path: Path
) -> None:
    with migrated_database() as url:
        first = Stack(text_model_dir, url, tmp_path, api_env=SETTINGS, name="api0",
                      batcher_options=FAST_FAILOVER)  # fmt: skip
        second = Stack(text_model_dir, url, tmp_path, prefix=first.prefix, port=free_port(),
                       api_env=SETTINGS, name="api1")  # fmt: skip
        try:
            first.start_batcher("b0")
            victim = first.start_batcher("b1")
            first.start_api()
            second.start_api()
            key = create_api_key(url, "tenant")
            received = run_clients(key, [first, second], victim, url)
            expected = {name: sum(u[name] for u in received) for name in received[0]}
            headers = {"Authorization": f"Bearer {key}"}

            def usage() -> bool:
                rows = httpx.get(f"{first.url}/v1/usage", headers=headers).json()["data"]
                return {name: sum(row[name] for row in rows) for name in expected} == expected

            eventually(usage, 60, lambda: f"usage equal to {expected}")
            # The kill hit requests in flight: they ran again.
            assert scalar(url, "SELECT count(*) FROM results WHERE attempt > 1") > 0
        finally:
            second.stop()
            first.stop()


def run_clients(key: str, stacks: list[Stack], victim: Any, database_url: str) -> list[Usage]:
    """Eight clients, each sending 6 requests of random kinds to random replicas (a request
    refused or cut by a restarting replica is sent again elsewhere: only answers count); the
    faults strike while they run."""
    received: list[Usage] = []
    lock = threading.Lock()
    headers = {"Authorization": f"Bearer {key}"}

    def client(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(headers=headers, timeout=120) as http:
            for _ in range(6):
                kind = rng.choice(KINDS)
                while True:
                    stack = rng.choice(stacks)
                    try:
                        usage = kind(http, stack.url, rng)
                        break
                    except (httpx.TransportError, httpx.HTTPStatusError):
                        continue  # nothing was answered: the client tries again
                with lock:
                    received.append(usage)

    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    prefix = stacks[0].prefix
    with redis.Redis.from_url(REDIS_URL) as watcher:
        eventually(lambda: _holds_requests(watcher, prefix, "b1"), 60, "b1 holds requests",
                   interval_s=0.002)  # fmt: skip
    victim.send_signal(signal.SIGKILL)
    restarting = stacks[1]
    assert restarting.api is not None
    restarting.api.send_signal(signal.SIGTERM)  # drains what it admitted
    restarting.api.wait(60)
    restarting.start_api()
    for thread in threads:
        thread.join()
    assert len(received) == 48
    return received
