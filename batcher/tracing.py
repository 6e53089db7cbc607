"""Optional OpenTelemetry tracing (the `otel` extra), exported over OTLP/HTTP with protobuf.

Off unless the process calls `configure_tracing` (`--otlp-endpoint`): until then nothing imports
opentelemetry, `span()` is a no-op and `traceparent()` is "". The trace crosses the api → batcher
boundary as the W3C `traceparent` of the api's enqueue span, inside the submit message; the
batcher's `RequestSpans` continue it with the request's life there.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tgq.batcher.request import FAILED_REASONS

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from tgq.batcher.engine import RequestOutput
    from tgq.batcher.messages import FinalResult, SubmitRequest
    from tgq.batcher.request import Request

EXTRA_HINT = "install tgq's `otel` extra (pip install 'tgq[otel]')"
TRACES_PATH = "/v1/traces"


class TracingUnavailableError(RuntimeError):
    """`--otlp-endpoint` without the OpenTelemetry SDK and its OTLP/HTTP exporter."""


@dataclass(slots=True)
class _Tracing:
    tracer: Tracer | None = None
    provider: TracerProvider | None = None
    propagator: TraceContextTextMapPropagator | None = None


_state = _Tracing()  # one per process, as OpenTelemetry's own provider


def traces_url(endpoint: str) -> str:
    """TGI's `--otlp-endpoint` is the collector's base URL; OTLP/HTTP posts to `/v1/traces`."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith(TRACES_PATH) else endpoint + TRACES_PATH


def configure_tracing(endpoint: str, service_name: str, *, scope: str) -> None:
    """Export this process's spans (instrumentation scope `scope`: "api", "batcher") to the
    collector at `endpoint`, in batches, as service `service_name`."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError as error:
        raise TracingUnavailableError(
            f"--otlp-endpoint needs OpenTelemetry ({error.name} is not installed): {EXTRA_HINT}"
        ) from None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    exporter = OTLPSpanExporter(endpoint=traces_url(endpoint))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    _state.tracer = provider.get_tracer(scope)
    _state.provider = provider
    _state.propagator = TraceContextTextMapPropagator()


def shutdown_tracing() -> None:
    """Exports what is still buffered (at exit; the batch processor sends every few seconds)."""
    if _state.provider is not None:
        _state.provider.shutdown()
    _state.tracer = _state.provider = _state.propagator = None


def tracer() -> Tracer | None:
    return _state.tracer


@contextlib.contextmanager
def span(name: str, **attributes: str | int) -> Iterator[None]:
    """A child of the current span, while the block runs; nothing when tracing is off."""
    if _state.tracer is None:
        yield
        return
    with _state.tracer.start_as_current_span(name, attributes=attributes):
        yield


def traceparent() -> str:
    """The current span as a W3C `traceparent` header value ("" when tracing is off)."""
    if _state.propagator is None:
        return ""
    carrier: dict[str, str] = {}
    _state.propagator.inject(carrier)
    return carrier.get("traceparent", "")


def parent_context(headers: Mapping[str, str]) -> Any:
    """The remote parent named by a `traceparent` header (a new trace without one)."""
    assert _state.propagator is not None, "tracing is off"
    return _state.propagator.extract(headers)


@dataclass(slots=True)
class _Life:
    span: Span
    pulled_ns: int
    scheduled_ns: int | None = None  # start of the first step that computed it
    first_token_ns: int | None = None


@dataclass(slots=True)
class RequestSpans:
    """Each request's life in a batcher: a `batcher.request` span (child of the api's enqueue
    span) with `queue` (pulled → first scheduled), `prefill` (→ first token) and `decode`
    (→ finished) inside it. The phases become spans when the request ends, from the times
    `observe_step` noted, so the step loop only pays for a few integer stores."""

    tracer: Tracer
    lives: dict[str, _Life] = field(default_factory=dict)
    unscheduled: set[str] = field(default_factory=set)

    def start(self, submit: SubmitRequest, attributes: Mapping[str, str]) -> None:
        now = time.time_ns()
        span = self.tracer.start_span(
            "batcher.request",
            context=parent_context({"traceparent": submit.traceparent}),
            start_time=now,
            attributes={**attributes, "attempt": submit.attempt},
        )
        self.lives[submit.request_id] = _Life(span, now)
        self.unscheduled.add(submit.request_id)

    def observe_step(
        self, started_ns: int, outputs: list[RequestOutput], requests: Mapping[str, Request]
    ) -> None:
        """After a step that began at `started_ns`: who was computed for the first time, who
        got a first token."""
        now = time.time_ns()
        for request_id in [r for r in self.unscheduled if _was_scheduled(requests.get(r))]:
            self.lives[request_id].scheduled_ns = started_ns
            self.unscheduled.discard(request_id)
        for output in outputs:
            life = self.lives.get(output.request_id)
            if life is not None and output.new_token_ids and life.first_token_ns is None:
                life.first_token_ns = now
                life.scheduled_ns = life.scheduled_ns or started_ns

    def finish(self, result: FinalResult) -> None:
        life = self.lives.pop(result.request_id, None)
        self.unscheduled.discard(result.request_id)
        if life is None:
            return
        life.span.set_attributes(
            {
                "prompt_tokens": result.num_prompt_tokens,
                "generated_tokens": result.num_output_tokens,
                "cached_tokens": result.num_cached_tokens,
                "finish_reason": result.finish_reason,
            }
        )
        if result.finish_reason in FAILED_REASONS:
            from opentelemetry.trace import StatusCode

            life.span.set_status(StatusCode.ERROR, result.finish_detail or result.finish_reason)
        self._end(life, time.time_ns())

    def hand_back(self) -> None:
        """Ends the spans of requests handed back to the queue (another batcher reruns them)."""
        for life in self.lives.values():
            life.span.set_attribute("handed_back", True)
            self._end(life, time.time_ns())
        self.lives.clear()
        self.unscheduled.clear()

    def _end(self, life: _Life, end_ns: int) -> None:
        from opentelemetry.trace import set_span_in_context

        parent = set_span_in_context(life.span)
        phases = (
            ("queue", life.pulled_ns, life.scheduled_ns or end_ns),
            ("prefill", life.scheduled_ns, life.first_token_ns or end_ns),
            ("decode", life.first_token_ns, end_ns),
        )
        for name, start_ns, stop_ns in phases:
            if start_ns is not None:
                phase = self.tracer.start_span(name, context=parent, start_time=start_ns)
                phase.end(end_time=stop_ns)
        life.span.end(end_time=end_ns)


def _was_scheduled(request: Request | None) -> bool:
    return request is not None and request.num_computed_tokens > 0
