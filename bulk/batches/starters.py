"""Where the api process has a batch run, once a route or the reconciler asks (`BATCH_RUNNER`):
on a Celery worker (`tgq.run_batch`, sent by name), or on a task of the api process itself, as
embedded `tgq serve` does. The process's entry hands `starter_for` to `create_app`."""

from __future__ import annotations

import asyncio
import logging

from tgq.api.app import AppState, BatchStarter
from tgq.api.loops import cancel_and_wait
from tgq.api.settings import Settings
from tgq.bulk.batches.context import BatchContext
from tgq.bulk.batches.driver import run_batch

log = logging.getLogger(__name__)


def starter_for(state: AppState) -> BatchStarter:
    if state.settings.batches_on_celery:
        return CeleryStarter(state.settings)
    return InProcessStarter(state)


class CeleryStarter:
    """Sends `tgq.run_batch`. A batch whose task cannot be sent now (the broker is away) is
    started by the reconciler once its lease lapses."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    async def start(self, batch_id: str) -> None:
        from tgq.bulk.celery_app import send_run_batch  # Celery only where batches go to it

        try:
            await asyncio.to_thread(send_run_batch, self.settings, batch_id)
        except Exception as error:  # the broker is away: the reconciler starts it later
            log.warning("batch %s: its task could not be sent: %s", batch_id, error)

    async def stop(self) -> None:
        """Nothing runs here: the workers drive their batches."""


class InProcessStarter:
    """Each batch on a task of this process, once per batch at a time; the batches stopped with
    the process resume at its next start (or on the reconciler of another)."""

    def __init__(self, state: AppState) -> None:
        self.state = state
        self.tasks: dict[str, asyncio.Task[str]] = {}

    async def start(self, batch_id: str) -> None:
        if batch_id in self.tasks:
            return
        state, settings = self.state, self.state.settings
        context = BatchContext(
            state.db, state.transport, state.files, state.tokenizer, settings,
            window=settings.batch_window, lease_s=settings.batch_lease_s,
        )  # fmt: skip
        task = asyncio.create_task(run_batch(context, batch_id), name=f"batch {batch_id}")
        self.tasks[batch_id] = task
        task.add_done_callback(lambda done: self._done(batch_id, done))

    async def stop(self) -> None:
        await asyncio.gather(*(cancel_and_wait(task) for task in list(self.tasks.values())))

    def _done(self, batch_id: str, task: asyncio.Task[str]) -> None:
        self.tasks.pop(batch_id, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("batch %s failed: %r", batch_id, task.exception())
