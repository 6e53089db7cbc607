"""Per-key limits (`api/key_policy.py`): the same rule in Redis (every replica at once) and in
memory (embedded), each limit and its 429, the settling of a request's token charge, leases that
lapse when their replica is gone, and a property test: three replicas' limiters against one key
under random bursts never let more through than the key's limits."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
import redis
from redis import asyncio as aioredis

from tests.api.stack import REDIS_URL
from tests.polling import eventually_async
from tgq.api.errors import ForbiddenError, RateLimitedError, ValidationError
from tgq.api.key_limiter_redis import RedisKeyLimiter
from tgq.api.key_policy import (
    KeyAccess,
    KeyLimiter,
    KeyLimits,
    MemoryKeyLimiter,
    check_fits,
    duration,
)

Make = Callable[..., KeyLimiter]


@pytest.fixture
def prefix() -> Iterator[str]:
    """A Redis key prefix of the test's own, its keys deleted after."""
    name = f"test-{uuid.uuid4().hex}"
    yield name
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(f"{name}:*"))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture(params=["redis", "memory"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@contextlib.asynccontextmanager
async def limiters(kind: str, prefix: str) -> AsyncIterator[Make]:
    """Limiters that share one key space (replicas of one deployment), on Redis, each with its
    own connection, or in memory (there, one limiter stands for the one process)."""
    clients: list[aioredis.Redis] = []
    memory: dict[float, MemoryKeyLimiter] = {}

    def make(window_s: float = 60.0, lease_s: float = 60.0) -> KeyLimiter:
        if kind == "memory":
            return memory.setdefault(window_s, MemoryKeyLimiter(window_s=window_s))
        client = aioredis.Redis.from_url(REDIS_URL)
        clients.append(client)
        return RedisKeyLimiter(client, prefix, window_s=window_s, lease_s=lease_s)

    try:
        yield make
    finally:
        for client in clients:
            await client.aclose()


def run(kind: str, prefix: str, body: Callable[[Make], Awaitable[None]]) -> None:
    async def main() -> None:
        async with limiters(kind, prefix) as make:
            await body(make)

    asyncio.run(main())


async def refused(limiter: KeyLimiter, limits: KeyLimits, num_tokens: int = 1) -> RateLimitedError:
    with pytest.raises(RateLimitedError) as caught:
        await limiter.acquire(1, limits, lease_id=uuid.uuid4().hex, num_tokens=num_tokens)
    return caught.value


async def wait_admitted(limiter: KeyLimiter, limits: KeyLimits, timeout_s: float = 10.0) -> float:
    """Seconds until the key admits a request again."""
    start = time.monotonic()

    async def admitted() -> bool:
        try:
            await limiter.acquire(1, limits, lease_id=uuid.uuid4().hex, num_tokens=1)
        except RateLimitedError:
            return False
        return True

    await eventually_async(admitted, timeout_s, "the key admits a request again")
    return time.monotonic() - start


def test_requests_per_minute(kind: str, prefix: str) -> None:
    async def body(make_limiter: Make) -> None:
        limiter, limits = make_limiter(), KeyLimits(rpm=3)
        grants = [
            await limiter.acquire(1, limits, lease_id=f"r{i}", num_tokens=5) for i in range(3)
        ]
        assert [g.remaining_requests for g in grants] == [2, 1, 0]
        assert grants[0].headers()["x-ratelimit-limit-requests"] == "3"
        assert "x-ratelimit-limit-tokens" not in grants[0].headers()
        error = await refused(limiter, limits)
        assert error.message == "Rate limit reached for this API key: 3 requests per minute"
        assert error.status_code == 429 and 0 < error.retry_ms <= 60_000
        headers = error.headers()
        assert headers["Retry-After"] == str(-(-error.retry_ms // 1000))
        assert headers["retry-after-ms"] == str(error.retry_ms)
        assert headers["x-ratelimit-remaining-requests"] == "0"
        for lease in ("r0", "r1", "r2"):  # ending requests gives no request back within the minute
            await limiter.release(1, lease, num_tokens_used=1)
        await refused(limiter, limits)
        other = await limiter.acquire(2, limits, lease_id="other", num_tokens=1)  # another key
        assert other.remaining_requests == 2

    run(kind, prefix, body)


def test_tokens_per_minute_are_charged_then_settled(kind: str, prefix: str) -> None:
    async def body(make_limiter: Make) -> None:
        limiter, limits = make_limiter(), KeyLimits(tpm=100)
        grant = await limiter.acquire(1, limits, lease_id="a", num_tokens=60)
        assert grant.headers()["x-ratelimit-remaining-tokens"] == "40"
        error = await refused(limiter, limits, num_tokens=50)
        assert error.message == "Rate limit reached for this API key: 100 tokens per minute"
        await limiter.release(1, "a", num_tokens_used=30)  # it used 30 of the 60 charged
        grant = await limiter.acquire(1, limits, lease_id="b", num_tokens=50)
        assert grant.remaining_tokens == 20
        await limiter.release(1, "b", num_tokens_used=500)  # never more than it was charged
        assert (await limiter.acquire(1, limits, lease_id="c", num_tokens=20)).remaining_tokens == 0

    run(kind, prefix, body)


def test_concurrent_requests(kind: str, prefix: str) -> None:
    async def body(make_limiter: Make) -> None:
        limiter, limits = make_limiter(), KeyLimits(max_concurrent=2)
        await limiter.acquire(1, limits, lease_id="a", num_tokens=1)
        await limiter.acquire(1, limits, lease_id="b", num_tokens=1)
        error = await refused(limiter, limits)
        assert error.message == "Rate limit reached for this API key: 2 concurrent requests"
        assert error.headers()["Retry-After"] == "1"
        await limiter.release(1, "a", num_tokens_used=1)
        await limiter.acquire(1, limits, lease_id="c", num_tokens=1)

    run(kind, prefix, body)


def test_the_window_slides(kind: str, prefix: str) -> None:
    async def body(make_limiter: Make) -> None:
        limiter, limits = make_limiter(window_s=0.4), KeyLimits(rpm=2, tpm=10)
        await limiter.acquire(1, limits, lease_id="a", num_tokens=10)
        await refused(limiter, limits)  # tokens
        assert 0.2 < await wait_admitted(limiter, limits) < 5.0

    run(kind, prefix, body)


def test_a_dead_replicas_leases_lapse_and_live_ones_are_renewed(prefix: str) -> None:
    run("redis", prefix, _leases)


async def _leases(make: Make) -> None:
    """Leases of 0.5 s: renewed halfway, the lease is still held past its first lapse; not
    renewed again (its replica died), the slot comes back at the renewed lapse."""
    limits = KeyLimits(max_concurrent=1)
    holder, other = make(lease_s=0.5), make(lease_s=0.5)
    assert isinstance(holder, RedisKeyLimiter)
    await holder.acquire(1, limits, lease_id="held", num_tokens=1)
    leases = f"{holder.prefix}:key:1:leases"
    first_lapse = float(await holder.client.zscore(leases, "held") or 0)

    def server_past(moment_ms: float) -> Callable[[], Awaitable[bool]]:
        async def passed() -> bool:
            seconds, micros = await holder.client.time()
            return bool(seconds * 1000 + micros // 1000 > moment_ms)

        return passed

    await eventually_async(server_past(first_lapse - 250), 5, "half the lease gone")
    await holder.renew()
    renewed_lapse = float(await holder.client.zscore(leases, "held") or 0)
    assert renewed_lapse >= first_lapse + 200
    await eventually_async(server_past(first_lapse), 5, "the lease's first lapse passed")
    await refused(other, limits)  # renewed: still held
    assert 0.1 < await wait_admitted(other, limits) < 5.0


def test_a_request_larger_than_the_tokens_per_minute_is_a_validation_error() -> None:
    check_fits(KeyLimits(tpm=100), 100)
    with pytest.raises(ValidationError) as caught:
        check_fits(KeyLimits(tpm=100), 101)
    assert caught.value.message == (
        "Request too large for this API key: it may use 101 tokens (prompt + max_tokens) and "
        "the key's limit is 100 tokens per minute; lower `max_tokens` or shorten the prompt"
    )


def test_limits_are_checked_and_durations_spelled_as_openai_does() -> None:
    with pytest.raises(ValueError, match="`rpm` must be at least 1"):
        KeyLimits(rpm=0)
    with pytest.raises(ValueError, match="`priority` must be one of"):
        KeyLimits(priority="urgent")
    assert [duration(ms) for ms in (20, 1000, 1500, 60_000, 360_250)] == [
        "20ms", "1s", "1.5s", "1m0s", "6m0.25s",
    ]  # fmt: skip


def test_three_replicas_never_let_a_burst_past_the_limits(prefix: str) -> None:
    run("redis", prefix, _bursts)


async def _bursts(make: Make) -> None:
    """Random bursts of requests (random sizes and run times) on three replicas' limiters, each
    with its own Redis connection: at no moment do more requests hold a lease than
    `max_concurrent`, and the admitted requests and tokens stay within `rpm` and `tpm`."""
    replicas = [make() for _ in range(3)]
    limits = KeyLimits(rpm=150, tpm=6000, max_concurrent=4)
    rng = random.Random(30)
    held, max_held, admitted, charged, refusals = 0, 0, 0, 0, set()

    async def request(index: int) -> None:
        nonlocal held, max_held, admitted, charged
        num_tokens = rng.randint(1, 60)
        replica = rng.choice(replicas)
        try:
            await replica.acquire(7, limits, lease_id=f"q{index}", num_tokens=num_tokens)
        except RateLimitedError as error:
            refusals.add(error.message.rsplit(": ", 1)[1])
            return
        held, admitted, charged = held + 1, admitted + 1, charged + num_tokens
        max_held = max(max_held, held)
        for _ in range(rng.randint(0, 20)):  # it runs a while: others act meanwhile
            await asyncio.sleep(0)
        held -= 1  # before the release is sent: `held` never counts a lease already freed
        await replica.release(7, f"q{index}", num_tokens_used=num_tokens)

    index = 0
    for _ in range(60):  # bursts of up to 30 requests at once
        burst = rng.randint(1, 30)
        await asyncio.gather(*(request(index + i) for i in range(burst)))
        index += burst
    assert max_held == 4  # = max_concurrent: reached, never passed
    assert admitted <= 150 and charged <= 6000
    # The bursts pressed on the concurrency and on the requests (the tokens limit is tested
    # above), and passed neither.
    assert refusals == {"4 concurrent requests", "150 requests per minute"} and admitted == 150


def test_a_key_restricted_to_some_models_may_use_those_only() -> None:
    KeyAccess(1, "any", KeyLimits()).check_model("anything")
    restricted = KeyAccess(1, "sql-team", KeyLimits(adapters=("sql", "base-model")))
    restricted.check_model("sql")
    restricted.check_model("base-model")
    with pytest.raises(ForbiddenError) as caught:
        restricted.check_model("chat")
    assert caught.value.status_code == 403
    assert caught.value.message == (
        "This API key may not use 'chat'; it may use: 'sql', 'base-model'"
    )
