"""Log lines of every tgq process (api, batcher, Celery, the `tgq` launcher): one handler on
stderr, human-readable by default, one JSON object per line with `--json-output` (as TGI's).

A line about a request carries the api's request id (`x-request-id`): given explicitly as
`extra={"request_id": ...}` (the batcher, which serves many requests on one thread), or taken from
`current_request_id`, which the api sets for the duration of each HTTP request.
"""

from __future__ import annotations

import json
import logging
import sys
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

HUMAN_FORMAT = "%(asctime)s %(name)s %(message)s"
current_request_id: ContextVar[str] = ContextVar("current_request_id", default="")

# What every LogRecord has; anything else on a record came from `extra=`. uvicorn's
# `color_message` is the message again, with terminal colours.
_RECORD_FIELDS = frozenset(
    {*vars(logging.makeLogRecord({})), "message", "asctime", "taskName", "color_message"}
)


def request_id_of(record: logging.LogRecord) -> str:
    return str(getattr(record, "request_id", "") or current_request_id.get())


class HumanFormatter(logging.Formatter):
    """`HUMAN_FORMAT`, then ` request_id=...` on lines about a request."""

    def __init__(self) -> None:
        super().__init__(HUMAN_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        request_id = request_id_of(record)
        if not request_id:
            return line
        head, newline, traceback = line.partition("\n")
        return f"{head} request_id={request_id}{newline}{traceback}"


class JsonFormatter(logging.Formatter):
    """`{"timestamp", "level", "target", "message", "request_id"?, <extra fields>...,
    "exception"?}`: ISO 8601 UTC timestamps, the logger's name as `target` (TGI's key)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "timestamp": _iso_utc(record.created),
            "level": record.levelname,
            "target": record.name,
            "message": record.getMessage(),
        }
        if request_id := request_id_of(record):
            line["request_id"] = request_id
        extra = {k: v for k, v in vars(record).items() if k not in _RECORD_FIELDS}
        line |= {k: v for k, v in extra.items() if k not in line and k != "request_id"}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        return json.dumps(line, default=str, ensure_ascii=False)


def _iso_utc(created: float) -> str:
    moment = datetime.fromtimestamp(created, UTC)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


def configure_logging(*, json_output: bool = False, level: int | str = logging.INFO) -> None:
    """The root logger writes to stderr through the chosen formatter; uvicorn's and Celery's
    loggers lose their own handlers and propagate to it, so every line has one format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_output else HumanFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(json_output)  # Python's warnings as lines too, not loose text
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "celery"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
