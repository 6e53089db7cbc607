"""The api process's Prometheus metrics: TGI's names (`tgi_*`) and what TGI lacks (`tgq_*`).

`prometheus_client` holds the values and writes the text format 0.0.4, with two differences TGI's
Rust exporter makes: a counter has no `_total` suffix (`tgi_request_count 3.0`), and no metric has
a `_created` series. Each `Metrics` has its own registry, so several apps share one process.
"""

from __future__ import annotations

import itertools
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from operator import attrgetter

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from tgq.batcher.grammar_compiler import COMPILE_BUCKETS_S
from tgq.batcher.messages import Heartbeat
from tgq.batcher.speculation import ACCEPTANCE_BOUNDS

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0
)  # fmt: skip
# TGI uses 100 linear buckets of max/100 tokens; ten keep the exposition short at the same range.
NUM_TOKEN_BUCKETS = 10
FAILURE_ERRS = ("validation", "overloaded", "generation", "incomplete", "template", "dropped")
REJECT_REASONS = ("concurrency", "queue_requests", "queue_tokens")
JOB_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
# Per-key series are labelled by key name, for at most this many keys per replica; the requests
# of keys past them count under `OTHER_KEYS` (a deployment with thousands of keys reads
# `/v1/usage` instead).
MAX_KEY_LABELS = 64
OTHER_KEYS = "(other)"
BATCH_COUNTS = ("total", "completed", "failed")

# The switch is process-wide in prometheus_client; nothing else in the api process exports.
disable_created_metrics()  # type: ignore[no-untyped-call]  # the library leaves it unannotated


def token_buckets(max_tokens: int) -> tuple[float, ...]:
    """`NUM_TOKEN_BUCKETS` linear upper bounds ending at `max_tokens`."""
    top = max(max_tokens, 1)
    return tuple(top * (i + 1) / NUM_TOKEN_BUCKETS for i in range(NUM_TOKEN_BUCKETS))


def kv_usage(beat: Heartbeat) -> float:
    """Fraction of a batcher's usable KV blocks held by requests (cached, unheld blocks count
    as free: an allocation may evict them)."""
    return 1.0 - beat.num_free_blocks / beat.num_usable_blocks


_Family = type[GaugeMetricFamily] | type[CounterMetricFamily]
# Per batcher, from its heartbeat: (name, help, kind, value).
PER_BATCHER: tuple[tuple[str, str, _Family, Callable[[Heartbeat], float]], ...] = (
    ("tgq_kv_cache_usage_ratio", "KV-cache blocks held by requests / usable",
     GaugeMetricFamily, kv_usage),
    ("tgq_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
     CounterMetricFamily, attrgetter("num_prefix_query_tokens")),
    ("tgq_prefix_cache_hits", "Prompt tokens found in the prefix cache",
     CounterMetricFamily, attrgetter("num_prefix_hit_tokens")),
    ("tgq_batch_steps", "Steps that computed tokens",
     CounterMetricFamily, attrgetter("num_steps")),
    ("tgq_batch_step_tokens", "Tokens computed by the steps (prefill and decode)",
     CounterMetricFamily, attrgetter("num_step_tokens")),
    ("tgq_batch_step_tokens_max", "Tokens of the largest step since the start",
     GaugeMetricFamily, attrgetter("max_step_tokens")),
    ("tgq_grammar_cache_hits", "Structured-output requests whose grammar was compiled already",
     CounterMetricFamily, attrgetter("num_grammar_cache_hits")),
    ("tgq_grammar_compile_failures", "Grammars that failed to compile in the batcher",
     CounterMetricFamily, attrgetter("num_grammar_failures")),
    ("tgq_grammar_masks", "Token masks computed for constrained sequences",
     CounterMetricFamily, attrgetter("num_grammar_masks")),
    ("tgq_grammar_mask_seconds", "Seconds the steps spent computing token masks",
     CounterMetricFamily, attrgetter("grammar_mask_seconds")),
    ("tgq_grammar_argmax_checks", "Greedy constrained rows whose free argmax was checked first",
     CounterMetricFamily, attrgetter("num_grammar_argmax_checks")),
    ("tgq_grammar_argmax_misses", "Argmax checks the grammar refused (that row masked again)",
     CounterMetricFamily, attrgetter("num_grammar_argmax_misses")),
    ("tgq_spec_proposed_tokens", "Draft tokens proposed (speculative decoding)",
     CounterMetricFamily, attrgetter("num_spec_proposed")),
    ("tgq_spec_accepted_tokens", "Draft tokens the verification kept",
     CounterMetricFamily, attrgetter("num_spec_accepted")),
    ("tgq_spec_verify_forwards", "Sequence-steps that verified drafts (each keeps its accepted"
     " drafts plus one token: tokens per forward = 1 + accepted / this)",
     CounterMetricFamily, attrgetter("num_spec_verified")),
)  # fmt: skip


class BatcherCollector(Collector):
    """What the live batchers' last heartbeats say, read when scraped: running sequences, KV usage,
    prefix cache and steps. The per-batcher counters are each batcher's since it started (a
    restart resets them, as Prometheus expects of a counter); a batcher gone leaves no series."""

    def __init__(self) -> None:
        self.beats: Sequence[Heartbeat] = ()

    def collect(self) -> Iterator[Metric]:
        beats = self.beats
        yield GaugeMetricFamily(
            "tgi_batch_current_size",
            "Sequences running over all batchers",
            sum(beat.num_running for beat in beats),
        )
        yield GaugeMetricFamily("tgq_batchers_alive", "Batchers with a live heartbeat", len(beats))
        known = [beat for beat in beats if beat.num_usable_blocks]  # older batchers do not say
        for name, help_text, kind, value in PER_BATCHER:
            family = kind(name, help_text, labels=["batcher"])
            for beat in known:
                family.add_metric([beat.batcher_id], value(beat))
            yield family
        yield _compile_durations(known)
        yield _spec_acceptance(known)


def _compile_durations(beats: Sequence[Heartbeat]) -> HistogramMetricFamily:
    return _per_batcher_histogram(
        beats,
        "tgq_grammar_compile_duration",
        "Seconds to compile a structured-output grammar (off the step loop)",
        COMPILE_BUCKETS_S,
        lambda beat: (beat.grammar_compiles, beat.grammar_compile_seconds),
    )


def _spec_acceptance(beats: Sequence[Heartbeat]) -> HistogramMetricFamily:
    return _per_batcher_histogram(
        beats,
        "tgq_spec_acceptance_ratio",
        "Per sequence-step with drafts: accepted / proposed draft tokens",
        ACCEPTANCE_BOUNDS,
        lambda beat: ([*beat.spec_acceptance, 0], beat.spec_acceptance_sum),
    )


def _per_batcher_histogram(
    beats: Sequence[Heartbeat],
    name: str,
    help_text: str,
    bounds: Sequence[float],
    counts_of: Callable[[Heartbeat], tuple[list[int], float]],
) -> HistogramMetricFamily:
    """A histogram per batcher from its beat's bucket counts (one per bound, then +Inf) and
    sum; a beat whose counts do not fit the bounds (an older batcher's, or the feature off)
    adds none."""
    family = HistogramMetricFamily(name, help_text, labels=["batcher"])
    labels = [*map(str, bounds), "+Inf"]
    for beat in beats:
        counts, total = counts_of(beat)
        if len(counts) != len(labels):
            continue
        cumulative = list(itertools.accumulate(counts))
        family.add_metric([beat.batcher_id], list(zip(labels, cumulative, strict=True)), total)
    return family


def without_total_suffix(registry: CollectorRegistry) -> Callable[[str], str]:
    """Takes off the `_total` that prometheus_client's text format appends to each counter of
    `registry`, on its samples and in its `# HELP` / `# TYPE` lines (TGI writes
    `tgi_request_count 3.0`)."""
    counters = sorted(family.name for family in registry.collect() if family.type == "counter")
    names = "|".join(re.escape(name) for name in counters)
    pattern = re.compile(rf"^(# (?:HELP|TYPE) )?({names})_total\b", re.MULTILINE)
    return partial(pattern.sub, r"\1\2")


class Metrics:
    """Every metric the api exports; each method is one event or one gauge reading.

    One lock is held by every update and by `render`: the api updates from its event loop and
    from thread pools, and a scrape sees whole events (`on_success` lands entirely or not at all).
    """

    def __init__(self, *, max_input_tokens: int, max_total_tokens: int) -> None:
        self._lock = threading.Lock()
        self._registry = registry = CollectorRegistry()
        counter = partial(Counter, registry=registry)
        gauge = partial(Gauge, registry=registry)
        seconds = partial(Histogram, buckets=LATENCY_BUCKETS_S, registry=registry)
        input_tokens = partial(
            Histogram, buckets=token_buckets(max_input_tokens), registry=registry
        )
        total_tokens = partial(
            Histogram, buckets=token_buckets(max_total_tokens), registry=registry
        )

        self._request_count = counter("tgi_request_count", "Number of requests received")
        self._success = counter("tgi_request_success", "Number of successful requests")
        self._failure = counter("tgi_request_failure", "Number of failed requests", ["err"])
        self._duration = seconds("tgi_request_duration", "Request duration, end to end (s)")
        self._validation = seconds("tgi_request_validation_duration", "Validation time (s)")
        self._queue = seconds("tgi_request_queue_duration", "Time queued before generation (s)")
        self._inference = seconds("tgi_request_inference_duration", "Generation time (s)")
        self._time_per_token = seconds(
            "tgi_request_mean_time_per_token_duration", "Mean time per generated token (s)"
        )
        self._generated = total_tokens("tgi_request_generated_tokens", "Generated tokens")
        self._input_length = input_tokens("tgi_request_input_length", "Input tokens")
        self._max_new_tokens = total_tokens(
            "tgi_request_max_new_tokens", "Requested max_new_tokens"
        )
        self._queue_size = gauge("tgi_queue_size", "Requests waiting in the shared queue")
        self._batchers = BatcherCollector()
        registry.register(self._batchers)
        self._ttft = seconds("tgq_time_to_first_token_seconds", "Time to first token (s)")
        self._itl = seconds("tgq_inter_token_latency_seconds", "Time between streamed tokens (s)")
        self._rejected = counter(
            "tgq_requests_rejected", "Requests refused by admission", ["reason"]
        )
        self._in_flight = gauge("tgq_requests_in_flight", "Requests this replica is serving")
        self._tokenizer_calls = counter(
            "tgq_tokenizer_calls", "Calls to the tokenizer pool (encodes, chat-template renders)"
        )
        self._jobs = gauge("tgq_jobs", "Batch jobs by status", ["status"])
        self._batch_requests = gauge(
            "tgq_batch_request_counts",
            "Requests of the batches in progress (validating, in_progress, finalizing)",
            ["status"],
        )
        self._key_requests = counter(
            "tgq_key_requests", "Interactive requests finished, by API key name", ["key"]
        )
        self._key_prompt_tokens = counter(
            "tgq_key_prompt_tokens", "Prompt tokens of finished requests, by API key", ["key"]
        )
        self._key_completion_tokens = counter(
            "tgq_key_completion_tokens", "Generated tokens of finished requests, by API key",
            ["key"],
        )  # fmt: skip
        self._key_limited = counter(
            "tgq_key_rate_limited", "Requests refused by their key's limits", ["key", "limit"]
        )
        self._key_labels: set[str] = set()
        self._start_labelled_at_zero()
        self._tgi_counter_names = without_total_suffix(registry)

    def _start_labelled_at_zero(self) -> None:
        """The known label values are exported (at 0) before their first event."""
        for err in FAILURE_ERRS:
            self._failure.labels(err=err)
        for reason in REJECT_REASONS:
            self._rejected.labels(reason=reason)
        for status in JOB_STATUSES:
            self._jobs.labels(status=status)
        for status in BATCH_COUNTS:
            self._batch_requests.labels(status=status)

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
            self._failure.labels(err=err).inc()

    def set_queue_size(self, n: int) -> None:
        with self._lock:
            self._queue_size.set(n)

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self._ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        with self._lock:
            self._itl.observe(seconds)

    def on_rejected(self, reason: str) -> None:
        with self._lock:
            self._rejected.labels(reason=reason).inc()

    def on_key_usage(self, key: str, *, num_prompt_tokens: int, num_completion_tokens: int) -> None:
        with self._lock:
            label = self._key_label(key)
            self._key_requests.labels(key=label).inc()
            self._key_prompt_tokens.labels(key=label).inc(num_prompt_tokens)
            self._key_completion_tokens.labels(key=label).inc(num_completion_tokens)

    def on_key_limited(self, key: str, limit: str) -> None:
        with self._lock:
            self._key_limited.labels(key=self._key_label(key), limit=limit).inc()

    def _key_label(self, key: str) -> str:
        if key not in self._key_labels and len(self._key_labels) >= MAX_KEY_LABELS:
            return OTHER_KEYS
        self._key_labels.add(key)
        return key

    def on_tokenizer_call(self) -> None:
        with self._lock:
            self._tokenizer_calls.inc()

    def set_in_flight(self, n: int) -> None:
        with self._lock:
            self._in_flight.set(n)

    def set_batchers(self, beats: Sequence[Heartbeat]) -> None:
        """The live batchers' latest heartbeats, exported when scraped."""
        with self._lock:
            self._batchers.beats = tuple(beats)

    def set_batch_request_counts(self, counts: dict[str, int]) -> None:
        with self._lock:
            for status in BATCH_COUNTS:
                self._batch_requests.labels(status=status).set(counts.get(status, 0))

    def set_job_counts(self, counts: dict[str, int]) -> None:
        """All five statuses every time (absent ones are 0), plus any other status given."""
        with self._lock:
            for status, n in {**dict.fromkeys(JOB_STATUSES, 0), **counts}.items():
                self._jobs.labels(status=status).set(n)

    def render(self) -> bytes:
        with self._lock:
            text = generate_latest(self._registry).decode()
        return self._tgi_counter_names(text).encode()
