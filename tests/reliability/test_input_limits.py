"""Hostile inputs against the real api process (default limits): a body over the payload limit,
an oversize prompt, huge `n`, `best_of` and `max_new_tokens`, a long stop list and deeply
nested JSON. Each gets its 4xx, fast, and sending each of them many times does not grow the api
process's resident memory (read from /proc) past a small bound after a warm-up. Two inputs that
used to escape the api's error shapes are pinned too: a NUL character (Postgres refuses it) and
the errors Starlette raises itself (404, 405, a body its JSON parser gave up on).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from tests.api.stack import Stack
from tests.api.test_http_limits import CHAT, TGI_PREFIX, chat, generate

pytestmark = pytest.mark.timeout(300)

NUM_WARM_UP = 5
NUM_ROUNDS = 50
MAX_RSS_GROWTH_KIB = 16 * 1024
MAX_NESTED_S = 1.0
HUGE = 10**12
TOTAL = "`inputs` tokens + `max_new_tokens` must be <= 1024. Given: "
LONG_PROMPT = "hello world " * 10_000  # ~20k tokens: over max_input_tokens, under the payload
DEPTH = 100_000


@dataclass(frozen=True)
class Hostile:
    name: str
    route: str
    body: bytes
    status: int
    message: str  # the error message, or the start of it (ending in ": ")


def nested(depth: int) -> bytes:
    return b'{"inputs": "x", "parameters": {"stop": ' + b"[" * depth + b"]" * depth + b"}}"


def hostile_inputs(num_prompt_tokens: int) -> list[Hostile]:
    payload = f"Payload too large: the limit is {2_000_000} bytes"
    return [
        Hostile("payload", "/generate", json.dumps({"inputs": "x" * 2_000_001}).encode(), 413,
                payload),
        Hostile("prompt", "/generate", json.dumps(generate(max_new_tokens=1) | {
            "inputs": LONG_PROMPT}).encode(), 422,
                f"{TGI_PREFIX}{TOTAL}{num_prompt_tokens} `inputs` tokens and 1 `max_new_tokens`"),
        Hostile("n", CHAT, json.dumps(chat(n=HUGE)).encode(), 422,
                f"`n` must be >= 1 and <= 8. Given: {HUGE}"),
        Hostile("best_of", "/generate", json.dumps(generate(best_of=HUGE, do_sample=True))
                .encode(), 422, f"{TGI_PREFIX}`best_of` must be > 0 and <= 2. Given: {HUGE}"),
        Hostile("max_new_tokens", "/generate", json.dumps(generate(max_new_tokens=HUGE))
                .encode(), 422, f"{TGI_PREFIX}{TOTAL}"),
        Hostile("stop", CHAT, json.dumps(chat(stop=["a"] * 100_000)).encode(), 422,
                "`stop` supports up to 4 stop sequences. Given: 100000"),
        Hostile("nested", "/generate", nested(DEPTH), 400, "There was an error parsing the body"),
    ]  # fmt: skip


def message_of(response: httpx.Response) -> str:
    body = response.json()
    error = body["error"]
    return str(error["message"] if isinstance(error, dict) else error)


def send(client: httpx.Client, hostile: Hostile) -> None:
    headers = {"content-type": "application/json"}
    response = client.post(hostile.route, content=hostile.body, headers=headers)
    assert response.status_code == hostile.status, (hostile.name, response.text[:300])
    message = message_of(response)
    if hostile.message.endswith(": "):
        assert message.startswith(hostile.message), (hostile.name, message)
    else:
        assert message == hostile.message, (hostile.name, message)


def rss_kib(stack: Stack) -> int:
    assert stack.api is not None
    for line in Path(f"/proc/{stack.api.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise KeyError("VmRSS")


@pytest.fixture(scope="module")
def hostile(stack: Stack) -> list[Hostile]:
    tokenizer = Tokenizer.from_file(str(stack.model_dir / "tokenizer.json"))
    return hostile_inputs(len(tokenizer.encode(LONG_PROMPT).ids))


def test_each_gets_its_4xx_without_memory_growth(stack: Stack, hostile: list[Hostile]) -> None:
    with httpx.Client(base_url=stack.url, timeout=60) as client:
        for case in hostile * NUM_WARM_UP:
            send(client, case)
        before = rss_kib(stack)
        started = time.monotonic()
        for case in hostile * NUM_ROUNDS:
            send(client, case)
        elapsed_s = time.monotonic() - started
        after = rss_kib(stack)
        assert client.post("/generate", json=generate()).status_code == 200
    print(
        f"\n{len(hostile) * NUM_ROUNDS} hostile requests in {elapsed_s:.1f} s: api RSS "
        f"{before} KiB -> {after} KiB ({after - before:+d} KiB)"
    )
    assert after - before < MAX_RSS_GROWTH_KIB


def test_deeply_nested_json_is_refused_fast(stack: Stack, hostile: list[Hostile]) -> None:
    (case,) = [h for h in hostile if h.name == "nested"]
    with httpx.Client(base_url=stack.url, timeout=60) as client:
        started = time.monotonic()
        send(client, case)
        elapsed_s = time.monotonic() - started
    print(f"\n{DEPTH} nested lists refused in {elapsed_s * 1000:.1f} ms")
    assert elapsed_s < MAX_NESTED_S
    assert httpx.get(f"{stack.url}/health").status_code == 200


def test_a_nul_character_is_the_clients_error(stack: Stack) -> None:
    """Postgres cannot store a NUL character: a 422, not a 503 that asks for a retry."""
    response = httpx.get(f"{stack.url}/v1/jobs", params={"after": "job_\x00"})
    assert response.status_code == 422
    message = "The request has a value the database cannot store (SQLSTATE 22021)"
    assert response.json()["error"]["message"] == message


def test_starlettes_own_errors_have_the_api_shapes(stack: Stack) -> None:
    response = httpx.get(f"{stack.url}/no/such/route")
    assert response.status_code == 404
    assert response.json() == {"error": "Not Found", "error_type": "not_found"}
    response = httpx.get(f"{stack.url}/v1/chat/completions")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json()["error"]["message"] == "Method Not Allowed"
