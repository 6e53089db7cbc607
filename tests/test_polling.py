"""`eventually`: it returns the condition's first truthy value, and names what it waited for
when the deadline passes (a callable message only then)."""

from __future__ import annotations

import time

import pytest

from tests.polling import eventually


def test_returns_the_first_truthy_value_once_the_state_holds() -> None:
    calls: list[int] = []

    def third_call() -> int | None:
        calls.append(1)
        return len(calls) if len(calls) >= 3 else None

    assert eventually(third_call, 5.0, "the third call", interval_s=0.001) == 3


def test_fails_after_the_deadline_naming_the_state_and_the_last_value() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"not within 0.2 s: a row is written \(last: \[\]\)"):
        eventually(lambda: [], 0.2, "a row is written")
    assert time.monotonic() - start >= 0.2


def test_a_callable_message_is_called_only_when_the_wait_fails() -> None:
    told: list[str] = []

    def log_tail() -> str:
        told.append("called")
        return "the worker's log"

    assert eventually(lambda: "done", 1.0, log_tail) == "done"
    assert told == []
    with pytest.raises(AssertionError, match=r"not within 0\.1 s: the worker's log"):
        eventually(lambda: None, 0.1, log_tail)
    assert told == ["called"]
