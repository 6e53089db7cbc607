"""Files (OpenAI's Files API): the local storage, the batch input checks, the records on Postgres
and SQLite, the 0002 migration, and the routes through real HTTP with the unmodified `openai`
SDK; every rejection message exactly, and nothing stored after one (no row, no bytes)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import func, inspect, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.pool import NullPool

from tests.api.stack import Stack, create_database, drop_database
from tgq.api.db import api_keys, create_engine, models
from tgq.api.db import files as db_files
from tgq.api.db.migrate import current_revision, downgrade, head_revision, main, upgrade
from tgq.api.errors import ApiError, PayloadTooLargeError, ValidationError
from tgq.api.files.batch_input import EMPTY_FILE_MESSAGE, BatchInputChecker
from tgq.api.files.storage import LocalFileStorage
from tgq.api.settings import Settings

pytestmark = pytest.mark.timeout(300)
SMALL_MAX_BYTES = 1000
SMALL_MAX_LINES = 3


def request_line(custom_id: str, url: str = "/v1/chat/completions", **overrides: Any) -> str:
    line = {"custom_id": custom_id, "method": "POST", "url": url, "body": {"max_tokens": 4}}
    return json.dumps({**line, **overrides})


def batch_file(*custom_ids: str) -> bytes:
    return "".join(request_line(c) + "\n" for c in custom_ids).encode()


# --- storage -----------------------------------------------------------------------------------


async def _chunks(*parts: bytes, fail: bool = False) -> AsyncIterator[bytes]:
    for part in parts:
        yield part
    if fail:
        raise ValidationError("stop")


async def _read(storage: LocalFileStorage, key: str) -> bytes:
    return b"".join([chunk async for chunk in storage.read(key)])


def test_local_storage_round_trip(tmp_path: Path) -> None:
    storage = LocalFileStorage(tmp_path / "files")

    async def body() -> None:
        assert await storage.write("file-1", _chunks(b"ab", b"", b"cd")) == 4
        assert await storage.exists("file-1")
        assert await _read(storage, "file-1") == b"abcd"
        assert await storage.write("file-1", _chunks(b"new")) == 3
        assert await _read(storage, "file-1") == b"new"
        assert await storage.delete("file-1")
        assert not await storage.exists("file-1")
        assert not await storage.delete("file-1")
        with pytest.raises(FileNotFoundError):
            await _read(storage, "file-1")

    asyncio.run(body())
    assert list((tmp_path / "files").iterdir()) == []


def test_a_failed_write_leaves_nothing(tmp_path: Path) -> None:
    storage = LocalFileStorage(tmp_path)

    async def body() -> None:
        await storage.write("file-kept", _chunks(b"old"))
        with pytest.raises(ValidationError):
            await storage.write("file-kept", _chunks(b"partial", fail=True))
        with pytest.raises(ValidationError):
            await storage.write("file-new", _chunks(b"partial", fail=True))
        assert await _read(storage, "file-kept") == b"old"

    asyncio.run(body())
    assert [p.name for p in tmp_path.iterdir()] == ["file-kept"]  # no temporary files either


@pytest.mark.parametrize("key", ["", "../x", "a/b", ".hidden", "x" * 200])
def test_storage_keys_are_never_paths(tmp_path: Path, key: str) -> None:
    with pytest.raises(ValueError, match="not a storage key"):
        LocalFileStorage(tmp_path).path_of(key)


# --- the batch input checks --------------------------------------------------------------------

VALID_LINE = request_line("a")
NO_ID_TYPE = json.dumps({"custom_id": 7, "method": "POST", "url": "/v1/completions", "body": {}})
NO_BODY = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions"})
REJECTIONS = [
    (f'{VALID_LINE}\n{request_line("b")}\n{{"custom_id": "c",\n', 422, "Line 3: not valid JSON: "),
    (
        f"{VALID_LINE}\n{request_line('b', url='/v1/embeddings')}\n",
        422,
        "Line 2: url must be one of /v1/chat/completions, /v1/completions; got '/v1/embeddings'",
    ),
    (
        batch_file("a", "b", "c", "d").decode() + VALID_LINE,
        422,
        "Line 5: duplicate custom_id 'a' (first on line 1)",
    ),
    ("[1, 2]\n", 422, "Line 1: a request must be a JSON object, got list"),
    ('{"method": "POST", "url": "/v1/completions", "body": {}}', 422, "Line 1: missing field 'custom_id'"),  # noqa: E501
    (NO_ID_TYPE, 422, "Line 1: custom_id must be a string"),
    (request_line(""), 422, "Line 1: custom_id must not be empty"),
    (request_line("a", method="GET"), 422, "Line 1: method must be POST; got 'GET'"),
    (request_line("a", body=[1]), 422, "Line 1: body must be an object"),
    (NO_BODY, 422, "Line 1: missing field 'body'"),
    (f"{VALID_LINE}\n\n{request_line('b')}\n", 422, "Line 2: empty line"),
    ("", 422, EMPTY_FILE_MESSAGE),
    ("\n", 422, "Line 1: empty line"),
]  # fmt: skip


def check(content: bytes, chunk_size: int, **limits: int) -> BatchInputChecker:
    checker = BatchInputChecker(
        max_bytes=limits.get("max_bytes", 10**6), max_lines=limits.get("max_lines", 100)
    )
    for start in range(0, len(content), chunk_size):
        checker.feed(content[start : start + chunk_size])
    checker.finish()
    return checker


@pytest.mark.parametrize("chunk_size", [1, 7, 10**6])
def test_checker_counts_lines_across_chunks(chunk_size: int) -> None:
    content = batch_file("a", "b") + request_line("c", url="/v1/completions").encode()  # no \n
    checker = check(content, chunk_size)
    assert (checker.num_lines, checker.num_bytes) == (3, len(content))


@pytest.mark.parametrize(("content", "status", "message"), REJECTIONS)
@pytest.mark.parametrize("chunk_size", [1, 10**6])
def test_checker_rejections(content: str, status: int, message: str, chunk_size: int) -> None:
    with pytest.raises(ApiError) as raised:
        check(content.encode(), chunk_size)
    assert raised.value.status_code == status
    assert raised.value.message.startswith(message) and raised.value.param == "file"


def test_checker_limits() -> None:
    with pytest.raises(ValidationError, match=r"^File has more than 2 lines$"):
        check(batch_file("a", "b", "c"), 5, max_lines=2)
    assert check(batch_file("a", "b"), 5, max_lines=2).num_lines == 2
    content = batch_file("a")
    with pytest.raises(PayloadTooLargeError, match=rf"^File is larger than {len(content) - 1}"):
        check(content, 5, max_bytes=len(content) - 1)
    assert check(content, 5, max_bytes=len(content)).num_bytes == len(content)


# --- records -----------------------------------------------------------------------------------


def run_in(engine: AsyncEngine, body: Any) -> Any:
    async def in_transaction() -> Any:
        async with engine.begin() as conn:
            return await body(conn)

    return asyncio.run(in_transaction())


async def _new(conn: AsyncConnection, file_id: str, **overrides: Any) -> db_files.FileRecord:
    fields: dict[str, Any] = {
        "file_id": file_id,
        "purpose": "batch",
        "filename": "in.jsonl",
        "num_bytes": 10,
        "num_lines": 1,
        "storage_key": file_id,
    }
    return await db_files.create_file(conn, **{**fields, **overrides})


async def _scenario(conn: AsyncConnection) -> None:
    """Create, get, list (both orders, pages, purpose), scope by key, delete: on any database."""
    key, _ = await api_keys.create_api_key(conn, name="k")
    first = await _new(conn, "file-a")
    assert (first.bytes, first.status, first.api_key_id) == (10, "processed", None)
    assert first.deleted_at is None
    for file_id in ("file-b", "file-c"):
        await _new(conn, file_id)
    await _new(conn, "file-k", api_key_id=key.id)
    await _new(conn, "file-x", purpose="other")
    # b and c share a timestamp, as do k and x: ids break the ties (no file skipped or repeated).
    for file_ids, seconds in ((["file-b", "file-c"], 1), (["file-k", "file-x"], 2)):
        later = first.created_at + timedelta(seconds=seconds)
        where = models.files.c.id.in_(file_ids)
        await conn.execute(update(models.files).where(where).values(created_at=later))

    async def ids(**kw: Any) -> list[str]:
        return [f.id for f in await db_files.list_files(conn, **kw)]

    assert await ids(limit=10) == ["file-x", "file-k", "file-c", "file-b", "file-a"]
    assert await ids(limit=10, order="asc") == ["file-a", "file-b", "file-c", "file-k", "file-x"]
    assert await ids(limit=2, after="file-c") == ["file-b", "file-a"]
    assert await ids(limit=2, after="file-b", order="asc") == ["file-c", "file-k"]
    assert await ids(limit=10, purpose="batch", api_key_id=key.id) == ["file-k"]
    assert await ids(limit=10, after="file-unknown") == []
    assert await db_files.get_file(conn, file_id="file-a", api_key_id=key.id) is None
    assert (await db_files.get_file(conn, file_id="file-k", api_key_id=key.id)) is not None
    assert await db_files.delete_file(conn, file_id="file-a", api_key_id=key.id) is None
    deleted = await db_files.delete_file(conn, file_id="file-a")
    assert deleted is not None and deleted.deleted_at is not None
    assert await db_files.get_file(conn, file_id="file-a") is None
    assert await db_files.delete_file(conn, file_id="file-a") is None
    assert "file-a" not in await ids(limit=10)


def test_file_records_on_postgres(pg_engine: AsyncEngine) -> None:
    run_in(pg_engine, _scenario)


def test_file_records_on_sqlite(sqlite_engine: AsyncEngine) -> None:
    run_in(sqlite_engine, _scenario)


# --- the migration -----------------------------------------------------------------------------


async def _schema(url: str) -> tuple[set[str], set[str]]:
    """The tables, and the index names of `job_items` and `files`."""
    engine = create_engine(url, poolclass=NullPool)

    def read(connection: Any) -> tuple[set[str], set[str]]:
        inspector = inspect(connection)
        tables = set(inspector.get_table_names())
        indexes = {
            i["name"]
            for t in ("job_items", "files")
            if t in tables
            for i in inspector.get_indexes(t)
        }
        return tables, {name for name in indexes if name}

    async with engine.connect() as conn:
        schema = await conn.run_sync(read)
    await engine.dispose()
    return schema


def _check_0002(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    main(["--url", url, "--revision", "0001"])
    assert "files" not in asyncio.run(_schema(url))[0]
    main(["--url", url, "--revision", "0002"])
    assert capsys.readouterr().out.endswith("revision 0001 -> 0002\n")
    assert current_revision(url) == "0002"
    tables, indexes = asyncio.run(_schema(url))
    assert "files" in tables
    assert {"ix_files_api_key_id_created_at", "ix_job_items_status_created_at"} <= indexes
    downgrade(url, "0001")
    assert current_revision(url) == "0001"
    tables, indexes = asyncio.run(_schema(url))
    assert "files" not in tables and "ix_job_items_status_created_at" not in indexes
    upgrade(url)
    assert current_revision(url) == head_revision()


def test_migration_0002_on_postgres(empty_pg_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    _check_0002(empty_pg_url, capsys)


def test_migration_0002_on_sqlite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _check_0002(f"sqlite+aiosqlite:///{tmp_path / 'tgq.db'}", capsys)


# --- HTTP --------------------------------------------------------------------------------------


def _start_api(
    model_dir: Path, url: str, log_dir: Path, name: str, storage: Path, **env: str
) -> Stack:
    """An api on Redis without a batcher: files need none (so `/health` answers 503)."""
    api = Stack(
        model_dir, url, log_dir, name=name, api_env={"FILE_STORAGE_DIR": str(storage), **env}
    )
    api.start_api(healthy=False)
    return api


@pytest.fixture(scope="module")
def apis(
    text_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stack, Stack]]:
    """Two apis on one database: default limits, and small ones (`SMALL_MAX_*`)."""
    url = create_database()
    upgrade(url)
    log_dir, storage = tmp_path_factory.mktemp("logs"), tmp_path_factory.mktemp("files")
    started: list[Stack] = []
    try:
        started.append(_start_api(text_model_dir, url, log_dir, "api", storage / "default"))
        small = {"MAX_FILE_BYTES": str(SMALL_MAX_BYTES), "MAX_FILE_LINES": str(SMALL_MAX_LINES)}
        started.append(
            _start_api(text_model_dir, url, log_dir, "api-small", storage / "small", **small)
        )
        yield started[0], started[1]
    finally:
        for api in started:
            api.stop()
        drop_database(url)


@pytest.fixture(scope="module")
def api(apis: tuple[Stack, Stack]) -> Stack:
    return apis[0]


@pytest.fixture(scope="module")
def sdk(api: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{api.url}/v1", api_key="x", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def client(api: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api.url, timeout=60) as http:
        yield http


def storage_of(api: Stack) -> Path:
    return Path(api.api_env["FILE_STORAGE_DIR"])


def stored(api: Stack) -> tuple[int, list[str]]:
    """The number of file rows, and the names in the api's storage directory."""

    async def count() -> int:
        engine = create_engine(api.database_url, poolclass=NullPool)
        async with engine.connect() as conn:
            rows = (await conn.execute(select(func.count()).select_from(models.files))).scalar()
        await engine.dispose()
        return int(rows or 0)

    directory = storage_of(api)
    names = sorted(p.name for p in directory.iterdir()) if directory.exists() else []
    return asyncio.run(count()), names


def openai_error(message: str, param: str | None, code: str | None = None) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    }


def test_upload_retrieve_content_delete_with_the_sdk(sdk: openai.OpenAI, api: Stack) -> None:
    content = batch_file("a", "b", "c")
    created = sdk.files.create(file=("in.jsonl", content), purpose="batch")
    assert created.id.startswith("file-") and created.object == "file"
    assert (created.bytes, created.filename, created.purpose, created.status) == (
        len(content),
        "in.jsonl",
        "batch",
        "processed",
    )
    assert created.expires_at is None and created.created_at > 0
    assert sdk.files.retrieve(created.id) == created
    assert sdk.files.content(created.id).content == content
    assert created.id in [f.id for f in sdk.files.list()]
    assert (storage_of(api) / created.id).read_bytes() == content
    deleted = sdk.files.delete(created.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (created.id, "file", True)
    assert not (storage_of(api) / created.id).exists()
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        sdk.files.delete(created.id)


def test_a_large_file_streams_through(sdk: openai.OpenAI) -> None:
    lines = [
        request_line(f"id-{i}", messages=[{"role": "user", "content": "x" * 900}])
        for i in range(3000)
    ]
    # ~2.8 MB: many chunks, lines split across them, and over the 2 MB `payload_limit` that
    # bounds every other body (uploads have their own bound)
    content = ("\n".join(lines) + "\n").encode()
    assert len(content) > Settings.model_validate({}).payload_limit
    created = sdk.files.create(file=("big.jsonl", content), purpose="batch")
    assert created.bytes == len(content)
    assert sdk.files.content(created.id).content == content
    sdk.files.delete(created.id)


def test_list_pages_and_filters(sdk: openai.OpenAI) -> None:
    ids = [
        sdk.files.create(file=(f"{i}.jsonl", batch_file(str(i))), purpose="batch").id
        for i in range(3)
    ]
    try:
        page = sdk.files.list(limit=2, order="asc")
        assert [f.id for f in page.data] == ids[:2] and page.has_more
        raw = sdk.files.with_raw_response.list(limit=2, order="asc").http_response.json()
        assert (raw["object"], raw["first_id"], raw["last_id"]) == ("list", ids[0], ids[1])
        assert [f.id for f in sdk.files.list(limit=2, order="asc")] == ids  # the SDK pages on
        assert [f.id for f in sdk.files.list(limit=1)][:3] == ids[::-1]  # newest first
        assert [f.id for f in sdk.files.list(purpose="batch")] == ids[::-1]
        assert sdk.files.list(purpose="fine-tune").data == []
    finally:
        for file_id in ids:
            sdk.files.delete(file_id)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/files/file-nope"),
        ("GET", "/v1/files/file-nope/content"),
        ("DELETE", "/v1/files/file-nope"),
    ],
)
def test_unknown_ids_are_404(client: httpx.Client, method: str, path: str) -> None:
    response = client.request(method, path)
    assert response.status_code == 404
    assert response.json() == openai_error("No file with id 'file-nope'", "file_id", "not_found")


def upload(client: httpx.Client, content: bytes, **form: str) -> httpx.Response:
    return client.post(
        "/v1/files", data=form or {"purpose": "batch"}, files={"file": ("f.jsonl", content)}
    )


@pytest.mark.parametrize(("content", "status", "message"), REJECTIONS)
def test_rejections_store_nothing(
    client: httpx.Client, api: Stack, content: str, status: int, message: str
) -> None:
    before = stored(api)
    response = upload(client, content.encode())
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"].startswith(message), error
    if not message.endswith(": "):  # the JSON parser's own words follow "not valid JSON: "
        assert response.json() == openai_error(message, "file")
    assert stored(api) == before


def test_purpose_and_form_rejections(client: httpx.Client, api: Stack) -> None:
    before = stored(api)
    refused = upload(client, batch_file("a"), purpose="fine-tune")
    assert refused.status_code == 422
    assert refused.json() == openai_error(
        "purpose must be 'batch' (the only purpose tgq accepts for now); got 'fine-tune'", "purpose"
    )
    no_purpose = client.post("/v1/files", files={"file": ("f.jsonl", batch_file("a"))})
    assert no_purpose.json() == openai_error("Missing form field `purpose`", "purpose")
    no_file = client.post("/v1/files", files={"purpose": (None, "batch")})
    assert no_file.json() == openai_error("Missing form field `file`", "file")
    not_a_form = client.post("/v1/files", json={"purpose": "batch"})
    assert not_a_form.status_code == 422
    assert not_a_form.json() == openai_error(
        "Expected a multipart/form-data body with `file` and `purpose`", None
    )
    assert stored(api) == before


def test_size_and_line_limits(apis: tuple[Stack, Stack]) -> None:
    small = apis[1]
    with httpx.Client(base_url=small.url, timeout=60) as client:
        before = stored(small)
        too_long = batch_file(*(f"id-{i}" for i in range(SMALL_MAX_LINES + 1)))
        assert len(too_long) < SMALL_MAX_BYTES
        response = upload(client, too_long)
        assert response.status_code == 422
        assert response.json() == openai_error(
            f"File has more than {SMALL_MAX_LINES} lines", "file"
        )
        big = request_line("a", body={"prompt": "x" * SMALL_MAX_BYTES}).encode()
        response = upload(client, big)
        assert response.status_code == 413
        assert response.json() == openai_error(
            f"File is larger than {SMALL_MAX_BYTES} bytes", "file", "payload_too_large"
        )
        assert stored(small) == before
        fits = upload(client, batch_file(*(f"id-{i}" for i in range(SMALL_MAX_LINES))))
        assert fits.status_code == 200, fits.text
        assert client.delete(f"/v1/files/{fits.json()['id']}").json()["deleted"] is True
