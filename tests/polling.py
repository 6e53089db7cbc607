"""Waiting for a state instead of sleeping for it: `eventually` polls a condition within a
deadline, so a test passes as soon as the state holds and fails with a message that names it.

Plain Python, no pytest: any test module (and the benchmarks) can wait with it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(
    condition: Callable[[], T],
    timeout_s: float,
    message: str | Callable[[], object],
    *,
    interval_s: float = 0.05,
) -> T:
    """Calls `condition` every `interval_s` until it returns something truthy, and returns that;
    raises AssertionError naming what it waited for and the last value if `timeout_s` passes
    first. `message` is that name, or a callable that tells more when it fails (a log's tail)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            told = message() if callable(message) else message
            raise AssertionError(f"not within {timeout_s:g} s: {told} (last: {value!r})")
        time.sleep(interval_s)


async def eventually_async(
    condition: Callable[[], Awaitable[T]],
    timeout_s: float,
    message: str,
    *,
    interval_s: float = 0.02,
) -> T:
    """`eventually` for a condition that must be awaited (an asyncio client's call), polled
    without blocking the event loop."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {message} (last: {value!r})")
        await asyncio.sleep(interval_s)
