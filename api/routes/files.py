"""Files, as OpenAI's Files API: `POST /v1/files` (multipart `file` and `purpose`), `GET
/v1/files`, `GET /v1/files/{id}`, `GET /v1/files/{id}/content`, `DELETE /v1/files/{id}`.

An upload is read as it arrives, never held whole: the `file` part's bytes are checked line by
line and written to the file storage in one pass; the first bad line (or the byte or line limit)
aborts the write, so a rejected upload leaves neither bytes nor a row. Only `purpose=batch` is
accepted for now: a JSONL of OpenAI batch request lines, whose `body` the batch runner checks
later. The row is written once the bytes are stored; a file is visible to its api key only.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from pathlib import PurePosixPath
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from tgq.api.app import AppState, state_of
from tgq.api.db import files as db_files
from tgq.api.errors import NotFoundError, PayloadTooLargeError, ValidationError

router = APIRouter(tags=["Files"])
MAX_PAGE = 10_000  # OpenAI's bound (and default) for `GET /v1/files`
MAX_FIELD_BYTES = 1024  # a form field other than the file (`purpose`)
BATCH_URLS = ("/v1/chat/completions", "/v1/completions")
PURPOSES_MESSAGE = "purpose must be 'batch' (the only purpose tgq accepts for now); got {!r}"
EMPTY_FILE_MESSAGE = "File is empty: a batch input file needs at least one request line"
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


class BatchInputChecker:
    """Checks a batch input file as its bytes arrive: every line one request
    `{"custom_id": str, "method": "POST", "url": <a BATCH_URL>, "body": {...}}`, custom ids
    unique, at most `max_lines` lines and `max_bytes` bytes. Lines are numbered from 1; a
    final newline ends the last line, it does not start another."""

    def __init__(self, *, max_bytes: int, max_lines: int) -> None:
        self.max_bytes = max_bytes
        self.max_lines = max_lines
        self.num_bytes = 0
        self.num_lines = 0
        self._partial = bytearray()  # the line being received
        self._first_lines: dict[str, int] = {}  # custom_id -> the line it is on

    def feed(self, chunk: bytes) -> None:
        self.num_bytes += len(chunk)
        if self.num_bytes > self.max_bytes:
            raise PayloadTooLargeError(f"File is larger than {self.max_bytes} bytes", param="file")
        start = 0
        while (end := chunk.find(b"\n", start)) != -1:
            self._partial += chunk[start:end]
            self._line(bytes(self._partial))
            self._partial.clear()
            start = end + 1
        self._partial += chunk[start:]

    def finish(self) -> None:
        if self._partial:
            self._line(bytes(self._partial))
        if self.num_lines == 0:
            raise ValidationError(EMPTY_FILE_MESSAGE, param="file")

    def _line(self, line: bytes) -> None:
        self.num_lines += 1
        if self.num_lines > self.max_lines:
            raise ValidationError(f"File has more than {self.max_lines} lines", param="file")
        custom_id = _check_request(line, self.num_lines)
        first = self._first_lines.setdefault(custom_id, self.num_lines)
        if first != self.num_lines:
            raise _line_error(
                self.num_lines, f"duplicate custom_id {custom_id!r} (first on line {first})"
            )


def _check_request(line: bytes, number: int) -> str:
    """The custom_id of a valid request line; else a `ValidationError` naming the line."""
    if not line.strip():
        raise _line_error(number, "empty line")
    try:
        request = json.loads(line)
    except ValueError as error:
        raise _line_error(number, f"not valid JSON: {error}") from None
    if not isinstance(request, dict):
        raise _line_error(number, f"a request must be a JSON object, got {type(request).__name__}")
    for name, kind, description in _FIELDS:
        if name not in request:
            raise _line_error(number, f"missing field {name!r}")
        if not isinstance(request[name], kind):
            raise _line_error(number, f"{name} must be {description}")
    if not request["custom_id"]:
        raise _line_error(number, "custom_id must not be empty")
    if request["method"] != "POST":
        raise _line_error(number, f"method must be POST; got {request['method']!r}")
    if request["url"] not in BATCH_URLS:
        urls = ", ".join(BATCH_URLS)
        raise _line_error(number, f"url must be one of {urls}; got {request['url']!r}")
    custom_id: str = request["custom_id"]
    return custom_id


_FIELDS = (
    ("custom_id", str, "a string"),
    ("method", str, "a string"),
    ("url", str, "a string"),
    ("body", dict, "an object"),
)


def _line_error(number: int, reason: str) -> ValidationError:
    return ValidationError(f"Line {number}: {reason}", param="file")


class MultipartUpload:
    """A `multipart/form-data` body parsed as it arrives: small fields are kept in `fields`;
    the bytes of the one part named `file` are handed on by `file_chunks`."""

    def __init__(self, content_type: str) -> None:
        kind, options = parse_options_header(content_type)
        if kind != b"multipart/form-data" or b"boundary" not in options:
            raise ValidationError("Expected a multipart/form-data body with `file` and `purpose`")
        self.fields: dict[str, str] = {}
        self.filename: str | None = None  # of the `file` part, once it has started
        self._headers: dict[bytes, bytes] = {}
        self._header = (bytearray(), bytearray())
        self._name = ""  # of the current part
        self._is_file = False  # the current part is the `file`
        self._value = bytearray()  # of the current field
        self._file_bytes: list[bytes] = []  # of the file, parsed but not handed on yet
        self._parser = MultipartParser(
            options[b"boundary"],
            {
                "on_part_begin": self._headers.clear,
                "on_header_field": lambda data, start, end: self._header[0].extend(data[start:end]),
                "on_header_value": lambda data, start, end: self._header[1].extend(data[start:end]),
                "on_header_end": self._on_header_end,
                "on_headers_finished": self._on_headers_finished,
                "on_part_data": self._on_part_data,
                "on_part_end": self._on_part_end,
            },
        )

    async def file_chunks(self, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            async for chunk in body:
                self._parser.write(chunk)
                for data in self._file_bytes:
                    yield data
                self._file_bytes.clear()
            self._parser.finalize()
        except MultipartParseError as error:
            raise ValidationError(f"Malformed multipart body: {error}") from None

    def _on_header_end(self) -> None:
        name, value = self._header
        self._headers[bytes(name).lower()] = bytes(value)
        name.clear()
        value.clear()

    def _on_headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition"))
        self._name = options.get(b"name", b"").decode("utf-8", "replace")
        self._is_file = self._name == "file"
        if self._is_file:
            if self.filename is not None:
                raise ValidationError("Send one `file` per upload", param="file")
            raw = options.get(b"filename", b"").decode("utf-8", "replace")
            self.filename = PurePosixPath(raw.replace("\\", "/")).name or "file"
        self._value.clear()

    def _on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._is_file:
            self._file_bytes.append(data[start:end])
            return
        self._value += data[start:end]
        if len(self._value) > MAX_FIELD_BYTES:
            raise ValidationError(f"Form field {self._name!r} is too long", param=self._name)

    def _on_part_end(self) -> None:
        if not self._is_file:
            self.fields[self._name] = self._value.decode("utf-8", "replace")


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
        async with state.engine.begin() as conn:
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
    async with state.engine.connect() as conn:
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
    async with state.engine.connect() as conn:
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
    async with state.engine.begin() as conn:
        record = await db_files.delete_file(
            conn, file_id=file_id, api_key_id=request.state.api_key_id
        )
    if record is None:
        raise NotFoundError(f"No file with id {file_id!r}", param="file_id")
    await state.files.delete(record.storage_key)
    return FileDeleted(id=record.id, deleted=True)
