"""The edge middleware on a tiny app: the payload limit (by Content-Length and counted for
chunked bodies), API-key auth (static and stored keys, against real Postgres), CORS, and that
streamed responses pass through unbuffered."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.types import Message

from tgq.api.db import api_keys, models
from tgq.api.errors import install_error_handlers
from tgq.api.key_policy import KeyAccess, KeyLimits
from tgq.api.security import RecentKeys, VerifyKey, install_security
from tgq.api.settings import Settings

LIMIT = 100
ORIGIN = "https://ui.example"
TOO_LARGE = f"Payload too large: the limit is {LIMIT} bytes"
MISSING_KEY = "Missing API key: send `Authorization: Bearer <key>`"
INVALID_KEY = "Invalid API key"
# (method, path) of every route that needs a key, TGI-flavoured and OpenAI-flavoured.
PROTECTED = [
    ("POST", "/generate"),
    ("POST", "/v1/completions"),
    ("GET", "/v1/whoami"),
    ("GET", "/whoami"),
    ("GET", "/docs"),
    ("GET", "/openapi.json"),
    ("GET", "/health/"),  # public routes match exactly
]


def settings(**fields: Any) -> Settings:
    """`Settings(**fields)`, spelled so that mypy (which takes the `Field(default, ge=...)`
    fields for required ones) accepts it."""
    return Settings.model_validate(fields)


@dataclass
class Seen:
    """What the routes saw: one entry per call, and every body chunk that reached them."""

    calls: list[str] = field(default_factory=list)
    chunk_sizes: list[int] = field(default_factory=list)


def make_app(config: Settings, verify_key: VerifyKey | None = None) -> tuple[FastAPI, Seen]:
    app = FastAPI()
    install_error_handlers(app)
    install_security(app, config, verify_key)
    seen = Seen()

    async def echo(request: Request) -> dict[str, int]:
        seen.calls.append(request.url.path)
        async for chunk in request.stream():
            seen.chunk_sizes.append(len(chunk))
        return {"num_bytes": sum(seen.chunk_sizes)}

    async def whoami(request: Request) -> dict[str, int | None]:
        seen.calls.append(request.url.path)
        return {"api_key_id": request.state.api_key_id}

    async def health() -> str:
        return "ok"

    app.add_api_route("/generate", echo, methods=["POST"])
    app.add_api_route("/v1/completions", echo, methods=["POST"])
    app.add_api_route("/v1/whoami", whoami)
    app.add_api_route("/whoami", whoami)
    app.add_api_route("/health", health)
    return app, seen


async def call(app: FastAPI, method: str, path: str, **kwargs: Any) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://tgq") as client:
        return await client.request(method, path, **kwargs)


def request(app: FastAPI, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return asyncio.run(call(app, method, path, **kwargs))


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def error_message(response: httpx.Response) -> str:
    """The message of either error shape, checking the shape against the path's flavour."""
    body = response.json()
    if response.request.url.path.startswith("/v1/"):
        assert set(body["error"]) == {"message", "type", "param", "code"}
        return str(body["error"]["message"])
    assert set(body) == {"error", "error_type"}
    return str(body["error"])


class Chunks:
    """A chunked request body (no Content-Length) that counts the chunks the client sent."""

    def __init__(self, *sizes: int) -> None:
        self.sizes = sizes
        self.num_sent = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for size in self.sizes:
            self.num_sent += 1
            yield b"x" * size


# --- payload limit ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_content_length_over_the_limit_is_rejected_before_the_body_is_read(path: str) -> None:
    app, seen = make_app(settings(payload_limit=LIMIT))
    body = Chunks(LIMIT + 1)
    response = request(app, "POST", path, content=body, headers={"Content-Length": str(LIMIT + 1)})
    assert response.status_code == 413
    assert error_message(response) == TOO_LARGE
    assert body.num_sent == 0 and seen.calls == []


def test_content_length_at_the_limit_passes() -> None:
    app, seen = make_app(settings(payload_limit=LIMIT))
    response = request(app, "POST", "/generate", content=b"x" * LIMIT)
    assert response.status_code == 200 and response.json() == {"num_bytes": LIMIT}
    assert seen.calls == ["/generate"]


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_chunked_body_is_cut_as_soon_as_it_passes_the_limit(path: str) -> None:
    app, seen = make_app(settings(payload_limit=LIMIT))
    body = Chunks(30, 30, 30, 30, 30)
    response = request(app, "POST", path, content=body)
    assert response.request.headers["Transfer-Encoding"] == "chunked"
    assert response.status_code == 413
    assert error_message(response) == TOO_LARGE
    assert seen.chunk_sizes == [30, 30, 30]  # the chunk that crossed the limit never got in
    assert body.num_sent == 4


def test_chunked_body_within_the_limit_passes() -> None:
    app, _ = make_app(settings(payload_limit=LIMIT))
    response = request(app, "POST", "/generate", content=Chunks(50, 50))
    assert response.status_code == 200 and response.json() == {"num_bytes": LIMIT}


def test_body_over_the_limit_without_a_key_is_413() -> None:
    """The limit is checked before auth: no key lookup for a request that is too large."""
    app, seen = make_app(settings(payload_limit=LIMIT, api_key="k"))
    response = request(app, "POST", "/generate", content=b"x" * (LIMIT + 1))
    assert response.status_code == 413 and seen.calls == []


# --- auth ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path"), PROTECTED)
@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({}, MISSING_KEY),
        ({"Authorization": "Basic azpr"}, MISSING_KEY),
        ({"Authorization": "Bearer "}, MISSING_KEY),
        (bearer("wrong"), INVALID_KEY),
        (bearer("k2"), INVALID_KEY),
    ],
)
def test_protected_routes_need_a_valid_key(
    method: str, path: str, headers: dict[str, str], message: str
) -> None:
    app, seen = make_app(settings(api_key="k"))
    response = request(app, method, path, headers=headers)
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert error_message(response) == message
    if not path.startswith("/v1/"):
        assert response.json()["error_type"] == "unauthorized"
    else:
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert seen.calls == []


def test_public_route_needs_no_key() -> None:
    app, _ = make_app(settings(api_key="k"))
    assert request(app, "GET", "/health").status_code == 200


def test_docs_are_public_only_when_the_settings_say_so() -> None:
    app, _ = make_app(settings(api_key="k", public_routes=("/health", "/docs", "/openapi.json")))
    assert request(app, "GET", "/docs").status_code == 200
    assert request(app, "GET", "/openapi.json").status_code == 200


def test_static_key() -> None:
    app, _ = make_app(settings(api_key="k"))
    response = request(app, "GET", "/v1/whoami", headers={"Authorization": "bearer k"})
    assert response.status_code == 200 and response.json() == {"api_key_id": None}
    response = request(app, "POST", "/generate", headers=bearer("k"), content=b"abc")
    assert response.status_code == 200 and response.json() == {"num_bytes": 3}


def test_static_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[Any, Any]] = []

    def compare_digest(a: Any, b: Any) -> bool:
        compared.append((a, b))
        return hmac_compare_digest(a, b)

    hmac_compare_digest = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", compare_digest)
    app, _ = make_app(settings(api_key="k"))
    assert request(app, "GET", "/whoami", headers=bearer("wrong")).status_code == 401
    assert compared == [(b"wrong", b"k")]


def test_auth_off_leaves_every_route_open() -> None:
    app, _ = make_app(settings())
    response = request(app, "GET", "/v1/whoami")
    assert response.status_code == 200 and response.json() == {"api_key_id": None}


def test_preflight_passes_auth_without_cors() -> None:
    """Without CORS configured the preflight reaches the app (which has no OPTIONS route)."""
    app, _ = make_app(settings(api_key="k"))
    headers = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    assert request(app, "OPTIONS", "/generate", headers=headers).status_code == 405
    assert request(app, "OPTIONS", "/generate").status_code == 401


def test_stored_keys_need_verify_key() -> None:
    with pytest.raises(ValueError, match="require_api_keys"):
        install_security(FastAPI(), settings(require_api_keys=True))


def verifier(engine: AsyncEngine) -> VerifyKey:
    async def verify(key: str) -> KeyAccess | None:
        async with engine.begin() as conn:
            record = await api_keys.verify_api_key(conn, key=key)
        return None if record is None else KeyAccess(record.id, record.name, record.limits)

    return verify


def test_stored_keys(pg_engine: AsyncEngine) -> None:
    app, _ = make_app(settings(api_key="k", require_api_keys=True), verifier(pg_engine))

    async def body() -> None:
        async with pg_engine.begin() as conn:
            record, key = await api_keys.create_api_key(conn, name="ci")
        async with pg_engine.connect() as conn:
            stored = (await conn.execute(select(models.api_keys))).one()
        assert stored.key_hash != key and key not in [str(value) for value in stored]

        response = await call(app, "GET", "/v1/whoami", headers=bearer(key))
        assert response.status_code == 200 and response.json() == {"api_key_id": record.id}
        response = await call(app, "GET", "/v1/whoami", headers=bearer("k"))
        assert response.status_code == 200 and response.json() == {"api_key_id": None}
        response = await call(app, "GET", "/v1/whoami", headers=bearer(key + "x"))
        assert response.status_code == 401 and error_message(response) == INVALID_KEY

        async with pg_engine.begin() as conn:
            assert await api_keys.revoke_api_key(conn, key_id=record.id)
        response = await call(app, "POST", "/generate", headers=bearer(key))
        assert response.status_code == 401 and error_message(response) == INVALID_KEY

    asyncio.run(body())


# --- CORS ------------------------------------------------------------------------------------


def cors_app() -> FastAPI:
    return make_app(settings(api_key="k", payload_limit=LIMIT, cors_allow_origin=(ORIGIN,)))[0]


def preflight(origin: str) -> dict[str, str]:
    return {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, idempotency-key",
    }


def test_preflight_from_an_allowed_origin() -> None:
    response = request(cors_app(), "OPTIONS", "/v1/completions", headers=preflight(ORIGIN))
    assert response.status_code == 200
    assert response.headers["Access-Control-Allow-Origin"] == ORIGIN
    allowed = response.headers["Access-Control-Allow-Headers"].lower()
    assert {"authorization", "content-type", "idempotency-key", "last-event-id"} <= {
        name.strip() for name in allowed.split(",")
    }
    assert "POST" in response.headers["Access-Control-Allow-Methods"]


def test_preflight_from_another_origin() -> None:
    response = request(cors_app(), "OPTIONS", "/v1/completions", headers=preflight("https://x.y"))
    assert response.status_code == 400
    assert "Access-Control-Allow-Origin" not in response.headers


def test_rejections_carry_cors_headers() -> None:
    app = cors_app()
    unauthorized = request(app, "GET", "/v1/whoami", headers={"Origin": ORIGIN})
    too_large = request(app, "POST", "/generate", headers={"Origin": ORIGIN}, content=b"x" * 101)
    for response, status in [(unauthorized, 401), (too_large, 413)]:
        assert response.status_code == status
        assert response.headers["Access-Control-Allow-Origin"] == ORIGIN
        assert response.headers["Access-Control-Expose-Headers"] == "Retry-After"
    other = request(app, "GET", "/v1/whoami", headers={"Origin": "https://x.y"})
    assert other.status_code == 401 and "Access-Control-Allow-Origin" not in other.headers


# --- streaming -------------------------------------------------------------------------------


def test_streamed_response_is_not_buffered() -> None:
    """The route sends its second chunk only once the client has received the first: a
    middleware that buffered the body would never pass the first one on."""
    app, _ = make_app(settings(api_key="k", cors_allow_origin=(ORIGIN,)))
    first_received = asyncio.Event()

    async def tokens() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        await first_received.wait()
        yield b"data: 2\n\n"

    app.add_api_route("/stream", lambda: StreamingResponse(tokens()))
    bodies: list[bytes] = []

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            bodies.append(message["body"])
            first_received.set()

    asyncio.run(asyncio.wait_for(app(stream_scope(), never_disconnects(), send), timeout=5))
    assert bodies == [b"data: 1\n\n", b"data: 2\n\n"]


def stream_scope() -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/stream",
        "raw_path": b"/stream",
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"tgq"),
            (b"authorization", b"Bearer k"),
            (b"origin", ORIGIN.encode()),
        ],
        "server": ("tgq", 80),
        "client": ("127.0.0.1", 1234),
    }


def never_disconnects() -> Callable[[], Awaitable[Message]]:
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            await asyncio.Event().wait()
        sent = True
        return {"type": "http.request", "body": b"", "more_body": False}

    return receive


def test_recent_keys_look_a_key_up_once_per_ttl() -> None:
    calls: list[str] = []

    async def verify(key: str) -> KeyAccess | None:
        calls.append(key)
        return KeyAccess(7, "team", KeyLimits(rpm=5)) if key == "good" else None

    async def body() -> None:
        now = [0.0]
        recent = RecentKeys(verify, ttl_s=0.2, clock=lambda: now[0])
        first, second = await recent("good"), await recent("good")
        assert first is not None and second is not None and first is not second
        first.headers["x"] = "1"  # each request's headers are its own
        assert (second.key_id, second.limits.rpm, second.headers) == (7, 5, {})
        assert await recent("bad") is None and await recent("bad") is None
        assert calls == ["good", "bad", "bad"]  # a failed key is looked up every time
        now[0] = 0.19  # within the entry's time to live
        await recent("good")
        assert calls == ["good", "bad", "bad"]
        now[0] = 0.21  # past it
        await recent("good")
        assert calls == ["good", "bad", "bad", "good"]

    asyncio.run(body())
