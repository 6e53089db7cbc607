"""Files, as OpenAI's Files API: `POST /v1/files` (multipart `file` and `purpose`), `GET
/v1/files`, `GET /v1/files/{id}`, `GET /v1/files/{id}/content`, `DELETE /v1/files/{id}`.

An upload is read as it arrives, never held whole: the `file` part's bytes are checked line by
line and written to the file storage in one pass; the first bad line (or the byte or line limit)
aborts the write, so a rejected upload leaves neither bytes nor a row. Only `purpose=batch` is
accepted for now: a JSONL of OpenAI batch request lines (`api.files.batch_input`), whose `body`
the batch driver checks later; the body is parsed by `api.files.multipart`. The row is written
once the bytes are stored; a file is visible to its api key only.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from tgq.api.app import AppState, state_of
from tgq.api.db import files as db_files
from tgq.api.errors import NotFoundError, ValidationError
from tgq.api.files.batch_input import BatchInputChecker
from tgq.api.files.multipart import MultipartUpload

router = APIRouter(tags=["Files"])
MAX_PAGE = 10_000  # OpenAI's bound (and default) for `GET /v1/files`
PURPOSES_MESSAGE = "purpose must be 'batch' (the only purpose tgq accepts for now); got {!r}"
_UPLOAD_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": ["batch"]},
                    },
                }
            }
        },
    }
}


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | None = None
    filename: str
    purpose: str
    status: str


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def view(record: db_files.FileRecord) -> FileObject:
    return FileObject(
        id=record.id,
        bytes=record.bytes,
        created_at=int(record.created_at.timestamp()),
        filename=record.filename,
        purpose=record.purpose,
        status=record.status,
    )


def _check_purpose(upload: MultipartUpload, *, is_complete: bool) -> None:
    purpose = upload.fields.get("purpose")
    if purpose is None and is_complete:
        raise ValidationError("Missing form field `purpose`", param="purpose")
    if purpose is not None and purpose != "batch":
        raise ValidationError(PURPOSES_MESSAGE.format(purpose), param="purpose")


async def _checked(
    upload: MultipartUpload, checker: BatchInputChecker, body: AsyncIterator[bytes]
) -> AsyncIterator[bytes]:
    """The file's bytes, each chunk checked before it is handed on; raises (so that nothing
    is stored) at the first problem, or at the end when the upload is incomplete."""
    async for chunk in upload.file_chunks(body):
        _check_purpose(upload, is_complete=False)  # fields come first from most clients
        checker.feed(chunk)
        yield chunk
    _check_purpose(upload, is_complete=True)
    if upload.filename is None:
        raise ValidationError("Missing form field `file`", param="file")
    checker.finish()


@router.post("/v1/files", response_model=FileObject, openapi_extra=_UPLOAD_BODY)
async def upload_file(request: Request) -> FileObject:
    """Upload a batch input file (multipart: `file`, `purpose=batch`), checked line by line."""
    state = state_of(request)
    upload = MultipartUpload(request.headers.get("content-type", ""))
    checker = BatchInputChecker(
        max_bytes=state.settings.max_file_bytes, max_lines=state.settings.max_file_lines
    )
    file_id = new_file_id()
    await state.files.write(file_id, _checked(upload, checker, request.stream()))
    try:
        async with state.db.begin() as conn:
            record = await db_files.create_file(
                conn,
                file_id=file_id,
                purpose="batch",
                filename=upload.filename or "file",
                num_bytes=checker.num_bytes,
                num_lines=checker.num_lines,
                storage_key=file_id,
                api_key_id=request.state.api_key_id,
            )
    except BaseException:
        await state.files.delete(file_id)
        raise
    return view(record)


async def get_visible_file(state: AppState, file_id: str, request: Request) -> db_files.FileRecord:
    async with state.db.connect() as conn:
        record = await db_files.get_file(conn, file_id=file_id, api_key_id=request.state.api_key_id)
    if record is None:
        raise NotFoundError(f"No file with id {file_id!r}", param="file_id")
    return record


@router.get("/v1/files", response_model=FileList)
async def list_files(
    request: Request,
    limit: int = Query(MAX_PAGE, ge=1, le=MAX_PAGE),
    order: Literal["asc", "desc"] = "desc",
    after: str | None = Query(None, description="The last file id of the previous page."),
    purpose: str | None = None,
) -> FileList:
    """Files by creation time (`order`, newest first by default), `limit` per page."""
    state = state_of(request)
    async with state.db.connect() as conn:
        records = await db_files.list_files(
            conn,
            limit=limit + 1,
            order=order,
            after=after,
            purpose=purpose,
            api_key_id=request.state.api_key_id,
        )
    page = [view(record) for record in records[:limit]]
    return FileList(
        data=page,
        first_id=page[0].id if page else None,
        last_id=page[-1].id if page else None,
        has_more=len(records) > limit,
    )


@router.get("/v1/files/{file_id}", response_model=FileObject)
async def get_file(file_id: str, request: Request) -> FileObject:
    return view(await get_visible_file(state_of(request), file_id, request))


@router.get("/v1/files/{file_id}/content", response_class=StreamingResponse)
async def get_file_content(file_id: str, request: Request) -> StreamingResponse:
    """The file's bytes as they were uploaded, streamed from the storage."""
    state = state_of(request)
    record = await get_visible_file(state, file_id, request)
    chunks = state.files.read(record.storage_key)
    try:
        first = await anext(chunks, b"")
    except FileNotFoundError:
        raise NotFoundError(
            f"The content of file {file_id!r} is missing", param="file_id"
        ) from None
    return StreamingResponse(_prepend(first, chunks), media_type="application/jsonl")


async def _prepend(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for chunk in rest:
        yield chunk


@router.delete("/v1/files/{file_id}", response_model=FileDeleted)
async def delete_file(file_id: str, request: Request) -> FileDeleted:
    """Delete a file: its record is marked deleted first, then its bytes are removed."""
    state = state_of(request)
    async with state.db.begin() as conn:
        record = await db_files.delete_file(
            conn, file_id=file_id, api_key_id=request.state.api_key_id
        )
    if record is None:
        raise NotFoundError(f"No file with id {file_id!r}", param="file_id")
    await state.files.delete(record.storage_key)
    return FileDeleted(id=record.id, deleted=True)
