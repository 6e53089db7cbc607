"""Every route of the api through real HTTP: a uvicorn api process on Postgres and Redis, a real
batcher process on a tiny model. Shapes and SSE framing are checked exactly, and greedy output
through HTTP equals the offline engine's for the same prompts."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from tests.api.stack import BLOCK_SIZE, NUM_BLOCKS, REDIS_URL, Stack
from tgq.api.chat_template import ChatTemplate
from tgq.api.db import create_engine
from tgq.batcher.config import SchedulerConfig
from tgq.batcher.detokenize import HFTokenDecoder
from tgq.batcher.engine import LLMEngine
from tgq.batcher.request import StoppingParams
from tgq.batcher.transport.blocking import BlockingApiTransport
from tgq.devtools.demo import CHAT_TEMPLATE
from tgq.gpu_worker.config import model_eos_token_ids
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.timeout(300)
PROMPTS = [
    "The Python language",
    "def main():",
    "Exceptions are raised when",
    "A list comprehension",
]
MAX_NEW = 12


@pytest.fixture
def transport(stack: Stack) -> Iterator[BlockingApiTransport]:
    """The api's side of the stack's Redis, as a test watching it from outside."""
    with BlockingApiTransport.from_url(REDIS_URL, stack.prefix) as transport:
        yield transport


def offline(model_dir: Path, token_ids: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    runner = ModelRunner(RunnerConfig(str(model_dir), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE))
    decoder = HFTokenDecoder.from_file(str(model_dir / "tokenizer.json"))
    engine = LLMEngine(runner, SchedulerConfig(), decoder, model_eos_token_ids(model_dir))
    stopping = StoppingParams(max_new_tokens=max_new)
    return [g.token_ids for g in engine.generate(token_ids, stopping=stopping)]


def encode(model_dir: Path, prompt: str) -> list[int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids: list[int] = tokenizer.encode(prompt).ids
    return ids


def sse_events(raw: str) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing: events end with a blank line
    and carry exactly one `data:` line (comments allowed)."""
    assert raw.endswith("\n\n"), raw[-200:]
    payloads = []
    for block in raw[:-2].split("\n\n"):
        lines = [line for line in block.split("\n") if not line.startswith(":")]
        if not lines:
            continue
        assert len(lines) == 1 and lines[0].startswith("data: "), block
        payloads.append(lines[0][len("data: ") :])
    return payloads


@pytest.fixture(scope="module")
def client(stack: Stack) -> httpx.Client:
    return httpx.Client(base_url=stack.url, timeout=120)


@pytest.fixture(scope="module")
def expected(stack: Stack) -> dict[str, list[int]]:
    token_ids = [encode(stack.model_dir, p) for p in PROMPTS]
    return dict(zip(PROMPTS, offline(stack.model_dir, token_ids), strict=True))


GREEDY = {"max_new_tokens": MAX_NEW, "details": True}


def test_generate_matches_the_offline_engine(
    client: httpx.Client, expected: dict[str, list[int]]
) -> None:
    for prompt in PROMPTS:
        response = client.post("/generate", json={"inputs": prompt, "parameters": GREEDY})
        assert response.status_code == 200, response.text
        body = response.json()
        assert set(body) == {"generated_text", "details"}
        details = body["details"]
        assert set(details) == {"finish_reason", "generated_tokens", "seed", "prefill", "tokens"}
        assert [t["id"] for t in details["tokens"]] == expected[prompt]
        assert details["generated_tokens"] == len(expected[prompt])
        assert details["finish_reason"] in ("length", "eos_token")
        assert details["prefill"] == [] and details["seed"] is None
        for token in details["tokens"]:
            assert set(token) == {"id", "text", "logprob", "special"}
            assert token["logprob"] <= 0.0
        assert int(response.headers["x-generated-tokens"]) == len(expected[prompt])
        assert int(response.headers["x-prompt-tokens"]) > 0
        for header in ("x-total-time", "x-queue-time", "x-inference-time", "x-validation-time"):
            assert int(response.headers[header]) >= 0


def test_generate_without_details_is_text_only(client: httpx.Client) -> None:
    body = {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 4}}
    answer = client.post("/generate", json=body).json()
    assert list(answer) == ["generated_text"] and isinstance(answer["generated_text"], str)


def test_generate_stream_framing(
    client: httpx.Client, stack: Stack, expected: dict[str, list[int]]
) -> None:
    prompt = PROMPTS[1]
    body = {"inputs": prompt, "parameters": GREEDY}
    response = client.post("/generate_stream", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-accel-buffering"] == "no"
    events = [json.loads(p) for p in sse_events(response.text)]
    assert "[DONE]" not in response.text
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))
    assert [e["token"]["id"] for e in events] == expected[prompt]
    for event in events[:-1]:
        assert event["generated_text"] is None and event["details"] is None
    last = events[-1]
    assert last["generated_text"] == "".join(e["token"]["text"] for e in events)
    assert last["details"]["generated_tokens"] == len(expected[prompt])
    assert last["details"]["input_length"] == len(encode(stack.model_dir, prompt))


def test_compat_route_returns_a_list_and_streams(client: httpx.Client) -> None:
    body = {"inputs": PROMPTS[2], "parameters": {"max_new_tokens": 5}}
    answer = client.post("/", json=body).json()
    assert isinstance(answer, list) and len(answer) == 1
    assert answer[0]["generated_text"].startswith(PROMPTS[2])  # `/` returns the full text
    stream = client.post("/", json={**body, "stream": True})
    events = [json.loads(p) for p in sse_events(stream.text)]
    assert events[-1]["generated_text"].startswith(PROMPTS[2])


def test_top_n_tokens_and_best_of(client: httpx.Client) -> None:
    params = {"max_new_tokens": 4, "details": True, "top_n_tokens": 3}
    details = client.post("/generate", json={"inputs": "x", "parameters": params}).json()["details"]
    assert len(details["top_tokens"]) == 4 and all(len(t) == 3 for t in details["top_tokens"])
    chosen = [t["id"] for t in details["tokens"]]
    assert chosen == [tops[0]["id"] for tops in details["top_tokens"]]  # greedy picks the top one
    params = {"max_new_tokens": 4, "details": True, "best_of": 2, "do_sample": True}
    details = client.post("/generate", json={"inputs": "x", "parameters": params}).json()["details"]
    assert len(details["best_of_sequences"]) == 1
    best = sum(t["logprob"] for t in details["tokens"])
    other = details["best_of_sequences"][0]
    assert best >= sum(t["logprob"] for t in other["tokens"])
    seed_rejected = client.post(
        "/generate", json={"inputs": "x", "parameters": {**params, "seed": 1}}
    )
    assert seed_rejected.status_code == 422


def test_stop_sequence_is_kept_on_tgi_routes(client: httpx.Client) -> None:
    answer = client.post("/generate", json={"inputs": PROMPTS[0], "parameters": GREEDY}).json()
    text = answer["generated_text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    params = {**GREEDY, "stop": [stop]}
    stopped = client.post("/generate", json={"inputs": PROMPTS[0], "parameters": params}).json()
    assert stopped["details"]["finish_reason"] == "stop_sequence"
    assert stopped["generated_text"].endswith(stop) and text.startswith(stopped["generated_text"])


def test_tokenize_info_health_metrics_docs(client: httpx.Client, stack: Stack) -> None:
    tokens = client.post("/tokenize", json={"inputs": "hello world"}).json()
    assert [t["id"] for t in tokens] == encode(stack.model_dir, "hello world")
    assert "".join(t["text"] for t in tokens) == "hello world"
    assert all(set(t) == {"id", "text", "start", "stop"} for t in tokens)
    info = client.get("/info").json()
    assert info["model_id"] == "tgq-test" and info["max_total_tokens"] == 1024
    assert info["max_input_tokens"] == 1023 and info["model_dtype"] == "torch.float32"
    assert info["router"] == "tgq" and info["quantize"] is None
    assert client.get("/health").status_code == 200
    assert client.get("/health").content == b""
    metrics = client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    for name in ("tgi_request_count ", "tgi_queue_size ", "tgi_batch_current_size "):
        assert f"\n{name}" in metrics.text or metrics.text.startswith(name)
    assert 'tgq_jobs{status="succeeded"}' in metrics.text
    assert client.get("/docs").status_code == 200
    spec = client.get("/openapi.json").json()
    assert {"/generate", "/v1/chat/completions", "/v1/jobs"} <= set(spec["paths"])
    assert client.get("/api-doc/openapi.json").json()["paths"] == spec["paths"]
    models = client.get("/v1/models").json()
    assert models == {
        "object": "list",
        "data": [
            {"id": "tgq-test", "object": "model", "created": 0, "owned_by": "tgq", "parent": None}
        ],
    }


def test_metrics_carry_the_batchers_kv_and_prefix_cache(client: httpx.Client) -> None:
    """The batcher's heartbeat feeds KV usage and prefix-cache counters; a repeated prompt hits."""
    prompt = " ".join(["The Python language has lists, tuples and dictionaries."] * 8)
    for _ in range(2):
        answer = client.post("/generate", json={"inputs": prompt, "parameters": GREEDY})
        assert answer.status_code == 200, answer.text
    batcher = 'batcher="b0"'

    def samples() -> dict[str, float]:
        lines = client.get("/metrics").text.splitlines()
        pairs = (line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))
        return {name: float(value) for name, value in pairs}

    deadline = time.monotonic() + 10  # a heartbeat (1 s here) then the api's monitor (1 s)
    while samples().get(f"tgq_prefix_cache_hits{{{batcher}}}", 0) == 0:
        assert time.monotonic() < deadline, "no prefix-cache hit reached /metrics"
        time.sleep(0.2)
    found = samples()
    assert (
        found[f"tgq_prefix_cache_queries{{{batcher}}}"]
        >= found[f"tgq_prefix_cache_hits{{{batcher}}}"]
    )
    assert 0.0 <= found[f"tgq_kv_cache_usage_ratio{{{batcher}}}"] < 1.0
    assert found['tgq_batch_request_counts{status="total"}'] >= 0


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 8, **extra}


def test_chat_completion_renders_the_template(client: httpx.Client, stack: Stack) -> None:
    answer = client.post("/v1/chat/completions", json=chat("hi there", temperature=0)).json()
    assert answer["object"] == "chat.completion" and answer["id"].startswith("chatcmpl-")
    assert answer["model"] == "tgq-test"
    (choice,) = answer["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length") and choice["logprobs"] is None
    prompt = "<s>user\nhi there</s>\n<s>assistant\n"
    assert ChatTemplate(CHAT_TEMPLATE).render([{"role": "user", "content": "hi there"}]) == prompt
    prompt_ids = encode(stack.model_dir, prompt)
    assert answer["usage"]["prompt_tokens"] == len(prompt_ids)
    expected = offline(stack.model_dir, [prompt_ids], max_new=8)[0]
    assert answer["usage"]["completion_tokens"] == len(expected)
    total = answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]
    assert answer["usage"]["total_tokens"] == total


def test_chat_stream_framing_usage_and_done(client: httpx.Client) -> None:
    body = chat("hello", stream=True, stream_options={"include_usage": True}, n=2, seed=5)
    body["temperature"] = 1.0
    response = client.post("/v1/chat/completions", json=body)
    payloads = sse_events(response.text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finishes = [ch for c in chunks for ch in c["choices"] if ch["finish_reason"] is not None]
    assert sorted(ch["index"] for ch in finishes) == [0, 1]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] > 0
    assert all(c["usage"] is None for c in chunks[:-1])


def test_chat_logprobs(client: httpx.Client) -> None:
    body = chat("x", logprobs=True, top_logprobs=2, temperature=0)
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) >= 1
    for entry in content:
        assert len(entry["top_logprobs"]) == 2
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"], abs=1e-4)


def test_completions_with_a_list_of_prompts(client: httpx.Client) -> None:
    body = {"prompt": PROMPTS[:2], "max_tokens": 6, "temperature": 0}
    answer = client.post("/v1/completions", json=body).json()
    assert answer["object"] == "text_completion"
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    stream = client.post("/v1/completions", json={**body, "stream": True})
    payloads = sse_events(stream.text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    for index in (0, 1):
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == index)
        assert text == answer["choices"][index]["text"]


def test_interactive_requests_are_recorded(client: httpx.Client, stack: Stack) -> None:
    client.post("/generate", json={"inputs": "audit me", "parameters": {"max_new_tokens": 3}})

    async def latest() -> Any:
        engine = create_engine(stack.database_url)
        async with engine.connect() as conn:
            row = (
                await conn.execute(
                    text(
                        "SELECT kind, route, status, completion_tokens, started_at, finished_at "
                        "FROM jobs ORDER BY created_at DESC LIMIT 1"
                    )
                )
            ).one()
        await engine.dispose()
        return row

    deadline = time.monotonic() + 10
    while (row := asyncio.run(latest())).status != "succeeded" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (row.kind, row.route, row.status, row.completion_tokens) == (
        "interactive",
        "/generate",
        "succeeded",
        3,
    )
    assert row.started_at is not None and row.finished_at >= row.started_at


def test_client_disconnect_aborts_in_the_batcher(
    stack: Stack, transport: BlockingApiTransport
) -> None:
    """The client hangs up once its request's first token exists (seen in the transport's
    started log), streaming or not: the batcher ends it as `abort`, its blocks come back, and
    its row says `cancelled`."""
    free_before = max(b.num_free_blocks for b in transport.live_batchers())
    body = {"inputs": "a long one", "parameters": {"max_new_tokens": 900, "ignore_eos": True}}
    for route in ("/generate_stream", "/generate"):
        cursor, _ = transport.read_started(None, 10, 0)
        with socket.create_connection(("127.0.0.1", stack.port)) as sock:
            payload = json.dumps(body).encode()
            head = (
                f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n"
            )
            sock.sendall(head.encode() + payload)
            _, started = transport.read_started(cursor, 10, 10_000)
        assert len(started) == 1, route  # it was running when the client went away
        final = transport.read_final(started[0], 10)
        assert final is not None and final.finish_reason == "abort", (route, final)
        assert final.num_output_tokens < 900
        deadline = time.monotonic() + 10
        while not all(b.num_running == 0 for b in transport.live_batchers()):
            assert time.monotonic() < deadline, f"{route}: still running after the client left"
            time.sleep(0.1)
        free_after = max(b.num_free_blocks for b in transport.live_batchers())
        assert free_after >= free_before - 1  # its blocks are back (the prefix cache may keep one)
        deadline = time.monotonic() + 10
        while (status := asyncio.run(latest_status(stack, route))) != "cancelled":
            assert time.monotonic() < deadline, f"{route}: the row says {status}"
            time.sleep(0.1)


async def latest_status(stack: Stack, route: str) -> str:
    engine = create_engine(stack.database_url)
    async with engine.connect() as conn:
        query = text(
            "SELECT status FROM jobs WHERE route = :route ORDER BY created_at DESC LIMIT 1"
        )
        status: str = (await conn.execute(query, {"route": route})).scalar_one()
    await engine.dispose()
    return status
