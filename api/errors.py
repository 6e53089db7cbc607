"""Errors that routes raise, and the one place that renders them.

Every error has two renderings, picked by the route's flavour:

- **tgi** (TGI's own routes): `{"error": "<message>", "error_type": "<type>"}`, TGI's status
  codes and message prefixes (`Input validation error: ...`).
- **openai** (everything under `/v1/`, jobs included): OpenAI's error object
  `{"error": {"message", "type", "param", "code"}}`. Validation errors keep status 422, as TGI's
  OpenAI routes do (OpenAI itself answers 400); `type` is OpenAI's `invalid_request_error`, so
  OpenAI clients still raise their usual exception class (`UnprocessableEntityError`).

Errors after a stream has started cannot change the HTTP status any more; `stream_error_event`
renders them as one SSE event in the same two shapes (OpenAI routes then send `data: [DONE]`).
Malformed bodies (not JSON, wrong types, missing fields) come from FastAPI as
`RequestValidationError` and are rendered as a `ValidationError` naming the field; the errors
Starlette raises itself (unknown path, wrong method, a body its parser gave up on) keep their
status and get the same two shapes (`HttpError`).

A database or Redis that cannot be reached is a 503 with `Retry-After` on every route, never a
500, whatever class the driver raises: `dependency_failure` is the one place that decides (an
`OSError` from asyncpg's connect, asyncpg's and SQLAlchemy's connection errors, redis-py's).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any, Literal

import asyncpg  # type: ignore[import-untyped]  # asyncpg ships no type information
import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy import exc as sa
from starlette.exceptions import HTTPException as StarletteHTTPException

from tgq.api.schemas.openai import OpenAIError, OpenAIErrorBody
from tgq.api.schemas.tgi import ErrorResponse

Flavour = Literal["tgi", "openai"]
RETRY_AFTER_S = 1  # a 503's `Retry-After` where the settings' `retry_after_s` is not at hand
log = logging.getLogger(__name__)


class ApiError(Exception):
    """Base: an unexpected server-side failure (500) unless a subclass says otherwise."""

    status_code: int = 500
    error_type: str = "internal"  # TGI `error_type`
    openai_type: str = "server_error"
    openai_code: str | None = None
    tgi_prefix: str = ""  # TGI prepends the error kind to the message
    openai_prefix: str = ""

    def __init__(
        self, message: str, *, param: str | None = None, retry_after_s: int | None = None
    ) -> None:
        super().__init__(message)
        self.message = message  # without any prefix
        self.param = param  # the offending request field, OpenAI's `param`
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(self.retry_after_s)}


class ValidationError(ApiError):
    """The request is well-formed but not acceptable (TGI's `ValidationError`)."""

    status_code = 422
    error_type = "validation"
    openai_type = "invalid_request_error"
    tgi_prefix = "Input validation error: "


def require(condition: bool, message: str, param: str | None = None) -> None:
    """A ValidationError with `message`, naming `param`, unless `condition` holds."""
    if not condition:
        raise ValidationError(message, param=param)


class RouteValidationError(ApiError):
    """A 422 that TGI renders with its own `error_type` and no prefix, e.g. `/v1/completions`
    with `suffix` (`"suffix not supported"`) or too many prompts (`"batch size exceeded"`)."""

    status_code = 422
    openai_type = "invalid_request_error"

    def __init__(self, message: str, *, error_type: str, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.error_type = error_type


class TemplateError(ApiError):
    """The chat template failed to render (or the model has none)."""

    status_code = 422
    error_type = "template_error"
    openai_type = "invalid_request_error"
    openai_code = "template_error"
    tgi_prefix = openai_prefix = "Template error: "


class GenerationError(ApiError):
    """The engine failed while generating (e.g. out of memory); the input may well be fine."""

    status_code = 424
    error_type = "generation"
    openai_code = "generation"
    tgi_prefix = openai_prefix = "Request failed during generation: "


class OverloadedError(ApiError):
    """Over the concurrency or queue bounds; decided before any tokenization."""

    status_code = 429
    error_type = "overloaded"
    openai_type = "rate_limit_error"
    openai_code = "overloaded"

    def __init__(self, message: str = "Model is overloaded", *, retry_after_s: int) -> None:
        super().__init__(message, retry_after_s=retry_after_s)


class RateLimitedError(ApiError):
    """Over one of the API key's own limits (`api/key_policy.py`): 429 with `Retry-After`,
    `retry-after-ms` (read by the OpenAI SDKs) and the key's `x-ratelimit-*` headers."""

    status_code = 429
    error_type = "rate_limited"
    openai_type = "rate_limit_error"
    openai_code = "rate_limit_exceeded"

    def __init__(
        self,
        message: str,
        *,
        limit: str,
        retry_after_s: int,
        retry_ms: int,
        headers: dict[str, str],
    ) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.limit = limit  # which one: requests, tokens, concurrent, queued_jobs
        self.retry_ms = retry_ms
        self.extra_headers = headers

    def headers(self) -> dict[str, str]:
        return {**super().headers(), "retry-after-ms": str(self.retry_ms), **self.extra_headers}


class ForbiddenError(ApiError):
    """The key is valid but may not do this (a model it is not allowed)."""

    status_code = 403
    error_type = "forbidden"
    openai_type = "invalid_request_error"
    openai_code = "model_not_allowed"


class NotFoundError(ApiError):
    status_code = 404
    error_type = "not_found"
    openai_type = "invalid_request_error"
    openai_code = "not_found"


class UnavailableError(ApiError):
    """A dependency is down (database, Redis, batcher); worth retrying later (`Retry-After`)."""

    status_code = 503
    error_type = "unavailable"
    openai_code = "unavailable"

    def __init__(self, message: str, *, retry_after_s: int = RETRY_AFTER_S) -> None:
        super().__init__(message, retry_after_s=retry_after_s)


class PayloadTooLargeError(ApiError):
    status_code = 413
    error_type = "payload_too_large"
    openai_type = "invalid_request_error"
    openai_code = "payload_too_large"


class UnauthorizedError(ApiError):
    status_code = 401
    error_type = "unauthorized"
    openai_type = "invalid_request_error"
    openai_code = "invalid_api_key"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class HttpError(ApiError):
    """An error that Starlette or FastAPI raised themselves: 404 for an unknown path, 405, or
    400 for a body that could not be parsed at all (JSON nested too deep for the parser)."""

    openai_type = "invalid_request_error"

    def __init__(self, exc: StarletteHTTPException) -> None:
        super().__init__(str(exc.detail))
        self.status_code = exc.status_code
        self.error_type = HTTPStatus(exc.status_code).phrase.lower().replace(" ", "_")
        self._headers = dict(exc.headers or {})

    def headers(self) -> dict[str, str]:
        return self._headers


def flavour_for_path(path: str) -> Flavour:
    """`/v1/...` routes speak OpenAI (chat, completions, models, jobs, files, batches)."""
    return "openai" if path.startswith("/v1/") else "tgi"


def error_body(error: ApiError, *, flavour: Flavour) -> dict[str, Any]:
    if flavour == "tgi":
        tgi = ErrorResponse(error=error.tgi_prefix + error.message, error_type=error.error_type)
        return tgi.model_dump()
    openai = OpenAIError(
        message=error.openai_prefix + error.message,
        type=error.openai_type,
        param=error.param,
        code=error.openai_code,
    )
    return OpenAIErrorBody(error=openai).model_dump()


def error_response(error: ApiError, *, flavour: Flavour) -> JSONResponse:
    body = error_body(error, flavour=flavour)
    return JSONResponse(body, status_code=error.status_code, headers=error.headers())


def stream_error_event(error: ApiError, *, flavour: Flavour) -> str:
    """One SSE event (`data: <json>\\n\\n`) for an error after the stream has started."""
    return f"data: {json.dumps(error_body(error, flavour=flavour))}\n\n"


def from_request_validation(exc: RequestValidationError) -> ValidationError:
    """FastAPI's parse errors as one `ValidationError` naming every offending field; the
    alternatives of a union field (`stop`: a string or a list) are reported together."""
    reasons: dict[str | None, list[str]] = {}
    for error in exc.errors():
        reasons.setdefault(_param(error), []).append(_reason(error))
    message = "; ".join(_describe(param, msgs) for param, msgs in reasons.items())
    return ValidationError(message or "invalid request body", param=next(iter(reasons), None))


# SQLSTATE classes and codes of a server that cannot serve now: 08 connection exception, 53
# insufficient resources (too many connections), 57 operator intervention (shutting down,
# starting up), 3D000 the database does not exist (dropped, or not created yet).
_UNAVAILABLE_SQLSTATES = ("08", "53", "57", "3D000")
DATA_EXCEPTION_CLASS = "22"  # SQLSTATE class of values the database cannot take
# redis-py's errors that say the server is away or not ready (a restart loading its data, a
# replica that cannot take writes during a failover); other Redis errors are bugs (500).
_REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ReadOnlyError)
# The classes a driver's connection failure can surface as: the handlers see these, and
# `dependency_failure` decides whether it is one.
DEPENDENCY_ERRORS: tuple[type[Exception], ...] = (
    OSError, asyncpg.PostgresError, asyncpg.InterfaceError, sa.SQLAlchemyError, redis.RedisError
)  # fmt: skip


def dependency_failure(error: BaseException) -> str | None:
    """What is unreachable ("the database", "Redis"), when `error` (or an error it wraps) says
    the database or Redis cannot be reached or cannot serve now; None for anything else."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if (what := _unreachable(cause)) is not None:
            return what
        wrapped = cause.orig if isinstance(cause, sa.DBAPIError) else None
        cause = wrapped or cause.__cause__ or cause.__context__
    return None


def _unreachable(error: BaseException) -> str | None:
    if isinstance(error, _REDIS_DOWN):
        return "Redis"
    if _is_database_down(error):
        return "the database"
    if isinstance(error, OSError):  # refused, reset, unreachable, timed out: a socket's errors
        return "a dependency"
    return None


def _is_database_down(error: BaseException) -> bool:
    if isinstance(error, sa.DBAPIError) and error.connection_invalidated:
        return True
    # SQLAlchemy's TimeoutError: no pooled connection came free in time.
    if isinstance(error, sa.OperationalError | sa.InterfaceError | sa.TimeoutError):
        return True
    if isinstance(error, asyncpg.PostgresConnectionError | asyncpg.InterfaceError):
        return True
    sqlstate = getattr(error, "sqlstate", None)
    return isinstance(sqlstate, str) and sqlstate.startswith(_UNAVAILABLE_SQLSTATES)


def unavailable(error: BaseException) -> UnavailableError | None:
    """The 503 for a dependency failure, None when `error` is not one."""
    what = dependency_failure(error)
    if what is None:
        return None
    return UnavailableError(f"{what[0].upper()}{what[1:]} is unavailable; retry later")


def install_error_handlers(app: FastAPI) -> None:
    app.exception_handler(ApiError)(_on_api_error)
    app.exception_handler(RequestValidationError)(_on_request_validation_error)
    app.exception_handler(StarletteHTTPException)(_on_http_exception)
    for error_class in DEPENDENCY_ERRORS:
        app.exception_handler(error_class)(_on_dependency_error)


async def _on_dependency_error(request: Request, exc: Exception) -> JSONResponse:
    """503 (worth retrying) for a database or Redis that cannot be reached; 422 for a value
    Postgres refuses (SQLSTATE class 22, e.g. a NUL character in a text: it came from the
    client, and retrying will not help); anything else is a bug and stays a 500."""
    flavour = flavour_for_path(request.url.path)
    sqlstate = getattr(getattr(exc, "orig", None), "sqlstate", None)
    if isinstance(sqlstate, str) and sqlstate.startswith(DATA_EXCEPTION_CLASS):
        message = f"The request has a value the database cannot store (SQLSTATE {sqlstate})"
        return error_response(ValidationError(message), flavour=flavour)
    error = unavailable(exc)
    if error is None:
        raise exc
    log.error("%s %s: %s: %r", request.method, request.url.path, error.message, exc)
    tgq = getattr(request.app.state, "tgq", None)
    if tgq is not None:
        error.retry_after_s = tgq.settings.retry_after_s
    return error_response(error, flavour=flavour)


async def _on_api_error(request: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc, flavour=flavour_for_path(request.url.path))


async def _on_request_validation_error(
    request: Request, exc: RequestValidationError
) -> JSONResponse:
    error = from_request_validation(exc)
    return error_response(error, flavour=flavour_for_path(request.url.path))


async def _on_http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(HttpError(exc), flavour=flavour_for_path(request.url.path))


def _describe(param: str | None, reasons: list[str]) -> str:
    where = f"`{param}`: " if param else ""
    return where + " or ".join(dict.fromkeys(reasons))


def _reason(error: dict[str, Any]) -> str:
    if error["type"] == "json_invalid":
        reason = error.get("ctx", {}).get("error", error["msg"])
        return f"Failed to parse the request body as JSON: {reason}"
    if _param(error) is None:
        return f"request body: {error['msg']}"
    return str(error["msg"])


# Tags pydantic puts in `loc` for the members of a union (`stop.str`, `stop.list[str]`).
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})
# Where FastAPI found the field; the name alone is the parameter.
_LOCATIONS = frozenset({"body", "query", "path", "header", "cookie"})


def _param(error: dict[str, Any]) -> str | None:
    """The field's path, `("body", "messages", 0, "role")` -> `messages[0].role`."""
    if error["type"] == "json_invalid":
        return None
    loc: Sequence[str | int] = error["loc"]
    path = ""
    for part in loc[1:] if loc and loc[0] in _LOCATIONS else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif "[" not in part and part not in _UNION_TAGS:
            path += f".{part}" if path else part
    return path or None
