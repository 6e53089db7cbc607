"""Every route of the api, called once, for the outage tests: what each one answers when all is
up, and which dependencies it cannot answer without.

`ROUTES` names every (method, path) of the OpenAPI document and the routes the document leaves
out; `check_covers` fails when the api has a route this table does not call, so a new route is
tested under outages from the day it is added.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

Dependency = Literal["database", "redis"]
DATABASE: frozenset[Dependency] = frozenset({"database"})
REDIS: frozenset[Dependency] = frozenset({"redis"})
BOTH = DATABASE | REDIS
NONE: frozenset[Dependency] = frozenset()

SHORT = {"max_new_tokens": 2}
CHAT = {"model": "tgq-test", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "tgq-test", "prompt": "hi", "max_tokens": 2}
BATCH_LINE = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": COMPLETION}
HIDDEN = ("/metrics", "/ping", "/", "/docs", "/redoc", "/openapi.json", "/api-doc/openapi.json")


@dataclass(frozen=True)
class Known:
    """Things made while all was up: a finished job, an uploaded file."""

    job_id: str
    file_id: str


@dataclass(frozen=True)
class Call:
    method: str
    route: str  # the path as the OpenAPI document writes it
    needs: frozenset[Dependency]
    normal: int  # the status when all is up
    options: Callable[[Known], dict[str, Any]] = field(default=lambda known: {})
    path: Callable[[Known], str] | None = None  # the route with its parameters filled in
    label: str = ""

    def send(self, client: httpx.Client, known: Known) -> httpx.Response:
        path = self.route if self.path is None else self.path(known)
        return client.request(self.method, path, **self.options(known))

    def __str__(self) -> str:
        return f"{self.method} {self.route}{f' ({self.label})' if self.label else ''}"


def _json(body: dict[str, Any], **headers: str) -> Callable[[Known], dict[str, Any]]:
    return lambda known: {"json": body, "headers": headers}


def _upload(known: Known) -> dict[str, Any]:
    content = (json.dumps(BATCH_LINE) + "\n").encode()
    return {"data": {"purpose": "batch"}, "files": {"file": ("in.jsonl", content)}}


def _batch(known: Known) -> dict[str, Any]:
    body = {"input_file_id": known.file_id, "endpoint": "/v1/completions"}
    return {"json": {**body, "completion_window": "24h"}}


def streamed(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "stream": True}


def _no_batch_cancel(known: Known) -> str:
    return "/v1/batches/b-x/cancel"


def _job_path(suffix: str = "") -> Callable[[Known], str]:
    return lambda known: f"/v1/jobs/{known.job_id}{suffix}"


def _file_path(suffix: str = "") -> Callable[[Known], str]:
    return lambda known: f"/v1/files/{known.file_id}{suffix}"


def _idempotent(key: str) -> Call:
    body = {"prompt": "kept", "parameters": SHORT}
    options = _json(body, **{"Idempotency-Key": key})
    return Call("POST", "/v1/jobs", BOTH, 202, options, label="Idempotency-Key")


def routes(idempotency_key: str | None = None) -> list[Call]:
    """One call per route (two where a route streams or not); `idempotency_key`: the key of the
    job posted with one."""
    key = idempotency_key or uuid.uuid4().hex
    generate = {"inputs": "hello", "parameters": SHORT}
    return [
        Call("POST", "/generate", BOTH, 200, _json(generate)),
        Call("POST", "/generate_stream", BOTH, 200, _json(generate)),
        Call("POST", "/", BOTH, 200, _json(generate)),
        Call("POST", "/", BOTH, 200, _json(streamed(generate)), label="stream"),
        Call("POST", "/tokenize", NONE, 200, _json({"inputs": "hello"})),
        Call("GET", "/info", NONE, 200),
        Call("GET", "/health", BOTH, 200),
        Call("GET", "/ping", BOTH, 200),
        Call("GET", "/", BOTH, 200),
        Call("GET", "/metrics", NONE, 200),
        Call("GET", "/docs", NONE, 200),
        Call("GET", "/redoc", NONE, 200),
        Call("GET", "/openapi.json", NONE, 200),
        Call("GET", "/api-doc/openapi.json", NONE, 200),
        Call("POST", "/v1/chat/completions", BOTH, 200, _json(CHAT)),
        Call("POST", "/v1/chat/completions", BOTH, 200, _json(streamed(CHAT)), label="stream"),
        Call("POST", "/v1/completions", BOTH, 200, _json(COMPLETION)),
        Call("POST", "/v1/completions", BOTH, 200, _json(streamed(COMPLETION)), label="stream"),
        Call("GET", "/v1/models", NONE, 200),
        Call("POST", "/v1/jobs", BOTH, 202, _json({"prompt": "x", "parameters": SHORT})),
        _idempotent(key),
        Call("GET", "/v1/jobs", DATABASE, 200),
        Call("GET", "/v1/jobs/{job_id}", DATABASE, 200, path=_job_path()),
        Call("DELETE", "/v1/jobs/{job_id}", DATABASE, 200, path=_job_path()),  # finished
        Call("GET", "/v1/jobs/{job_id}/events", DATABASE, 200, path=_job_path("/events")),
        Call("POST", "/v1/files", DATABASE, 200, _upload),
        Call("GET", "/v1/files", DATABASE, 200),
        Call("GET", "/v1/files/{file_id}", DATABASE, 200, path=_file_path()),
        Call("GET", "/v1/files/{file_id}/content", DATABASE, 200, path=_file_path("/content")),
        Call("DELETE", "/v1/files/{file_id}", DATABASE, 404, path=lambda known: "/v1/files/f-x"),
        Call("POST", "/v1/batches", DATABASE, 200, _batch),
        Call("GET", "/v1/batches", DATABASE, 200),
        Call("GET", "/v1/batches/{batch_id}", DATABASE, 404, path=lambda k: "/v1/batches/b-x"),
        Call("POST", "/v1/batches/{batch_id}/cancel", DATABASE, 404, path=_no_batch_cancel),
        Call("GET", "/v1/usage", DATABASE, 200),
        # Without a static API_KEY there is no admin: the admin routes are 404 before any work.
        Call("GET", "/admin/keys", NONE, 404),
        Call("POST", "/admin/keys", NONE, 404, _json({"name": "team"})),
        Call("PUT", "/admin/keys/{key_id}/limits", NONE, 404, _json({}), path=_admin_limits),
    ]


def _admin_limits(known: Known) -> str:
    return "/admin/keys/1/limits"


def check_covers(client: httpx.Client, calls: list[Call]) -> None:
    """Every route of the running api is called."""
    document = client.get("/openapi.json").json()
    served = {(m.upper(), path) for path, ops in document["paths"].items() for m in ops}
    served |= {("GET", path) for path in HIDDEN}
    assert served == {(call.method, call.route) for call in calls}


def check_answers(
    calls: list[Call], answers: list[httpx.Response], down: Dependency | None
) -> list[str]:
    """Each answer: 503 with `Retry-After` and the route's error body when the route needs what
    is `down`, else what it answers when all is up. Returns the mismatches."""
    wrong = []
    for call, answer in zip(calls, answers, strict=True):
        expected = 503 if down in call.needs else call.normal
        if answer.status_code != expected:
            wrong.append(f"{call}: {answer.status_code} (expected {expected}) {answer.text[:300]}")
        elif expected == 503 and (problem := _unavailable_problem(call, answer)):
            wrong.append(f"{call}: {problem}")
    return wrong


def _unavailable_problem(call: Call, answer: httpx.Response) -> str | None:
    if "retry-after" not in answer.headers:
        return "a 503 without Retry-After"
    body = answer.json()
    if call.route in ("/health", "/ping", "/") and call.method == "GET":
        return None if body["error_type"] == "healthcheck" else f"health body {body}"
    if call.route.startswith("/v1/"):
        is_right = body["error"]["code"] == "unavailable"
    else:
        is_right = body["error_type"] == "unavailable" and set(body) == {"error", "error_type"}
    return None if is_right else f"error body {body}"
