"""`python -m api`: the HTTP api under uvicorn, configured by environment variables (see
`api.settings.Settings`; `HOSTNAME` and `PORT` as TGI's launcher)."""

from __future__ import annotations

import logging

import uvicorn

from api.app import create_app
from api.settings import Settings


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = Settings()
    uvicorn.run(
        create_app(settings),
        host=settings.hostname,
        port=settings.port,
        log_level="info",
        timeout_graceful_shutdown=30,
    )


if __name__ == "__main__":
    main()
