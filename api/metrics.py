"""The api process's Prometheus metrics: TGI's names (`tgi_*`) and what TGI lacks (`tgq_*`).

TGI's Rust exporter writes counters without a `_total` suffix (`tgi_request_count 3`), which
`prometheus_client` cannot do, so this module writes the text exposition format 0.0.4 itself.
One lock guards every metric: the api updates them from its event loop and from thread pools, and
`render` sees one consistent snapshot (e.g. `on_success` lands as a whole or not at all).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import ClassVar

from tgq.batcher.messages import Heartbeat

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0
)  # fmt: skip
# TGI uses 100 linear buckets of max/100 tokens; ten keep the exposition short at the same range.
NUM_TOKEN_BUCKETS = 10
FAILURE_ERRS = ("validation", "overloaded", "generation", "incomplete", "template", "dropped")
REJECT_REASONS = ("concurrency", "queue_requests", "queue_tokens")
JOB_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
BATCH_COUNTS = ("total", "completed", "failed")


def token_buckets(max_tokens: int) -> tuple[float, ...]:
    """`NUM_TOKEN_BUCKETS` linear upper bounds ending at `max_tokens`."""
    top = max(max_tokens, 1)
    return tuple(top * (i + 1) / NUM_TOKEN_BUCKETS for i in range(NUM_TOKEN_BUCKETS))


def _fmt(value: float) -> str:
    value = float(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return str(int(value)) if value.is_integer() else repr(value)


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _sample(name: str, labels: Sequence[tuple[str, str]], value: float) -> str:
    if not labels:
        return f"{name} {_fmt(value)}"
    body = ",".join(f'{key}="{_escape_label(val)}"' for key, val in labels)
    return f"{name}{{{body}}} {_fmt(value)}"


class _Metric:
    """One metric family; callers hold `Metrics._lock`."""

    kind: ClassVar[str]

    def __init__(self, name: str, help_text: str) -> None:
        self.name, self.help_text = name, help_text

    def render(self) -> Iterator[str]:
        help_text = self.help_text.replace("\\", "\\\\").replace("\n", "\\n")
        yield f"# HELP {self.name} {help_text}"
        yield f"# TYPE {self.name} {self.kind}"
        yield from self._samples()

    def _samples(self) -> Iterator[str]:
        raise NotImplementedError


class _Scalar(_Metric):
    """A counter or gauge, unlabelled or with one label; known label values start at 0."""

    def __init__(
        self, name: str, help_text: str, label: str | None = None, values: Iterable[str] = ()
    ) -> None:
        super().__init__(name, help_text)
        self.label = label
        self._values: dict[str, float] = dict.fromkeys(values if label else ("",), 0.0)

    def _samples(self) -> Iterator[str]:
        for label_value, value in self._values.items():
            labels = [(self.label, label_value)] if self.label else []
            yield _sample(self.name, labels, value)

    def replace(self, values: dict[str, float]) -> None:
        """Every labelled value at once, as read from elsewhere (the batchers' heartbeats): a
        label absent now (a batcher gone) disappears."""
        self._values = dict(values)


class _Counter(_Scalar):
    kind = "counter"

    def inc(self, label_value: str = "") -> None:
        self._values[label_value] = self._values.get(label_value, 0.0) + 1


class _Gauge(_Scalar):
    kind = "gauge"

    def set(self, value: float, label_value: str = "") -> None:
        self._values[label_value] = value


class _Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        super().__init__(name, help_text)
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * len(self.buckets)  # per bucket; cumulated when rendered
        self._sum, self._count = 0.0, 0

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(self.buckets, value)  # first bound >= value (`le`)
        if index < len(self._counts):
            self._counts[index] += 1
        self._sum += value
        self._count += 1

    def _samples(self) -> Iterator[str]:
        cumulative = 0
        for bound, count in zip(self.buckets, self._counts, strict=True):
            cumulative += count
            yield _sample(f"{self.name}_bucket", [("le", _fmt(bound))], cumulative)
        yield _sample(f"{self.name}_bucket", [("le", "+Inf")], self._count)
        yield _sample(f"{self.name}_sum", [], self._sum)
        yield _sample(f"{self.name}_count", [], self._count)


def kv_usage(beat: Heartbeat) -> float:
    """Fraction of a batcher's usable KV blocks held by requests (cached, unheld blocks count
    as free: an allocation may evict them)."""
    return 1.0 - beat.num_free_blocks / beat.num_usable_blocks


def _seconds(name: str, help_text: str) -> _Histogram:
    return _Histogram(name, help_text, LATENCY_BUCKETS_S)


class Metrics:
    """Every metric the api exports; each method is one event or one gauge reading."""

    def __init__(self, *, max_input_tokens: int, max_total_tokens: int) -> None:
        self._lock = threading.Lock()
        self._request_count = _Counter("tgi_request_count", "Number of requests received")
        self._success = _Counter("tgi_request_success", "Number of successful requests")
        self._failure = _Counter(
            "tgi_request_failure", "Number of failed requests", "err", FAILURE_ERRS
        )
        self._duration = _seconds("tgi_request_duration", "Request duration, end to end (s)")
        self._validation = _seconds("tgi_request_validation_duration", "Validation time (s)")
        self._queue = _seconds("tgi_request_queue_duration", "Time queued before generation (s)")
        self._inference = _seconds("tgi_request_inference_duration", "Generation time (s)")
        self._time_per_token = _seconds(
            "tgi_request_mean_time_per_token_duration", "Mean time per generated token (s)"
        )
        self._generated = _Histogram(
            "tgi_request_generated_tokens", "Generated tokens", token_buckets(max_total_tokens)
        )
        self._input_length = _Histogram(
            "tgi_request_input_length", "Input tokens", token_buckets(max_input_tokens)
        )
        self._max_new_tokens = _Histogram(
            "tgi_request_max_new_tokens",
            "Requested max_new_tokens",
            token_buckets(max_total_tokens),
        )
        self._queue_size = _Gauge("tgi_queue_size", "Requests waiting in the shared queue")
        self._batch_size = _Gauge("tgi_batch_current_size", "Sequences running over all batchers")
        self._ttft = _seconds("tgq_time_to_first_token_seconds", "Time to first token (s)")
        self._itl = _seconds("tgq_inter_token_latency_seconds", "Time between streamed tokens (s)")
        self._rejected = _Counter(
            "tgq_requests_rejected", "Requests refused by admission", "reason", REJECT_REASONS
        )
        self._in_flight = _Gauge("tgq_requests_in_flight", "Requests this replica is serving")
        self._tokenizer_calls = _Counter(
            "tgq_tokenizer_calls", "Calls to the tokenizer pool (encodes, chat-template renders)"
        )
        self._batchers_alive = _Gauge("tgq_batchers_alive", "Batchers with a live heartbeat")
        self._jobs = _Gauge("tgq_jobs", "Batch jobs by status", "status", JOB_STATUSES)
        self._kv_usage = _Gauge(
            "tgq_kv_cache_usage_ratio", "KV-cache blocks held by requests / usable", "batcher"
        )
        self._prefix_queries = _Counter(
            "tgq_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", "batcher"
        )
        self._prefix_hits = _Counter(
            "tgq_prefix_cache_hits", "Prompt tokens found in the prefix cache", "batcher"
        )
        self._steps = _Counter("tgq_batch_steps", "Steps that computed tokens", "batcher")
        self._step_tokens = _Counter(
            "tgq_batch_step_tokens", "Tokens computed by the steps (prefill and decode)", "batcher"
        )
        self._max_step_tokens = _Gauge(
            "tgq_batch_step_tokens_max", "Tokens of the largest step since the start", "batcher"
        )
        self._batch_requests = _Gauge(
            "tgq_batch_request_counts",
            "Requests of the batches in progress (validating, in_progress, finalizing)",
            "status",
            BATCH_COUNTS,
        )
        self._all: tuple[_Metric, ...] = tuple(
            value for value in vars(self).values() if isinstance(value, _Metric)
        )

    def on_request(self) -> None:
        with self._lock:
            self._request_count.inc()

    def on_success(
        self,
        *,
        validation_s: float,
        queue_s: float,
        inference_s: float,
        total_s: float,
        time_per_token_s: float | None,
        num_input_tokens: int,
        num_generated_tokens: int,
        max_new_tokens: int,
    ) -> None:
        with self._lock:
            self._success.inc()
            self._duration.observe(total_s)
            self._validation.observe(validation_s)
            self._queue.observe(queue_s)
            self._inference.observe(inference_s)
            if time_per_token_s is not None:
                self._time_per_token.observe(time_per_token_s)
            self._generated.observe(num_generated_tokens)
            self._input_length.observe(num_input_tokens)
            self._max_new_tokens.observe(max_new_tokens)

    def on_failure(self, err: str) -> None:
        with self._lock:
            self._failure.inc(err)

    def set_queue_size(self, n: int) -> None:
        self._set(self._queue_size, n)

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self._ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        with self._lock:
            self._itl.observe(seconds)

    def on_rejected(self, reason: str) -> None:
        with self._lock:
            self._rejected.inc(reason)

    def on_tokenizer_call(self) -> None:
        with self._lock:
            self._tokenizer_calls.inc()

    def set_in_flight(self, n: int) -> None:
        self._set(self._in_flight, n)

    def set_batchers(self, beats: Sequence[Heartbeat]) -> None:
        """What the live batchers' heartbeats say: running sequences, KV usage, prefix cache
        (each batcher's counters since it started; a restart resets them, as Prometheus expects
        of a counter)."""
        with self._lock:
            self._batchers_alive.set(len(beats))
            self._batch_size.set(sum(beat.num_running for beat in beats))
            known = [b for b in beats if b.num_usable_blocks]  # older batchers do not say
            self._kv_usage.replace({b.batcher_id: kv_usage(b) for b in known})
            self._prefix_queries.replace({b.batcher_id: b.num_prefix_query_tokens for b in known})
            self._prefix_hits.replace({b.batcher_id: b.num_prefix_hit_tokens for b in known})
            self._steps.replace({b.batcher_id: b.num_steps for b in known})
            self._step_tokens.replace({b.batcher_id: b.num_step_tokens for b in known})
            self._max_step_tokens.replace({b.batcher_id: b.max_step_tokens for b in known})

    def set_batch_request_counts(self, counts: dict[str, int]) -> None:
        with self._lock:
            for status in BATCH_COUNTS:
                self._batch_requests.set(counts.get(status, 0), status)

    def set_job_counts(self, counts: dict[str, int]) -> None:
        """All five statuses every time (absent ones are 0), plus any other status given."""
        with self._lock:
            for status, n in {**dict.fromkeys(JOB_STATUSES, 0), **counts}.items():
                self._jobs.set(n, status)

    def render(self) -> bytes:
        with self._lock:
            lines = [line for metric in self._all for line in metric.render()]
        return ("\n".join(lines) + "\n").encode()

    def _set(self, gauge: _Gauge, value: float) -> None:
        with self._lock:
            gauge.set(value)
