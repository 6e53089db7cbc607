"""Load at the edge of the real stack (Postgres, Redis, the batcher and api processes, the tiny
model): a burst past the concurrency cap, and one malformed request among good ones.

The burst: an api capped at 8 concurrent requests gets 100 at once while the batcher is frozen
(SIGSTOP), so the 8 admitted ones hold their slots; three such bursts in turn. The other 92 of
each must get 429 with `Retry-After` without waiting for the engine (median < 250 ms and p99 < 1 s
over all three bursts' rejections, measured by the client from send to response, beside another
test worker: see `MAX_P99_S`),
and each burst's counters must show that they were neither tokenized (`tgq_tokenizer_calls`)
nor submitted (no job row: `tgq_jobs`; nothing added to the batcher's Redis queue stream).
Figures are printed; run with `-s`.
"""

from __future__ import annotations

import asyncio
import gc
import http.client
import json
import math
import selectors
import signal
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.api.stack import REDIS_URL, Stack
from tests.api.test_http_limits import (
    CHAT,
    chat,
    generate,
    metrics,
    openai_error,
    paused,
    sibling_api,
    tgi_error,
)
from tests.polling import eventually
from tgq.api.metrics import JOB_STATUSES
from tgq.batcher.request import Priority
from tgq.batcher.transport.redis_keys import RedisKeys

pytestmark = pytest.mark.timeout(300)

MAX_CONCURRENT = 8
NUM_BURST = 100
NUM_ROUNDS = 3
# The service's goal is a 429 p99 under 50 ms; `make bench-serving` measures it on a quiet machine
# (12-24 ms on an AMD EPYC, 8-12 ms on an Intel Xeon). Here the client, the api and another test
# worker share two cores, and the neighbour sets the figures: CI runs measured p99s of 50, 85 and
# 196 ms, and a median of 60 ms. What this test can tell apart is a rejection that did not wait
# for the frozen batcher from one that did, which never comes back before SIGCONT (10 s at the
# earliest): the bounds leave the neighbour room and stay far below that.
MAX_MEDIAN_S = 0.250
MAX_P99_S = 1.0
NUM_GOOD = 31
OVERLOADED = {"error": "Model is overloaded", "error_type": "overloaded"}
REJECTED = 'tgq_requests_rejected{reason="concurrency"}'
LISTEN = "0A"  # a TCP socket's state in /proc/net/tcp


@dataclass(frozen=True, slots=True)
class Outcome:
    status: int
    latency_s: float
    retry_after: str | None
    body: Any


@pytest.fixture(scope="module")
def capped(stack: Stack) -> Iterator[Stack]:
    """A second api on the stack's database and batcher, capped at `MAX_CONCURRENT`."""
    with sibling_api(stack, "api-capped", MAX_CONCURRENT_REQUESTS=str(MAX_CONCURRENT)) as api:
        yield api


def p99(values: list[float]) -> float:
    """Nearest-rank 99th percentile."""
    return sorted(values)[math.ceil(0.99 * len(values)) - 1]


def num_queued_ever(stack: Stack) -> int:
    """Entries ever added to the interactive queue stream: every submit to the batchers."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        key = RedisKeys(stack.prefix).queue(Priority.INTERACTIVE)
        return int(client.xinfo_stream(key)["entries-added"]) if client.exists(key) else 0
    finally:
        client.close()


def counters(client: httpx.Client, stack: Stack) -> dict[str, float]:
    names = (
        "tgi_request_count", "tgi_request_success", 'tgi_request_failure{err="overloaded"}',
        REJECTED, "tgq_tokenizer_calls",
    )  # fmt: skip
    # One scrape: a job may change status between two (counted twice, or not at all).
    snapshot = metrics(client)
    values = {name: snapshot[name] for name in names}
    values["jobs"] = sum(snapshot[f'tgq_jobs{{status="{s}"}}'] for s in JOB_STATUSES)
    values["queued"] = num_queued_ever(stack)
    return values


def raw_request(route: str, body: Any) -> bytes:
    content = json.dumps(body).encode()
    head = f"POST {route} HTTP/1.1\r\nHost: tgq\r\nContent-Type: application/json\r\n"
    return f"{head}Content-Length: {len(content)}\r\n\r\n".encode() + content


def read_outcome(sock: socket.socket, latency_s: float) -> Outcome:
    sock.setblocking(True)
    response = http.client.HTTPResponse(sock)
    response.begin()
    return Outcome(
        response.status, latency_s, response.getheader("retry-after"), json.loads(response.read())
    )


def accept_backlog(port: int) -> int:
    """Connections the kernel has completed on `port` that the server has not accepted yet: the
    listening socket's receive queue in /proc/net/tcp (what `ss -l` shows as Recv-Q)."""
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, queues = fields[1], fields[3], fields[4]
            if state == LISTEN and int(local.rsplit(":", 1)[1], 16) == port:
                return int(queues.split(":")[1], 16)
    raise AssertionError(f"nothing listens on port {port}")


def burst(port: int, resume: Callable[[], None]) -> list[Outcome]:
    """`NUM_BURST` requests at once, each on a connection of its own opened beforehand, from
    plain sockets: the client adds next to nothing to the latency it measures (send to first
    byte). `resume` runs once the rejections are in (the admitted ones wait for the engine)."""
    request = raw_request("/generate", generate())
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(NUM_BURST)]
    # The api accepts them all (uvicorn sets up each one) before the burst it times.
    eventually(lambda: accept_backlog(port) == 0, 10, "the api accepted every connection")
    selector = selectors.DefaultSelector()
    sent_at: dict[socket.socket, float] = {}
    outcomes: dict[socket.socket, Outcome] = {}
    # This process's collector walks pytest's whole heap (~200 ms) when it runs: not while it
    # times the api (seen as every answer after the first few of a burst "late" by 200 ms).
    gc.disable()
    try:
        for sock in socks:
            sent_at[sock] = time.perf_counter()
            sock.sendall(request)
            selector.register(sock, selectors.EVENT_READ, sock)
        deadline = time.monotonic() + 10
        while len(outcomes) < NUM_BURST - MAX_CONCURRENT and time.monotonic() < deadline:
            for key, _ in selector.select(0.1):
                answered: socket.socket = key.data
                latency_s = time.perf_counter() - sent_at[answered]
                selector.unregister(answered)
                outcomes[answered] = read_outcome(answered, latency_s)
        resume()
        for sock in socks:
            if sock not in outcomes:
                outcomes[sock] = read_outcome(sock, time.perf_counter() - sent_at[sock])
        return list(outcomes.values())
    finally:
        gc.enable()
        selector.close()
        for sock in socks:
            sock.close()


@dataclass(frozen=True, slots=True)
class Burst:
    outcomes: list[Outcome]
    delta: dict[str, float]  # each counter's growth over the burst

    @property
    def rejected(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == 429]


@pytest.fixture(scope="module")
def bursts_past_the_cap(stack: Stack, capped: Stack) -> list[Burst]:
    """`NUM_ROUNDS` bursts, one after the other: each one's counters are checked on their own,
    and the 429 latency is taken over all their rejections (so that the p99 of a few hundred is
    not simply the slowest of one burst)."""
    bursts = []
    with httpx.Client(base_url=capped.url, timeout=60) as client:
        batcher = stack.batchers[0]
        for _ in range(NUM_ROUNDS):
            before = counters(client, stack)
            with paused(batcher):
                outcomes = burst(capped.port, lambda: batcher.send_signal(signal.SIGCONT))
            after = counters(client, stack)
            bursts.append(Burst(outcomes, {name: after[name] - before[name] for name in before}))
    return bursts


def test_burst_past_the_cap(bursts_past_the_cap: list[Burst]) -> None:
    num_rejected = NUM_BURST - MAX_CONCURRENT
    for each in bursts_past_the_cap:
        completed = [o for o in each.outcomes if o.status == 200]
        assert (len(completed), len(each.rejected)) == (MAX_CONCURRENT, num_rejected)
        assert all(o.retry_after == "1" and o.body == OVERLOADED for o in each.rejected)
        assert each.delta == {
            "tgi_request_count": NUM_BURST,
            "tgi_request_success": MAX_CONCURRENT,
            'tgi_request_failure{err="overloaded"}': num_rejected,
            REJECTED: num_rejected,
            "tgq_tokenizer_calls": MAX_CONCURRENT,  # one encode per admitted request, none else
            "jobs": MAX_CONCURRENT,  # a job row per admitted request
            "queued": MAX_CONCURRENT,  # an engine submit per admitted request
        }


def test_rejections_are_fast(bursts_past_the_cap: list[Burst]) -> None:
    latencies = sorted(o.latency_s for each in bursts_past_the_cap for o in each.rejected)
    print(
        f"\n429 latency over {len(latencies)} rejections: p50 "
        f"{latencies[len(latencies) // 2] * 1000:.1f} ms, p99 {p99(latencies) * 1000:.1f} ms, "
        f"max {latencies[-1] * 1000:.1f} ms"
    )
    assert latencies[len(latencies) // 2] < MAX_MEDIAN_S
    assert p99(latencies) < MAX_P99_S


# --- one malformed request among good ones ------------------------------------------------------

MALFORMED = [
    pytest.param(
        "/generate", '{"inputs": "x", ', tgi_error("Failed to parse the request body as JSON: "
        "Expecting property name enclosed in double quotes"), id="invalid-json",
    ),
    pytest.param(
        CHAT, json.dumps(chat(temperature=3)),
        openai_error("`temperature` must be >= 0.0 and <= 2.0", "temperature"),
        id="invalid-parameter",
    ),
]  # fmt: skip


async def mixed(url: str, route: str, bad_body: str) -> tuple[httpx.Response, list[int]]:
    """`NUM_GOOD` good requests (generate and chat by turns) and one bad one, all at once."""
    goods = [("/generate", generate()) if i % 2 else (CHAT, chat()) for i in range(NUM_GOOD)]
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        bad = client.post(route, content=bad_body, headers=headers)
        answers = await asyncio.gather(bad, *(client.post(r, json=b) for r, b in goods))
    return answers[0], [answer.status_code for answer in answers[1:]]


@pytest.mark.parametrize(("route", "bad_body", "error"), MALFORMED)
def test_one_malformed_among_good_ones(stack: Stack, route: str, bad_body: str, error: Any) -> None:
    bad, statuses = asyncio.run(mixed(stack.url, route, bad_body))
    assert bad.status_code == 422 and bad.json() == error
    assert statuses == [200] * NUM_GOOD
    assert httpx.get(f"{stack.url}/health").status_code == 200
    assert stack.batchers[0].poll() is None
