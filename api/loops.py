"""The api's background loops (recorder, persister, running marker, monitor) and the one way
to end a task of the api: `cancel_and_wait`."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)

RECANCEL_S = 0.5  # how often `cancel_and_wait` repeats a cancellation the task has not taken


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancels `task` and waits until it has ended; an exception it ended with is logged.

    A cancellation can get lost inside a library: the api's monitor loop once went back to
    sleeping after a Redis pipeline swallowed its CancelledError, and the shut-down waited for
    it forever. So the cancellation is repeated every `RECANCEL_S` until the task is done.
    """
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RECANCEL_S)
    if not task.cancelled() and (error := task.exception()) is not None:
        log.error("task %s ended with %r", task.get_name(), error)


class BackgroundLoop:
    """A background loop of the api: `start` runs `_run` on a task, `stop` cancels it."""

    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=type(self).__name__.lower())

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)

    async def _run(self) -> None:
        raise NotImplementedError
