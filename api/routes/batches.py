"""OpenAI's Batches API: `POST /v1/batches`, `GET /v1/batches/{id}`, `GET /v1/batches`,
`POST /v1/batches/{id}/cancel`. Each batch is driven by `bulk.batches.driver`, started through
the app's `BatchStarter`: on a Celery worker, or on a task of the api process (resumed when the
api starts again)."""

from __future__ import annotations

import re
import secrets
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict

from tgq.api.app import AppState, state_of
from tgq.api.db import api_keys, store
from tgq.api.db import batches as db_batches
from tgq.api.db import files as db_files
from tgq.api.errors import NotFoundError, ValidationError
from tgq.api.files.batch_input import BATCH_URLS
from tgq.api.key_policy import KeyAccess

router = APIRouter(tags=["Batches"])
# OpenAI accepts "24h" only; tgq takes any `<n>s|m|h` (a short window is how expiry is tested).
WINDOW = re.compile(r"^(\d+)([smh])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: dict[str, Any] | None = None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, Any] | None = None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


def _unix(moment: datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp())


def view(batch: db_batches.BatchRecord) -> BatchObject:
    errors = None
    if batch.error is not None:
        errors = {"object": "list", "data": [{"code": "failed", "message": batch.error}]}
    return BatchObject(
        id=batch.id,
        endpoint=batch.endpoint,
        errors=errors,
        input_file_id=batch.input_file_id,
        completion_window=batch.completion_window,
        status=batch.status,
        output_file_id=batch.output_file_id,
        error_file_id=batch.error_file_id,
        created_at=int(batch.created_at.timestamp()),
        in_progress_at=_unix(batch.in_progress_at),
        expires_at=_unix(batch.expires_at),
        finalizing_at=_unix(batch.finalizing_at),
        completed_at=_unix(batch.completed_at),
        failed_at=_unix(batch.failed_at),
        expired_at=_unix(batch.expired_at),
        cancelling_at=_unix(batch.cancelling_at),
        cancelled_at=_unix(batch.cancelled_at),
        request_counts=RequestCounts(
            total=batch.num_total, completed=batch.num_completed, failed=batch.num_failed
        ),
        metadata=batch.metadata,
    )


def window_s(window: str) -> int:
    match = WINDOW.match(window)
    if match is None:
        raise ValidationError(
            f"completion_window must be like '24h', '30m' or '90s'; got {window!r}",
            param="completion_window",
        )
    return int(match.group(1)) * _UNIT_S[match.group(2)]


@router.post("/v1/batches", response_model=BatchObject)
async def create_batch(body: BatchRequest, request: Request) -> BatchObject:
    """Create a batch over an uploaded file (purpose `batch`); it starts at once."""
    state = state_of(request)
    if body.endpoint not in BATCH_URLS:
        urls = ", ".join(BATCH_URLS)
        raise ValidationError(
            f"endpoint must be one of {urls}; got {body.endpoint!r}", param="endpoint"
        )
    expires_at = datetime.now(UTC) + timedelta(seconds=window_s(body.completion_window))
    key: KeyAccess | None = request.state.key
    key_id = request.state.api_key_id
    async with state.db.begin() as conn:
        await api_keys.check_room_for_work(conn, key=key)
        file = await db_files.get_file(conn, file_id=body.input_file_id, api_key_id=key_id)
        if file is None or file.purpose != "batch":
            raise NotFoundError(
                f"No batch input file {body.input_file_id!r}", param="input_file_id"
            )
        batch = await db_batches.create_batch(
            conn,
            batch_id=f"batch_{secrets.token_hex(16)}",
            endpoint=body.endpoint,
            input_file_id=body.input_file_id,
            completion_window=body.completion_window,
            expires_at=expires_at,
            metadata=body.metadata,
            api_key_id=key_id,
            dispatch_grace_s=2 * state.settings.batch_lease_s,
        )
    await state.start_batch(batch.id)
    return view(batch)


async def _visible(state: AppState, batch_id: str, request: Request) -> db_batches.BatchRecord:
    async with state.db.connect() as conn:
        batch = await db_batches.get_batch(
            conn, batch_id=batch_id, api_key_id=request.state.api_key_id
        )
    if batch is None:
        raise NotFoundError(f"No batch with id {batch_id!r}", param="batch_id")
    return batch


@router.get("/v1/batches/{batch_id}", response_model=BatchObject)
async def get_batch(batch_id: str, request: Request) -> BatchObject:
    return view(await _visible(state_of(request), batch_id, request))


@router.get("/v1/batches", response_model=BatchList)
async def list_batches(
    request: Request,
    limit: int = Query(20, ge=1, le=100),
    after: str | None = Query(None, description="The last batch id of the previous page."),
) -> BatchList:
    state = state_of(request)
    async with state.db.connect() as conn:
        found = await db_batches.list_batches(
            conn, limit=limit + 1, after=after, api_key_id=request.state.api_key_id
        )
    page = [view(batch) for batch in found[:limit]]
    return BatchList(
        data=page,
        first_id=page[0].id if page else None,
        last_id=page[-1].id if page else None,
        has_more=len(found) > limit,
    )


@router.post("/v1/batches/{batch_id}/cancel", response_model=BatchObject)
async def cancel_batch(batch_id: str, request: Request) -> BatchObject:
    """Cancelling: unfinished lines are cancelled with the batch's status, in one transaction
    (no result is recorded for them after this answers), then aborted in the batchers; the
    runner writes the files of what finished, then `cancelled`."""
    state = state_of(request)
    await _visible(state, batch_id, request)
    request_ids: list[str] = []
    async with state.db.begin() as conn:
        cancelling = await db_batches.set_status(
            conn, batch_id=batch_id, status="cancelling", only_from=("validating", "in_progress")
        )
        batch = await db_batches.get_batch(conn, batch_id=batch_id)  # its row is locked now
        if cancelling and batch is not None and batch.job_id is not None:
            request_ids = await store.cancel_job(conn, job_id=batch.job_id) or []
    # Only the first `batch_window` open items can have reached the transport.
    for request_id in request_ids[: state.settings.batch_window]:
        await state.transport.abort(request_id, "batch cancelled")
    return view(await _visible(state, batch_id, request))
