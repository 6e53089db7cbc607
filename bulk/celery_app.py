"""The Celery app of tgq's bulk work: `celery -A tgq.bulk.celery_app worker` and `... beat`.

Redis is the broker (`REDIS_URL`, keys under `REDIS_PREFIX:celery:`), JSON is the only
serializer a worker accepts, tasks are acknowledged late (after they ran) and handed back when
their worker dies, one task at a time per worker process. Tasks take ids and plain data; their
bodies are functions tested on their own (`bulk.tasks`). Beat runs the reconciler every
`RECONCILE_INTERVAL_S` and retention every `RETENTION_INTERVAL_S`. With `JSON_OUTPUT`, their
log lines are tgq's JSON lines (`batcher.logs`) instead of Celery's own format.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

from celery import Celery, signals

from tgq.api.settings import Settings
from tgq.batcher.logs import configure_logging

DEFAULT_BROKER = "redis://127.0.0.1:6379/0"


def make_app(settings: Settings | None = None) -> Celery:
    settings = settings or Settings()
    broker = settings.redis_url or DEFAULT_BROKER
    app = Celery("tgq", broker=broker, backend=broker, include=["tgq.bulk.tasks"])
    keyprefix = f"{settings.redis_prefix}:celery:"
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_transport_options={"global_keyprefix": keyprefix},
        result_backend_transport_options={"global_keyprefix": keyprefix},
        result_expires=3600,
        timezone="UTC",
        broker_connection_retry_on_startup=True,
    )
    schedule = {"retention": {"task": "tgq.retention", "schedule": settings.retention_interval_s}}
    if settings.reconcile_interval_s > 0:
        schedule["reconcile"] = {"task": "tgq.reconcile", "schedule": settings.reconcile_interval_s}
    app.conf.beat_schedule = schedule
    if settings.json_output:  # a receiver of `setup_logging` replaces Celery's logging set-up
        signals.setup_logging.connect(_json_logging, weak=False, dispatch_uid="tgq-json")
    return app


def _json_logging(loglevel: int | str | None = None, **_: Any) -> None:
    configure_logging(json_output=True, level=loglevel or logging.INFO)


@cache
def _sender(settings: Settings) -> Celery:
    return make_app(settings)


def send_run_batch(settings: Settings, batch_id: str) -> None:
    """Queues `tgq.run_batch` for the batch (the api sends it; it imports no task code). Nothing
    reads a task's result (the batch's progress is in the database), so the send does not
    subscribe to it: with the result backend's Redis down, that subscription alone retried for
    ~19 s before the send could fail."""
    _sender(settings).send_task("tgq.run_batch", args=[batch_id], ignore_result=True)


app = make_app()
