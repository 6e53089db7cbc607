"""Backpressure, decided before any tokenization or engine work (TGI's `try_acquire` on a
semaphore, plus the bounded queue TGI lacks).

A request is admitted when this replica serves fewer than `max_concurrent_requests`, when the
shared queue (requests submitted and not finished, over every replica; read from the transport at
most every `refresh_s`) is under `max_queued_requests`, and when the tokens this replica has in
flight (prompt + max new tokens) are under `max_queued_tokens`. Otherwise: `OverloadedError`
(429 with `Retry-After`). Admission itself is a few integer comparisons, no I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tgq.api.errors import OverloadedError


@dataclass(frozen=True, slots=True)
class Limits:
    max_concurrent_requests: int
    max_queued_requests: int
    max_queued_tokens: int
    retry_after_s: int


class Ticket:
    """One admitted request; `release` (idempotent) gives its slot and tokens back."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self.admitted_at = time.time()
        self.num_tokens = 0
        self.is_released = False

    def add_tokens(self, num_tokens: int) -> None:
        """Counts the request's tokens once they are known (after tokenization)."""
        self.num_tokens += num_tokens
        self._admission.num_tokens += num_tokens

    def release(self) -> None:
        if not self.is_released:
            self.is_released = True
            self._admission.num_in_flight -= 1
            self._admission.num_tokens -= self.num_tokens


@dataclass(slots=True)
class Submission:
    is_queued: bool = False


class Admission:
    def __init__(
        self,
        limits: Limits,
        *,
        on_reject: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.limits = limits
        self.num_in_flight = 0
        self.num_tokens = 0
        self._queue_depth = 0  # as last read from the transport, plus what we submitted since
        self.num_submissions = 0  # `note_submitted` calls so far
        self._on_reject = on_reject

    def set_queue_depth(self, depth: int, *, since: int | None = None) -> None:
        """The depth read from the transport. `since`: `num_submissions` when the read was sent;
        where submissions were noted while it was under way, the read may or may not count them,
        so the larger of the two views is kept (never counted twice, never dropped) until the
        next read."""
        if since is not None and since != self.num_submissions:
            depth = max(depth, self._queue_depth)
        self._queue_depth = depth

    def note_submitted(self, num_requests: int) -> None:
        """Counts requests about to be submitted (before the write: a read racing the write then
        sees either the write or this note), or, negative, takes back ones that were not."""
        self._queue_depth += num_requests
        self.num_submissions += 1

    @contextmanager
    def submitting(self, num_requests: int) -> Iterator[Submission]:
        """Counts `num_requests` about to be submitted for the body of the `with`, and takes them
        back unless the body marks them `queued` (a failed write, an idempotent repeat)."""
        submission = Submission()
        self.note_submitted(num_requests)
        try:
            yield submission
        finally:
            if not submission.is_queued:
                self.note_submitted(-num_requests)

    @property
    def queue_depth(self) -> int:
        return self._queue_depth

    def is_at_capacity(self) -> bool:
        """Whether the next request would be refused for concurrency."""
        return self.num_in_flight >= self.limits.max_concurrent_requests

    def admit(self, *, num_requests: int = 1) -> Ticket:
        """A ticket for one interactive request (of `num_requests` engine requests), or 429."""
        if self.is_at_capacity():
            self._reject("concurrency", "Model is overloaded")
        self.check_queue(num_requests)
        self.num_in_flight += 1
        return Ticket(self)

    def check_queue(self, num_requests: int) -> None:
        """429 unless the queue has room for `num_requests` more (jobs check only this)."""
        limits = self.limits
        if self._queue_depth + num_requests > limits.max_queued_requests:
            self._reject(
                "queue_requests",
                f"Queue is full: {self._queue_depth} requests queued "
                f"(max_queued_requests={limits.max_queued_requests})",
            )
        if self.num_tokens >= limits.max_queued_tokens:
            self._reject(
                "queue_tokens",
                f"Queue is full: {self.num_tokens} tokens in flight "
                f"(max_queued_tokens={limits.max_queued_tokens})",
            )

    def _reject(self, reason: str, message: str) -> None:
        self._on_reject(reason)
        raise OverloadedError(message, retry_after_s=self.limits.retry_after_s)
