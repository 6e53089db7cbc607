"""Per-key policy: an API key's limits and the priority it may ask for at most, the rule that
enforces them, and OpenAI's `x-ratelimit-*` headers.

The rule, for a key with limits (every limit is optional; a key without any pays nothing):
- **requests per minute** (`rpm`): at most `rpm` requests admitted in any window of
  `window_s` (60 s) ending now;
- **tokens per minute** (`tpm`): a request is charged its prompt plus its `max_tokens` when it
  is admitted (the most it can cost: OpenAI's rule), and the charge is lowered to the tokens it
  really used when it ends; the charges of the window plus the new one stay within `tpm`. A
  request that alone is larger than `tpm` can never pass: a 422, not a 429;
- **concurrent requests** (`max_concurrent`): each admitted request holds a lease until it ends;
  a lease is renewed while its request runs and lapses `lease_s` after its replica died, so a
  crash never keeps a key's slots;
- **queued jobs** (`max_queued_jobs`): open jobs and batches of the key, counted in Postgres in
  the transaction that creates the new one (`api/db/store/jobs.py`), since jobs are durable;
- **priority**: a `bulk` key's requests run at bulk priority whatever they ask for;
- **adapters**: a key given a list of model names (LoRA adapters, the base model's id) may use
  those only (403 otherwise), on every route.

Requests, tokens and leases are counted in Redis by one Lua script per admission (atomic over
every api replica, one clock: the server's), or in memory in embedded mode (one replica). The
limits apply to interactive requests (TGI and OpenAI routes); jobs and batches are bounded by
`max_queued_jobs`. Losing Redis forgets the current window and leases (limits start afresh).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from tgq.api.errors import ForbiddenError, RateLimitedError, ValidationError

PRIORITIES = ("interactive", "bulk")
WINDOW_S = 60.0
LEASE_S = 60.0  # a lease lapses this long after its last renewal; renewed every third of it
Reason = Literal["requests", "tokens", "concurrent"]


@dataclass(frozen=True, slots=True)
class KeyLimits:
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    max_queued_jobs: int | None = None
    priority: str | None = None  # the highest a request may get: "interactive" or "bulk"
    adapters: tuple[str, ...] | None = None  # the models it may use (adapters, the base); None: any

    def __post_init__(self) -> None:
        for name in ("rpm", "tpm", "max_concurrent", "max_queued_jobs"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"`{name}` must be at least 1 (or unset). Given: {value}")
        if self.priority is not None and self.priority not in PRIORITIES:
            raise ValueError(f"`priority` must be one of {PRIORITIES}. Given: {self.priority!r}")

    @property
    def is_rated(self) -> bool:
        """Whether admission must count this key's requests (in Redis or in memory)."""
        return any(v is not None for v in (self.rpm, self.tpm, self.max_concurrent))


@dataclass(slots=True)
class KeyAccess:
    """The stored key a request came with (set by the auth middleware as `request.state.key`)
    and the `x-ratelimit-*` headers its admission left, which go out with the response."""

    key_id: int
    name: str
    limits: KeyLimits
    headers: dict[str, str] = field(default_factory=dict)

    def check_model(self, model: str) -> None:
        """403 unless the key may use `model` (a LoRA adapter's name or the base model's id)."""
        allowed = self.limits.adapters
        if allowed is not None and model not in allowed:
            names = ", ".join(repr(name) for name in allowed) or "none"
            raise ForbiddenError(f"This API key may not use {model!r}; it may use: {names}")

    def capped(self, priority: str) -> str:
        """The priority a request asking for `priority` gets."""
        return "bulk" if self.limits.priority == "bulk" else priority


@dataclass(frozen=True, slots=True)
class Grant:
    """What an admission leaves of the key's window: OpenAI's `x-ratelimit-*` headers."""

    limits: KeyLimits
    remaining_requests: int
    reset_requests_ms: int  # until the window holds none of the key's requests
    remaining_tokens: int
    reset_tokens_ms: int

    def headers(self) -> dict[str, str]:
        headers = {}
        if self.limits.rpm is not None:
            headers["x-ratelimit-limit-requests"] = str(self.limits.rpm)
            headers["x-ratelimit-remaining-requests"] = str(max(self.remaining_requests, 0))
            headers["x-ratelimit-reset-requests"] = duration(self.reset_requests_ms)
        if self.limits.tpm is not None:
            headers["x-ratelimit-limit-tokens"] = str(self.limits.tpm)
            headers["x-ratelimit-remaining-tokens"] = str(max(self.remaining_tokens, 0))
            headers["x-ratelimit-reset-tokens"] = duration(self.reset_tokens_ms)
        return headers


def duration(ms: int) -> str:
    """OpenAI's spelling of a reset time: `20ms`, `1.5s`, `6m0s`."""
    if ms < 1000:
        return f"{max(ms, 0)}ms"
    minutes, rest_ms = divmod(ms, 60_000)
    seconds = f"{rest_ms / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"


def check_fits(limits: KeyLimits, num_tokens: int) -> None:
    """A request larger than the key's tokens per minute alone never passes: 422."""
    if limits.tpm is not None and num_tokens > limits.tpm:
        raise ValidationError(
            f"Request too large for this API key: it may use {num_tokens} tokens (prompt + "
            f"max_tokens) and the key's limit is {limits.tpm} tokens per minute; lower "
            "`max_tokens` or shorten the prompt"
        )


def refusal(limits: KeyLimits, reason: Reason, retry_ms: int, grant: Grant) -> RateLimitedError:
    messages = {
        "requests": f"Rate limit reached for this API key: {limits.rpm} requests per minute",
        "tokens": f"Rate limit reached for this API key: {limits.tpm} tokens per minute",
        "concurrent": "Rate limit reached for this API key: "
        f"{limits.max_concurrent} concurrent requests",
    }
    retry_after_s = max(1, math.ceil(retry_ms / 1000))
    return RateLimitedError(
        messages[reason],
        limit=reason,
        retry_after_s=retry_after_s,
        retry_ms=retry_ms,
        headers=grant.headers(),
    )


QUEUED_JOBS_RETRY_S = 10


def check_open_work(limits: KeyLimits, num_open: int) -> None:
    """429 when the key already has `max_queued_jobs` jobs and batches open."""
    if limits.max_queued_jobs is not None and num_open >= limits.max_queued_jobs:
        raise RateLimitedError(
            f"Rate limit reached for this API key: {num_open} jobs and batches are open "
            f"(max_queued_jobs={limits.max_queued_jobs})",
            limit="queued_jobs",
            retry_after_s=QUEUED_JOBS_RETRY_S,
            retry_ms=QUEUED_JOBS_RETRY_S * 1000,
            headers={},
        )


class KeyLimiter(Protocol):
    async def acquire(
        self, key_id: int, limits: KeyLimits, *, lease_id: str, num_tokens: int
    ) -> Grant:
        """Admits one request of `num_tokens` (prompt + max new tokens) for the key, holding a
        lease `lease_id`; raises `RateLimitedError` (429) when a limit would be passed."""
        ...

    async def release(self, key_id: int, lease_id: str, *, num_tokens_used: int) -> None:
        """Ends the lease; the request's charge becomes what it used (never more than it was
        charged)."""
        ...

    async def renew(self) -> None:
        """Renews the leases this replica holds (every `LEASE_S / 3`)."""
        ...


@dataclass
class _Window:
    requests: deque[float] = field(default_factory=deque)  # admission times
    charges: dict[str, tuple[float, int]] = field(default_factory=dict)  # lease -> (at, tokens)
    num_tokens: int = 0
    leases: set[str] = field(default_factory=set)


class MemoryKeyLimiter:
    """The rule in one process (embedded mode): the same counts as the Redis script, kept in
    dicts, with this process's monotonic clock. No leases lapse: the process is the replica."""

    def __init__(self, *, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._keys: dict[int, _Window] = {}

    async def acquire(
        self, key_id: int, limits: KeyLimits, *, lease_id: str, num_tokens: int
    ) -> Grant:
        now = time.monotonic()
        window = self._keys.setdefault(key_id, _Window())
        self._forget(window, now - self.window_s)
        reason, retry_s = self._refusal(window, limits, num_tokens, now)
        if reason is None:
            window.requests.append(now)
            window.charges[lease_id] = (now, num_tokens)
            window.num_tokens += num_tokens
            window.leases.add(lease_id)
        grant = Grant(
            limits,
            remaining_requests=(limits.rpm or 0) - len(window.requests),
            reset_requests_ms=self._ms_until_empty(window.requests, now),
            remaining_tokens=(limits.tpm or 0) - window.num_tokens,
            reset_tokens_ms=self._ms_until_empty((at for at, _ in window.charges.values()), now),
        )
        if reason is not None:
            raise refusal(limits, reason, round(retry_s * 1000), grant)
        return grant

    async def release(self, key_id: int, lease_id: str, *, num_tokens_used: int) -> None:
        window = self._keys.get(key_id)
        if window is None:
            return
        window.leases.discard(lease_id)
        if lease_id in window.charges:
            at, charged = window.charges[lease_id]
            used = min(num_tokens_used, charged)
            window.charges[lease_id] = (at, used)
            window.num_tokens -= charged - used

    async def renew(self) -> None:
        return None

    def _refusal(
        self, window: _Window, limits: KeyLimits, num_tokens: int, now: float
    ) -> tuple[Reason | None, float]:
        if limits.max_concurrent is not None and len(window.leases) >= limits.max_concurrent:
            return "concurrent", 1.0
        if limits.rpm is not None and len(window.requests) >= limits.rpm:
            return "requests", window.requests[0] + self.window_s - now
        if limits.tpm is not None and window.num_tokens + num_tokens > limits.tpm:
            excess = window.num_tokens + num_tokens - limits.tpm
            for at, charged in sorted(window.charges.values()):  # the oldest leave first
                excess -= charged
                if excess <= 0:
                    return "tokens", at + self.window_s - now
            return "tokens", self.window_s
        return None, 0.0

    def _forget(self, window: _Window, since: float) -> None:
        while window.requests and window.requests[0] <= since:
            window.requests.popleft()
        for lease_id, (at, charged) in list(window.charges.items()):
            if at <= since:
                del window.charges[lease_id]
                window.num_tokens -= charged

    def _ms_until_empty(self, times: Iterable[float], now: float) -> int:
        latest = max(times, default=None)
        return 0 if latest is None else max(0, round((latest + self.window_s - now) * 1000))


async def renew_leases(limiter: KeyLimiter, interval_s: float = LEASE_S / 3) -> None:
    """The api's loop that keeps its requests' leases (a failed renewal is retried next time:
    a lease outlives two missed ones)."""
    while True:
        await asyncio.sleep(interval_s)
        with contextlib.suppress(Exception):
            await limiter.renew()
