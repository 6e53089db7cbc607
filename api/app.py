"""The FastAPI application: `create_app(settings, batch_starter=...)`.

Start-up (lifespan): the database must be at the migrations' head (else the app refuses to start,
naming the command to run); the transport is Redis when `REDIS_URL` is set, else the in-process
one with a batcher on a thread of this process; then the recorder, the persister, the running
marker and the monitor (queue depth, live batchers) start. Shut-down stops them in reverse.

OpenAI batches run where `BATCH_RUNNER` says, started by a `BatchStarter` from `bulk/` (which sits
above the api, so the process's entry hands it in: `create_app(settings, batch_starter=...)`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fastapi import FastAPI, Request
from sqlalchemy.ext.asyncio import AsyncEngine

from tgq.api.admission import Admission, Limits
from tgq.api.db import api_keys, create_engine, warm_up
from tgq.api.db.migrate import check_schema, upgrade
from tgq.api.drain import Drain, DrainMiddleware
from tgq.api.errors import UnavailableError, dependency_failure, install_error_handlers
from tgq.api.files.storage import FileStorage, LocalFileStorage
from tgq.api.generation import Generation
from tgq.api.health import DatabaseProbe, Health
from tgq.api.key_limiter_redis import RedisKeyLimiter
from tgq.api.key_policy import KeyAccess, KeyLimiter, MemoryKeyLimiter, renew_leases
from tgq.api.loops import cancel_and_wait
from tgq.api.metrics import Metrics
from tgq.api.observability import install_observability
from tgq.api.persister import Persister, Running
from tgq.api.reconciler import EpochWatch, reconcile_once, resume_batches
from tgq.api.recorder import Recorder
from tgq.api.security import RecentKeys, install_security
from tgq.api.settings import Settings
from tgq.api.shedding import ShedOverload
from tgq.api.tokenizer import ModelTokenizer
from tgq.batcher import tracing
from tgq.batcher.messages import Heartbeat
from tgq.batcher.transport.aio import AsyncApiTransport, AsyncRedisApiTransport
from tgq.batcher.transport.base import StoredFinal
from tgq.batcher.transport.threaded import ThreadedApiTransport
from tgq.gpu_worker.quantization import (
    check_stored_quantization,
    refuse_quantized_config,
    stored_method,
)

log = logging.getLogger("api")
VERSION = "0.1.0"
MONITOR_INTERVAL_S = 0.25
BATCHERS_INTERVAL_S = 1.0
MAX_WARM_CONNECTIONS = 16  # per pool (database, Redis) opened at start: up to the concurrency cap


class BatchStarter(Protocol):
    """Has an OpenAI batch driven to its end (`bulk.batches.starters`): on a Celery worker or
    on a task of this process."""

    async def start(self, batch_id: str) -> None: ...

    async def stop(self) -> None:
        """Ends the batches this process drives (they resume at its next start)."""


@dataclass(slots=True)
class AppState:
    settings: Settings
    db: AsyncEngine
    transport: AsyncApiTransport
    tokenizer: ModelTokenizer
    metrics: Metrics
    generation: Generation
    persister: Persister
    running: Running
    health: Health
    files: FileStorage
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    embedded: Any = None  # the in-process batcher, without Redis
    batch_starter: BatchStarter | None = None  # made from this state as the app starts
    epoch_watch: EpochWatch = field(default_factory=EpochWatch)
    # `--quantize`, or "compressed-tensors" for a checkpoint stored quantized (/info)
    quantize: str | None = None
    beats: Sequence[Heartbeat] = ()  # the live batchers' latest heartbeats (`_monitor`)

    async def start_batch(self, batch_id: str) -> None:
        """Starts a runner for the batch (once per batch at a time). A runner that cannot start
        now is started by the reconciler once the batch's lease lapses."""
        assert self.batch_starter is not None, "the app has not started"
        await self.batch_starter.start(batch_id)


StarterFactory = Callable[[AppState], BatchStarter]


def state_of(request: Request) -> AppState:
    app_state: AppState = request.app.state.tgq
    return app_state


def create_app(settings: Settings, *, batch_starter: StarterFactory) -> FastAPI:
    """The app for `settings`; `batch_starter` makes, from the started app's state, what drives
    its OpenAI batches (`bulk.batches.starters.starter_for` in `python -m tgq.api`)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.tgq = await _start(settings, batch_starter)
        try:
            yield
        finally:
            await _stop(app.state.tgq)
            tracing.shutdown_tracing()

    app = FastAPI(
        title="tgq",
        version=VERSION,
        description="Text generation queue: TGI- and OpenAI-compatible, with durable jobs.",
        lifespan=lifespan,
    )
    install_error_handlers(app)

    async def verify_key(key: str) -> KeyAccess | None:
        try:
            async with app.state.tgq.db.begin() as conn:
                record = await api_keys.verify_api_key(conn, key=key)
        except Exception as error:
            if dependency_failure(error) is None:
                raise
            raise UnavailableError(
                "The database is unavailable: cannot check the API key",
                retry_after_s=settings.retry_after_s,
            ) from error
        if record is None:
            return None
        return record.access()

    app.add_middleware(ShedOverload, state=lambda: getattr(app.state, "tgq", None))
    app.state.drain = Drain()
    app.add_middleware(DrainMiddleware, drain=app.state.drain)
    recent = RecentKeys(verify_key, ttl_s=settings.key_cache_s) if settings.key_cache_s else None
    install_security(app, settings, (recent or verify_key) if settings.require_api_keys else None)
    install_observability(app, settings)
    from tgq.api.routes import (  # they import `state_of`
        batches,
        files,
        job_events,
        jobs,
        keys,
        openai,
        tgi,
    )

    app.include_router(tgi.router)
    app.include_router(openai.router)
    app.include_router(jobs.router)
    app.include_router(job_events.router)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(keys.router)
    return app


def model_dir_of(settings: Settings) -> Path:
    """A local directory with the model's tokenizer: `MODEL_DIR`, else `MODEL_ID` when it is a
    directory, else the hub snapshot of `MODEL_ID` (tokenizer and config files only)."""
    if settings.model_dir:
        return Path(settings.model_dir)
    if Path(settings.model_id).is_dir():
        return Path(settings.model_id)
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.jinja"]
    return Path(snapshot_download(settings.model_id, allow_patterns=patterns))


async def _start(settings: Settings, make_starter: StarterFactory) -> AppState:
    db = create_engine(settings.database_url)
    if settings.auto_migrate:
        await asyncio.to_thread(upgrade, settings.database_url)
    await check_schema(db)
    model_dir = model_dir_of(settings)
    # The batcher refuses what it cannot run too; say so before serving.
    scheme = refuse_quantized_config(model_dir)
    check_stored_quantization(scheme, settings.quantize, settings.num_shard)
    embedded = None
    transport: AsyncApiTransport
    if settings.redis_url:
        max_connections = settings.max_concurrent_requests * 2 + 32  # readers block on theirs
        transport = AsyncRedisApiTransport.from_url(
            settings.redis_url,
            settings.redis_prefix,
            max_connections=max_connections,
            cache_routing=settings.cache_routing,
        )
    else:
        from tgq.batcher.embedded import EmbeddedBatcher

        embedded = await asyncio.to_thread(EmbeddedBatcher, settings)
        settings = settings.capped_by_kv(embedded.kv_capacity)
        embedded.start()
        workers = settings.max_concurrent_requests + 8
        transport = ThreadedApiTransport(embedded.transport, max_workers=workers)
    metrics = Metrics(
        max_input_tokens=settings.max_input_tokens, max_total_tokens=settings.max_total_tokens
    )
    tokenizer = ModelTokenizer.from_model_dir(
        model_dir, max_workers=settings.validation_workers, on_call=metrics.on_tokenizer_call
    )
    # The connections a burst at the concurrency cap needs, opened before the first request:
    # on Redis, one per waiting reader and a few for the api's own loops.
    num_warm = min(settings.max_concurrent_requests, MAX_WARM_CONNECTIONS)
    await asyncio.gather(warm_up(db, num_warm), transport.warm_up(num_warm + 8))
    limits = Limits(
        max_concurrent_requests=settings.max_concurrent_requests,
        max_queued_requests=settings.max_queued_requests,
        max_queued_tokens=settings.max_queued_tokens,
        retry_after_s=settings.retry_after_s,
    )
    admission = Admission(limits, on_reject=metrics.on_rejected)
    recorder, running = Recorder(db, transport), Running(db, transport)
    limiter = _key_limiter(settings, transport)
    health = Health(database=DatabaseProbe(db))
    consumer = f"{socket.gethostname()}-{os.getpid()}"
    persister = Persister(db, transport, consumer, on_results=_observer(health))
    generation = Generation(
        settings=settings,
        db=db,
        transport=transport,
        tokenizer=tokenizer,
        metrics=metrics,
        admission=admission,
        recorder=recorder,
        limiter=limiter,
    )
    state = AppState(
        settings, db, transport, tokenizer, metrics, generation, persister, running, health,
        LocalFileStorage(settings.file_storage_dir), embedded=embedded,
        quantize=stored_method(scheme) if scheme is not None else settings.quantize,
    )  # fmt: skip
    state.batch_starter = make_starter(state)
    recorder.start()
    running.start()
    persister.start()
    state.tasks.append(asyncio.create_task(_monitor(state), name="monitor"))
    state.tasks.append(asyncio.create_task(renew_leases(limiter), name="key-leases"))
    if settings.reconcile_interval_s > 0:
        state.tasks.append(asyncio.create_task(_reconcile(state), name="reconciler"))
    with contextlib.suppress(Exception):  # batches an earlier process left (or the reconciler)
        await resume_batches(db, state.start_batch, grace_s=2 * settings.batch_lease_s)
    log.info(
        "api serving %s (%s)", settings.model_id, "redis" if settings.redis_url else "embedded"
    )
    return state


def _key_limiter(settings: Settings, transport: AsyncApiTransport) -> KeyLimiter:
    """Per-key limits counted in Redis for every replica, or in this process when embedded."""
    if isinstance(transport, AsyncRedisApiTransport):
        return RedisKeyLimiter(
            transport.client, settings.redis_prefix, window_s=settings.rate_limit_window_s
        )
    return MemoryKeyLimiter(window_s=settings.rate_limit_window_s)


def _observer(health: Health) -> Any:
    def observe(finals: list[StoredFinal]) -> None:
        for stored in finals:
            health.observe(stored.result)

    return observe


async def _monitor(state: AppState) -> None:
    """Keeps the admission's queue depth and the health's batcher count fresh, and watches the
    transport's epoch (`api/reconciler.py`)."""
    next_batchers = 0.0
    while True:
        try:
            await _watch_epoch(state)
            since = state.generation.admission.num_submissions
            depth = await state.transport.queue_depth()
            state.generation.admission.set_queue_depth(depth, since=since)
            state.metrics.set_queue_size(depth)
            if time.monotonic() >= next_batchers:
                next_batchers = time.monotonic() + BATCHERS_INTERVAL_S
                beats = await state.transport.live_batchers()
                state.health.num_batchers = len(beats)
                state.metrics.set_batchers(beats)
                state.beats = beats
            state.health.transport_failure = None
        except asyncio.CancelledError:
            raise
        except Exception as error:  # Redis away: health says so, admission keeps its last view
            state.health.num_batchers = 0
            state.health.transport_failure = f"the queue (Redis) is unreachable: {error!r}"
            log.warning("monitor: %s", error)
        await asyncio.sleep(MONITOR_INTERVAL_S)


async def _watch_epoch(state: AppState) -> None:
    """A new epoch: the transport lost its data. This replica enqueues again what its clients
    wait for; the replica that started the epoch also reconciles at once."""
    is_first = state.epoch_watch.token is None
    epoch = await state.epoch_watch.check(state.transport)
    if epoch is None:
        return
    if not is_first:
        await state.generation.resubmit_unfinished()
    if epoch.is_new:
        log.warning("the transport's data is new (epoch %s): reconciling now", epoch.token)
        round_now = _reconcile_round(state, older_than_s=0)
        state.tasks.append(asyncio.create_task(round_now, name="reconcile-now"))


async def _reconcile(state: AppState) -> None:
    """Until Celery beat runs it (the bulk pipelines issue), each api replica reconciles."""
    settings = state.settings
    while True:
        await asyncio.sleep(settings.reconcile_interval_s)
        await _reconcile_round(state, older_than_s=settings.reconcile_grace_s)


async def _reconcile_round(state: AppState, *, older_than_s: float) -> None:
    settings = state.settings
    try:
        await reconcile_once(
            db=state.db,
            transport=state.transport,
            settings=settings,
            eos_token_ids=state.tokenizer.eos_token_ids,
            older_than_s=older_than_s,
        )
        await resume_batches(state.db, state.start_batch, grace_s=2 * settings.batch_lease_s)
    except asyncio.CancelledError:
        raise
    except Exception as error:  # the database or Redis is away: next round
        log.warning("reconciler: %s", error)


async def _stop(state: AppState) -> None:
    assert state.batch_starter is not None
    await asyncio.gather(
        *(cancel_and_wait(task) for task in state.tasks), state.batch_starter.stop()
    )
    await state.generation.recorder.stop()
    await state.running.stop()
    await state.generation.aclose()
    await state.persister.stop()
    if state.embedded is not None:
        await asyncio.to_thread(state.embedded.stop)
    await state.transport.close()
    state.tokenizer.close()
    await state.db.dispose()
