"""`python -m tgq.api`: the HTTP api under uvicorn, configured by environment variables (see
`api.settings.Settings`; `HOSTNAME` and `PORT` as TGI's launcher). As a process's entry it may
assemble from any layer: the batches' starter comes from `bulk/`, above the api."""

from __future__ import annotations

import sys

import uvicorn
from sse_starlette.sse import AppStatus

from tgq.api.app import create_app
from tgq.api.drain import GRACEFUL_CLOSE_S, DrainingServer
from tgq.api.settings import Settings
from tgq.batcher.logs import configure_logging
from tgq.batcher.tracing import TracingUnavailableError
from tgq.bulk.batches.starters import starter_for


def main() -> None:
    settings = Settings()
    configure_logging(json_output=settings.json_output)
    try:
        app = create_app(settings, batch_starter=starter_for)
    except TracingUnavailableError as error:
        sys.exit(f"api: {error}")
    # On SIGTERM sse_starlette would end every open stream at once; in-flight streams are to
    # finish during the drain instead (api/drain.py).
    AppStatus.enable_automatic_graceful_drain = False
    config = uvicorn.Config(
        app,
        host=settings.hostname,
        port=settings.port,
        log_level="info",
        log_config=None,  # uvicorn's loggers go through `configure_logging`'s handler
        timeout_graceful_shutdown=GRACEFUL_CLOSE_S,
    )

    def in_flight() -> int:
        state = getattr(app.state, "tgq", None)
        return 0 if state is None else state.generation.admission.num_in_flight

    DrainingServer(config, app.state.drain, in_flight, settings.drain_timeout_s).run()


if __name__ == "__main__":
    main()
