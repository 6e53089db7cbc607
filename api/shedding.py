"""Load shedding at the edge: when this replica is at its concurrency cap, a generation request
gets its 429 before its body is read, parsed or routed.

The route would reject it too (`Admission.admit`), but only after FastAPI has read and validated
the body; under a burst those rejections queue behind each other on the event loop. The answer,
its headers and its counters are the route's own: the check here calls the same `admit`, and a
request that passes it is admitted (or rejected on the queue bounds) by the route as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from tgq.api.errors import OverloadedError, error_response, flavour_for_path

# The routes that take an admission ticket (TGI's and OpenAI's generation routes).
GENERATION_ROUTES = frozenset(
    {"/", "/generate", "/generate_stream", "/v1/chat/completions", "/v1/completions"}
)


class ShedOverload:
    def __init__(self, app: ASGIApp, state: Callable[[], Any]) -> None:
        self.app = app
        self.state = state  # the AppState once the lifespan has started, else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.state()
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in GENERATION_ROUTES
            and state is not None
            and state.generation.admission.is_at_capacity()
        ):
            try:
                state.generation.admit().release()  # counts and raises, as the route would
            except OverloadedError as error:
                response = error_response(error, flavour=flavour_for_path(scope["path"]))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
