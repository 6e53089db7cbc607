"""Server-Sent Events as every streaming route writes them: `data: <json>\n\n` events (`\n`
line ends, as TGI's axum writes them) and a comment every 15 s so proxies keep the connection."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Response
from sse_starlette import EventSourceResponse, ServerSentEvent

KEEP_ALIVE_S = 15
EVENT_STREAM = "text/event-stream"
# The OpenAPI answer of a route that streams when the body asks for it (`stream: true`).
STREAM_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {
            EVENT_STREAM: {"schema": {"description": "each event's `data`: one JSON value"}}
        }
    }
}


def data_event(data: str) -> bytes:
    """One `data:` event, framed here (the hot path: one per token; `data` is one JSON line)."""
    return f"data: {data}\n\n".encode()


def sse_response(
    content: AsyncIterator[bytes | ServerSentEvent], headers: dict[str, str]
) -> Response:
    """`data: <json>\\n\\n` events, a comment every 15 s to keep proxies from closing."""
    return EventSourceResponse(
        content,
        headers={"X-Accel-Buffering": "no", **headers},
        sep="\n",
        ping=KEEP_ALIVE_S,
        ping_message_factory=lambda: ServerSentEvent(comment="", sep="\n"),
    )


def dump_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))
