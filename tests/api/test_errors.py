"""`dependency_failure`: the one place that tells a database or Redis that cannot serve from
any other error, whatever class the driver raised; real failures from a closed port and a
dropped connection, and the classes the drivers define."""

from __future__ import annotations

import asyncio
import socket

import asyncpg  # type: ignore[import-untyped]  # asyncpg ships no type information
import pytest
import redis
from sqlalchemy import exc as sa
from sqlalchemy import text
from sqlalchemy.pool import NullPool

from tests.api.stack import free_port
from tgq.api.db import create_engine
from tgq.api.errors import dependency_failure, unavailable


def closed_port() -> int:
    port = free_port()  # nothing listens on it now
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0
    return port


def test_a_stopped_postgres_is_the_database() -> None:
    async def connect() -> None:
        engine = create_engine(
            f"postgresql+asyncpg://root@127.0.0.1:{closed_port()}/x", poolclass=NullPool
        )
        try:
            async with engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
        finally:
            await engine.dispose()

    with pytest.raises(OSError) as raised:  # asyncpg's connect: not a SQLAlchemy error
        asyncio.run(connect())
    assert dependency_failure(raised.value) == "a dependency"
    error = unavailable(raised.value)
    assert error is not None and error.status_code == 503
    assert error.headers() == {"Retry-After": "1"}


def test_a_killed_redis_is_redis() -> None:
    client = redis.Redis(port=closed_port())
    with pytest.raises(redis.ConnectionError) as raised:
        client.ping()
    assert dependency_failure(raised.value) == "Redis"


@pytest.mark.parametrize(
    "error",
    [
        ConnectionRefusedError(111, "Connection refused"),
        ConnectionResetError(104, "Connection reset by peer"),
        TimeoutError("timed out"),
        asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed"),
        asyncpg.exceptions.CannotConnectNowError("the database system is starting up"),
        asyncpg.exceptions.TooManyConnectionsError("too many clients"),
        asyncpg.exceptions.PostgresConnectionError("connection failure"),
        asyncpg.exceptions.AdminShutdownError("terminating connection"),
        asyncpg.exceptions.InvalidCatalogNameError('database "x" does not exist'),
        asyncpg.exceptions.InterfaceError("connection is closed"),
        sa.OperationalError("SELECT 1", {}, Exception("server closed the connection")),
        sa.InterfaceError("SELECT 1", {}, Exception("connection is closed")),
        sa.DBAPIError("SELECT 1", {}, Exception("gone"), connection_invalidated=True),
        sa.TimeoutError("QueuePool limit reached"),
        redis.ConnectionError("Connection closed by server."),
        redis.TimeoutError("Timeout reading from socket"),
        redis.BusyLoadingError("Redis is loading the dataset in memory"),
        redis.exceptions.ReadOnlyError("You can't write against a read only replica."),
    ],
    ids=lambda error: type(error).__name__,
)
def test_every_connection_failure_is_unavailable(error: Exception) -> None:
    assert dependency_failure(error) is not None


def test_a_wrapped_failure_is_found_and_other_errors_are_not() -> None:
    try:
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except OSError as inner:
            raise RuntimeError("while submitting") from inner
    except RuntimeError as outer:
        assert dependency_failure(outer) == "a dependency"
    integrity = sa.IntegrityError("INSERT", {}, Exception("duplicate key"))
    for error in (ValueError("bad"), integrity, redis.ResponseError("WRONGTYPE"), KeyError("k")):
        assert dependency_failure(error) is None, error
