"""`tgq keys create|list|revoke` against real Postgres, and the keys it makes against a running api
with `REQUIRE_API_KEYS=true`: a created key is let in, a revoked one gets 401, and the secret is
printed once and found neither in `list` nor in the database."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.pool import NullPool

from tests.api.stack import Stack, migrated_database, write_text_model
from tests.polling import eventually
from tgq.api.db import create_engine, models
from tgq.cli.main import main


@pytest.fixture
def database_url() -> Iterator[str]:
    with migrated_database() as url:
        yield url


def keys(capsys: pytest.CaptureFixture[str], url: str, *argv: str) -> tuple[int, str]:
    code = main(["keys", "--database-url", url, *argv])
    out, err = capsys.readouterr()
    return code, out + err


async def _stored_rows(url: str) -> list[str]:
    engine = create_engine(url, poolclass=NullPool)
    async with engine.connect() as conn:
        rows = (await conn.execute(select(models.api_keys))).all()
    await engine.dispose()
    return [repr(tuple(row)) for row in rows]


def test_keys_create_list_revoke(capsys: pytest.CaptureFixture[str], database_url: str) -> None:
    code, out = keys(capsys, database_url, "create", "ci")
    assert code == 0
    assert out.splitlines()[0] == "created key 1 (ci); it is shown this once:"
    secret = out.splitlines()[1]
    assert secret.startswith("tgq_")
    code, listed = keys(capsys, database_url, "list")
    assert code == 0
    assert "ci" in listed and secret not in listed and secret[8:] not in listed
    assert all(secret[8:] not in row for row in asyncio.run(_stored_rows(database_url)))
    assert keys(capsys, database_url, "revoke", "ci") == (0, "revoked key 1\n")
    assert keys(capsys, database_url, "revoke", "1") == (
        2,
        "tgq: error: no unrevoked key with id or name '1'\n",
    )
    code, listed = keys(capsys, database_url, "list")
    assert listed.splitlines()[1].split()[:3] == ["1", "ci", secret[:8]]
    # created and revoked dates, never used, no limits
    assert listed.splitlines()[1].split()[-2:] == ["-", "-"]


def test_keys_limits(capsys: pytest.CaptureFixture[str], database_url: str) -> None:
    code, _ = keys(capsys, database_url, "create", "team", "--rpm", "60", "--priority", "bulk")
    assert code == 0
    _, listed = keys(capsys, database_url, "list")
    assert listed.splitlines()[1].endswith(" rpm=60 priority=bulk")
    code, out = keys(capsys, database_url, "limits", "team", "--rpm", "none", "--tpm", "1000")
    assert (code, out) == (0, "key 1 (team): tpm=1000 priority=bulk\n")
    code, out = keys(capsys, database_url, "limits", "team", "--adapters", "sql, chat")
    assert (code, out) == (0, "key 1 (team): tpm=1000 priority=bulk adapters=sql,chat\n")
    with pytest.raises(SystemExit):
        keys(capsys, database_url, "limits", "1", "--max-concurrent", "0")
    message = "argument --max-concurrent: a positive integer or `none`, not '0'"
    assert message in capsys.readouterr().err
    code, out = keys(capsys, database_url, "limits", "nobody", "--rpm", "1")
    assert (code, out) == (2, "tgq: error: no unrevoked key with id or name 'nobody'\n")


def test_a_created_key_is_let_in_and_a_revoked_one_is_not(
    capsys: pytest.CaptureFixture[str], database_url: str, tmp_path: Path
) -> None:
    _, out = keys(capsys, database_url, "create", "client")
    secret = out.splitlines()[1]
    model = write_text_model(tmp_path / "model")
    (tmp_path / "logs").mkdir()
    stack = Stack(model, database_url, tmp_path / "logs", api_env={"REQUIRE_API_KEYS": "true"})
    try:
        stack.start_batcher()
        stack.start_api()
        bearer = {"Authorization": f"Bearer {secret}"}
        request = {"inputs": "Hello", "parameters": {"max_new_tokens": 1}}
        generate = f"{stack.url}/generate"
        assert httpx.post(generate, json=request, headers=bearer, timeout=60).status_code == 200
        assert httpx.post(generate, json=request).status_code == 401
        assert keys(capsys, database_url, "revoke", "client")[0] == 0
        # The api trusts a key it checked for KEY_CACHE_S (1 s): refused within it.
        refused = eventually(
            lambda: _refused(httpx.post(generate, json=request, headers=bearer)),
            10,
            "the revoked key refused",
        )
        assert refused is not None and refused.json()["error"] == "Invalid API key"
    finally:
        stack.stop()


def _refused(answer: httpx.Response) -> httpx.Response | None:
    return answer if answer.status_code == 401 else None
