"""Where uploaded files' bytes live, behind `FileStorage`; `LocalFileStorage` is a directory.

Keys are file ids made by the api (`file-<hex>`), never names or paths from a client. A write is
atomic: the bytes go to a temporary file that is renamed onto the key only once the whole stream
was written, so a key is either absent or complete, and a stream that raises leaves nothing.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path
from typing import BinaryIO, Protocol

READ_CHUNK_BYTES = 1 << 20
_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")


class FileStorage(Protocol):
    async def write(self, key: str, chunks: AsyncIterable[bytes]) -> int:
        """Store the stream under `key` (replacing any content); the number of bytes written.
        If the stream raises, nothing is stored and the error propagates."""
        ...

    def read(self, key: str) -> AsyncIterator[bytes]:
        """The content under `key`, chunk by chunk; `FileNotFoundError` when there is none."""
        ...

    async def delete(self, key: str) -> bool:
        """Remove the content under `key`; False when there was none."""
        ...

    async def exists(self, key: str) -> bool: ...


class LocalFileStorage:
    """One file per key in `root_dir`; temporary files are dot-files next to them."""

    def __init__(self, root_dir: Path | str) -> None:
        self.root_dir = Path(root_dir)

    def path_of(self, key: str) -> Path:
        if not _KEY.fullmatch(key):
            raise ValueError(f"not a storage key: {key!r}")
        return self.root_dir / key

    async def write(self, key: str, chunks: AsyncIterable[bytes]) -> int:
        path = self.path_of(key)
        await asyncio.to_thread(self.root_dir.mkdir, parents=True, exist_ok=True)
        temp = self.root_dir / f".{key}.{secrets.token_hex(4)}.tmp"
        out = await asyncio.to_thread(temp.open, "wb")
        num_bytes = 0
        try:
            async for chunk in chunks:
                await asyncio.to_thread(out.write, chunk)
                num_bytes += len(chunk)
            await asyncio.to_thread(_sync_close, out)
            await asyncio.to_thread(os.replace, temp, path)
        except BaseException:
            out.close()
            temp.unlink(missing_ok=True)
            raise
        return num_bytes

    async def read(self, key: str) -> AsyncIterator[bytes]:
        source = await asyncio.to_thread(self.path_of(key).open, "rb")
        try:
            while chunk := await asyncio.to_thread(source.read, READ_CHUNK_BYTES):
                yield chunk
        finally:
            source.close()

    async def delete(self, key: str) -> bool:
        path = self.path_of(key)
        try:
            await asyncio.to_thread(path.unlink)
        except FileNotFoundError:
            return False
        return True

    async def exists(self, key: str) -> bool:
        return await asyncio.to_thread(self.path_of(key).is_file)


def _sync_close(out: BinaryIO) -> None:
    out.flush()
    os.fsync(out.fileno())
    out.close()
