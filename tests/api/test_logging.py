"""Request ids, JSON logs and traces.

- The middleware on a tiny app: a valid `x-request-id` is echoed, a missing or invalid one is
  replaced by a new id; every answer carries it (errors and 500s too), and lines logged while the
  request runs carry it.
- A real stack (api and batcher processes, Redis, Postgres) with `JSON_OUTPUT` / `--json-output`:
  every line of both logs is a JSON object, and one request's id is on the api's access line, on
  its `job ... queued` line (with the job id) and on the batcher's lines about its item.
- With the `otel` extra: a tiny OTLP/HTTP collector receives the api's server and enqueue spans
  and the batcher's request span (with queue, prefill and decode) in one trace.
- Without OpenTelemetry, `--otlp-endpoint` stops the api and the batcher at start, naming the
  extra; with tracing off, nothing of OpenTelemetry's tracing is imported.
"""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tests.api.stack import ROOT, Stack, free_port
from tgq.api.observability import RequestIdMiddleware
from tgq.api.settings import Settings
from tgq.batcher.flags import as_env, given
from tgq.batcher.logs import JsonFormatter
from tgq.batcher.options import BatcherOptions
from tgq.cli.main import build_parser

NEW_ID = re.compile(r"[0-9a-f]{32}")
BODY = {"inputs": "The Python language", "parameters": {"max_new_tokens": 4, "ignore_eos": True}}


# --- the middleware on a tiny app ------------------------------------------------------------


@pytest.fixture
def lines() -> Iterator[io.StringIO]:
    """What the root logger writes meanwhile, as JSON lines (see `api_lines`)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.addHandler(handler)
    level, root.level = root.level, logging.INFO
    yield stream
    root.removeHandler(handler)
    root.setLevel(level)


def api_lines(stream: io.StringIO) -> list[dict[str, Any]]:
    """The api's lines (not the test client's)."""
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    return [line for line in lines if line["target"].startswith("api")]


@pytest.fixture
def tiny() -> TestClient:
    app = FastAPI()

    @app.get("/hello")
    def hello() -> dict[str, str]:
        logging.getLogger("api.tiny").info("saying hello")
        return {"hello": "world"}

    @app.get("/v1/boom")
    def boom() -> None:
        raise RuntimeError("boom")

    app.add_middleware(RequestIdMiddleware)
    return TestClient(app)


def test_a_valid_request_id_is_echoed(tiny: TestClient, lines: io.StringIO) -> None:
    answer = tiny.get("/hello", headers={"x-request-id": "Abc-1.2_3"})
    assert answer.headers["x-request-id"] == "Abc-1.2_3"
    (line,) = api_lines(lines)
    assert (line["message"], line["request_id"]) == ("saying hello", "Abc-1.2_3")


@pytest.mark.parametrize(
    "header", [None, "", "has space", "semi;colon", "a/b", "%C3%A9", "x" * 65], ids=repr
)
def test_a_missing_or_invalid_request_id_is_replaced(tiny: TestClient, header: str | None) -> None:
    headers = {} if header is None else {"x-request-id": header}
    answer = tiny.get("/hello", headers=headers)
    assert answer.status_code == 200
    assert NEW_ID.fullmatch(answer.headers["x-request-id"])
    assert tiny.get("/hello").headers["x-request-id"] != answer.headers["x-request-id"]


def test_the_longest_valid_request_id_is_kept(tiny: TestClient) -> None:
    assert (
        tiny.get("/hello", headers={"x-request-id": "x" * 64}).headers["x-request-id"] == "x" * 64
    )


def test_errors_carry_the_request_id(tiny: TestClient, lines: io.StringIO) -> None:
    assert tiny.get("/nowhere", headers={"x-request-id": "r404"}).headers["x-request-id"] == "r404"
    failed = tiny.get("/v1/boom", headers={"x-request-id": "r500"})
    assert failed.status_code == 500
    assert failed.headers["x-request-id"] == "r500"
    assert failed.json()["error"]["message"] == "Internal server error"
    (line,) = api_lines(lines)
    assert (line["level"], line["request_id"]) == ("ERROR", "r500")
    assert line["message"] == "GET /v1/boom failed"
    assert "RuntimeError: boom" in line["exception"]


# --- JSON logs of a real stack ---------------------------------------------------------------


@pytest.fixture(scope="module")
def json_stack(
    text_model_dir: Path, pg_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    log_dir = tmp_path_factory.mktemp("json-logs")
    running = Stack(
        text_model_dir, pg_url, log_dir, api_env={"JSON_OUTPUT": "true"},
        batcher_options=("--json-output",),
    )  # fmt: skip
    try:
        running.start_batcher()
        running.start_api()
        yield running
    finally:
        running.stop()


def json_lines(path: Path) -> list[dict[str, Any]]:
    """Every line of the log, each of which must be one JSON object."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def about(lines: list[dict[str, Any]], request_id: str) -> list[dict[str, Any]]:
    return [line for line in lines if line.get("request_id") == request_id]


def wait_for(path: Path, request_id: str, message: str) -> list[dict[str, Any]]:
    """The log's lines about the request, once one of them contains `message`."""
    deadline = time.monotonic() + 10
    while True:
        lines = about(json_lines(path), request_id)
        if any(message in line["message"] for line in lines) or time.monotonic() > deadline:
            return lines
        time.sleep(0.1)


def test_one_request_id_in_the_api_and_batcher_logs(json_stack: Stack) -> None:
    request_id = "trace-me.1"
    answer = httpx.post(
        f"{json_stack.url}/generate", json=BODY, headers={"x-request-id": request_id}, timeout=60
    )
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-request-id"] == request_id

    api_lines = wait_for(json_stack.log_dir / "api.log", request_id, "POST /generate")
    access = [line for line in api_lines if line["target"] == "uvicorn.access"]
    assert len(access) == 1 and '"POST /generate HTTP/1.1" 200' in access[0]["message"]
    (queued,) = [line for line in api_lines if "queued" in line["message"]]
    job_id = queued["job_id"]
    assert queued["message"] == f"job {job_id}: 1 requests queued"

    batcher_lines = wait_for(json_stack.log_dir / "batcher-b0.log", request_id, "finished")
    messages = [line["message"] for line in batcher_lines]
    assert messages[0].startswith(f"request {job_id}.0 pulled (attempt 1, ")
    assert messages[-1].startswith(f"request {job_id}.0 finished: length")
    assert {line["item_id"] for line in batcher_lines} == {f"{job_id}.0"}
    assert batcher_lines[-1]["generated_tokens"] == 4
    for line in [*api_lines, *batcher_lines]:
        assert line["timestamp"].endswith("Z") and line["level"] == "INFO"


def test_invalid_ids_are_replaced_and_errors_carry_theirs(json_stack: Stack) -> None:
    replaced = httpx.post(
        f"{json_stack.url}/generate", json=BODY, headers={"x-request-id": "no spaces"}, timeout=60
    )
    assert replaced.status_code == 200
    new_id = replaced.headers["x-request-id"]
    assert NEW_ID.fullmatch(new_id)
    assert wait_for(json_stack.log_dir / "batcher-b0.log", new_id, "finished")

    too_long = {"inputs": "x", "parameters": {"max_new_tokens": 5000}}
    rejected = httpx.post(f"{json_stack.url}/generate", json=too_long, timeout=60)
    assert rejected.status_code == 422
    assert NEW_ID.fullmatch(rejected.headers["x-request-id"])
    health = httpx.get(f"{json_stack.url}/health", headers={"x-request-id": "probe"}, timeout=10)
    assert health.headers["x-request-id"] == "probe"


def test_every_line_of_both_logs_is_json(json_stack: Stack) -> None:
    api_lines = json_lines(json_stack.log_dir / "api.log")
    batcher_lines = json_lines(json_stack.log_dir / "batcher-b0.log")
    for line in [*api_lines, *batcher_lines]:
        assert {"timestamp", "level", "target", "message"} <= set(line)
    targets = {line["target"] for line in api_lines}
    assert {"uvicorn.error", "uvicorn.access", "api"} <= targets  # uvicorn's own loggers too
    assert "batcher" in {line["target"] for line in batcher_lines}


# --- traces ----------------------------------------------------------------------------------


class Collector(ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver: POST /v1/traces, protobuf `ExportTraceServiceRequest`."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", free_port()), _Receiver)
        self.spans: list[tuple[str, Any]] = []  # (instrumentation scope, span)
        self.paths: set[str] = set()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def named(self, name: str) -> list[tuple[str, Any]]:
        return [(scope, span) for scope, span in self.spans if span.name == name]


class _Receiver(BaseHTTPRequestHandler):
    server: Collector

    def do_POST(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.paths.add(self.path)
        for resource_spans in ExportTraceServiceRequest.FromString(body).resource_spans:
            for scope_spans in resource_spans.scope_spans:
                self.server.spans += [(scope_spans.scope.name, s) for s in scope_spans.spans]
        answer = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass


def attributes(span: Any) -> dict[str, Any]:
    def plain(value: Any) -> Any:
        return getattr(value, value.WhichOneof("value"))

    return {kv.key: plain(kv.value) for kv in span.attributes}


@pytest.fixture
def collector() -> Iterator[Collector]:
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="needs tgq's `otel` extra")
    server = Collector()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_spans_of_the_api_and_the_batcher_share_one_trace(
    collector: Collector,
    text_model_dir: Path,
    pg_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export within 0.1 s (both processes)
    running = Stack(
        text_model_dir, pg_url, tmp_path, api_env={"OTLP_ENDPOINT": collector.endpoint},
        batcher_options=("--otlp-endpoint", collector.endpoint),
    )  # fmt: skip
    trace_id, client_span_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    try:
        running.start_batcher()
        running.start_api()
        answer = httpx.post(
            f"{running.url}/generate",
            json=BODY,
            headers={
                "x-request-id": "traced-1",
                "traceparent": f"00-{trace_id}-{client_span_id}-01",
            },
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        deadline = time.monotonic() + 30
        while not collector.named("batcher.request") and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        running.stop()
    assert collector.paths == {"/v1/traces"}
    ((server_scope, server),) = [(scope, span) for scope, span in collector.named("POST /generate")]
    assert server_scope == "api"
    assert server.trace_id.hex() == trace_id
    assert server.parent_span_id.hex() == client_span_id  # the client's traceparent
    assert server.kind == server.SPAN_KIND_SERVER
    assert attributes(server) == {
        "http.request.method": "POST", "http.route": "/generate",
        "http.response.status_code": 200, "request_id": "traced-1",
    }  # fmt: skip
    ((_, enqueue),) = collector.named("enqueue")
    assert enqueue.parent_span_id == server.span_id
    job_id = attributes(enqueue)["job_id"]

    ((request_scope, request),) = collector.named("batcher.request")
    assert request_scope == "batcher"
    assert request.trace_id.hex() == trace_id
    assert request.parent_span_id == enqueue.span_id
    facts = attributes(request)
    assert facts["request_id"] == "traced-1"
    assert facts["item_id"] == f"{job_id}.0"
    assert facts["prompt_tokens"] > 0
    assert (facts["generated_tokens"], facts["finish_reason"]) == (4, "length")
    phases = {
        span.name: span for _, span in collector.spans if span.parent_span_id == request.span_id
    }
    assert set(phases) == {"queue", "prefill", "decode"}
    assert phases["queue"].end_time_unix_nano == phases["prefill"].start_time_unix_nano
    assert phases["prefill"].end_time_unix_nano == phases["decode"].start_time_unix_nano
    assert phases["decode"].end_time_unix_nano == request.end_time_unix_nano
    others = {span.trace_id.hex() for _, span in collector.spans if span.name != "GET /health"}
    assert others == {trace_id}  # the health checks of `start_api` are traces of their own


# --- without OpenTelemetry, and with tracing off ---------------------------------------------

WITHOUT_OTEL = "import sys; sys.modules['opentelemetry.sdk'] = None; "


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], check=False, cwd=ROOT, capture_output=True, text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", **env},
    )  # fmt: skip


def test_an_otlp_endpoint_without_the_extra_stops_the_api() -> None:
    done = run_python(
        WITHOUT_OTEL + "from api.__main__ import main; main()", OTLP_ENDPOINT="http://127.0.0.1:9"
    )
    assert done.returncode == 1
    assert "api: --otlp-endpoint needs OpenTelemetry" in done.stderr
    assert "install tgq's `otel` extra (pip install 'tgq[otel]')" in done.stderr


def test_an_otlp_endpoint_without_the_extra_stops_the_batcher() -> None:
    argv = ["--model-id", "/nowhere", "--otlp-endpoint", "http://127.0.0.1:9"]
    done = run_python(WITHOUT_OTEL + f"from batcher.__main__ import main; main({argv!r})")
    assert done.returncode == 1
    assert "batcher: --otlp-endpoint needs OpenTelemetry" in done.stderr
    assert "`otel` extra" in done.stderr


def test_tracing_off_imports_no_tracing() -> None:
    """(redis-py imports OpenTelemetry's metrics SDK when it is installed; not its tracing.)"""
    done = run_python(
        "import sys, logging\n"
        "from api.app import create_app\n"
        "from bulk.batches.starters import starter_for\n"
        "from api.settings import Settings\n"
        "from batcher.logs import configure_logging\n"
        "import batcher.serving, batcher.__main__\n"
        "configure_logging(json_output=True)\n"
        "create_app(Settings(), batch_starter=starter_for)\n"
        "logging.getLogger('api').info('hello')\n"
        "print(sorted(m for m in sys.modules"
        " if m.startswith(('opentelemetry.sdk.trace', 'opentelemetry.exporter'))))\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    assert json.loads(done.stderr)["message"] == "hello"


# --- the launcher's flags ----------------------------------------------------------------------


def test_log_flags_reach_every_service() -> None:
    """The log flags are settings like any other: `tgq serve` writes them into the environment
    every child (api, batcher, worker) reads its options from."""
    args = build_parser().parse_args(
        ["serve", "--json-output", "--otlp-endpoint", "http://c:4318", "--otlp-service-name", "s"]
    )
    env = as_env(given(args, Settings))
    assert env == {
        "JSON_OUTPUT": "true",
        "OTLP_ENDPOINT": "http://c:4318",
        "OTLP_SERVICE_NAME": "s",
    }
    options = BatcherOptions(**given(args, BatcherOptions))
    assert (options.json_output, options.otlp_endpoint, options.otlp_service_name) == (
        True, "http://c:4318", "s",
    )  # fmt: skip
    assert given(build_parser().parse_args(["api"]), Settings) == {}
