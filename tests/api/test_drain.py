"""The drain's middleware: once draining, every new request gets 503 in its route's error shape,
with `Retry-After` and `Connection: close`, without reaching the app. (The whole shut-down, with
streams in flight, is tested on a real api process in tests/reliability/test_request_faults.py.)
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient

from tgq.api.drain import Drain, DrainMiddleware


def app_with(drain: Drain) -> tuple[FastAPI, list[str]]:
    app = FastAPI()
    reached: list[str] = []

    @app.post("/generate")
    @app.post("/v1/chat/completions")
    async def route() -> dict[str, str]:
        reached.append("route")
        return {"ok": "yes"}

    app.add_middleware(DrainMiddleware, drain=drain)
    return app, reached


def test_requests_pass_until_the_drain_starts() -> None:
    drain = Drain()
    app, reached = app_with(drain)
    with TestClient(app) as client:
        assert client.post("/generate").status_code == 200
        drain.draining = True
        tgi = client.post("/generate")
        openai = client.post("/v1/chat/completions")
    assert reached == ["route"]
    for response in (tgi, openai):
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        assert response.headers["connection"] == "close"
    message = "the server is shutting down; retry on another replica"
    assert tgi.json() == {"error": message, "error_type": "unavailable"}
    assert openai.json()["error"]["message"] == message
