"""What routes call to generate: admit, tokenize and validate, record and enqueue, then follow
(each request in flight is a `Run`, `api/run.py`).

An interactive HTTP request is one job of kind "interactive": one item per prompt and copy (OpenAI
`n`, TGI `best_of`; copy `c` of a seeded request gets seed + c). The job row is committed before
anything is enqueued, and the final results reach it through the persister, so interactive
requests are audited like jobs.

A request whose client goes away is aborted in the batcher: `wait_finals` watches the connection
while it waits, and a stream's generator aborts when it is closed before the end. A request whose
tokens cannot be followed (Redis away) is answered 503 and withdrawn (`api/withdrawals.py`): it
never runs later. When the transport loses its data (a new epoch), this replica enqueues again
the unfinished requests that its clients still wait for (`resubmit_unfinished`); nobody else
does (the reconciler never reruns an interactive request).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.types import Receive

from tgq.api.admission import Admission, Ticket
from tgq.api.db import store
from tgq.api.errors import ApiError, RateLimitedError, TemplateError, UnavailableError
from tgq.api.ids import new_job_id
from tgq.api.key_policy import KeyAccess, KeyLimiter, check_fits
from tgq.api.metrics import Metrics
from tgq.api.recorder import Recorder
from tgq.api.run import Run
from tgq.api.settings import Settings
from tgq.api.submit import job_items, job_params, job_requests, num_copies
from tgq.api.tokenizer import ModelTokenizer
from tgq.api.validated import GenerationParams, ValidatedRequest
from tgq.api.validation import check_token_ids, validate_tokens
from tgq.batcher.messages import FinalResult, TokenEvent
from tgq.batcher.request import FAILED_REASONS, Priority
from tgq.batcher.transport.aio import AsyncApiTransport

log = logging.getLogger(__name__)

FOLLOW_POLL_S = 4.0  # one blocking read waits at most this long (under the socket timeout)


class Generation:
    def __init__(
        self,
        *,
        settings: Settings,
        db: AsyncEngine,
        transport: AsyncApiTransport,
        tokenizer: ModelTokenizer,
        metrics: Metrics,
        admission: Admission,
        recorder: Recorder,
        limiter: KeyLimiter,
    ) -> None:
        self.settings = settings
        self.db = db
        self.transport = transport
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.admission = admission
        self.recorder = recorder
        self.limiter = limiter
        self._background: set[asyncio.Task[None]] = set()
        self._runs: dict[str, Run] = {}  # by job id: the requests this replica's clients wait for

    @contextmanager
    def admitted(self, *, num_requests: int = 1) -> Iterator[Ticket]:
        """Admits a request (429 before any other work) for the body of the `with`, which
        validates and starts it. A body that raises gives the ticket back and counts why: the
        request never started. A started request keeps its ticket until its run ends."""
        ticket = self.admit(num_requests=num_requests)
        try:
            yield ticket
        except BaseException as error:
            self._abandon(ticket, error)
            raise

    def admit(self, *, num_requests: int = 1) -> Ticket:
        self.metrics.on_request()
        try:
            ticket = self.admission.admit(num_requests=num_requests)
        except Exception:
            self.metrics.on_failure("overloaded")
            raise
        self.metrics.set_in_flight(self.admission.num_in_flight)
        return ticket

    def release(self, ticket: Ticket) -> None:
        ticket.release()
        self.metrics.set_in_flight(self.admission.num_in_flight)

    def _abandon(self, ticket: Ticket, error: BaseException) -> None:
        self.release(ticket)
        if isinstance(error, ApiError) and error.status_code == 422:
            self.metrics.on_failure(
                "template" if isinstance(error, TemplateError) else "validation"
            )

    async def validate(
        self,
        given: Sequence[str | list[int]],
        params: GenerationParams,
        *,
        priority: Priority = Priority.INTERACTIVE,
        deadline: float | None = None,
        param: str = "inputs",
    ) -> list[ValidatedRequest]:
        """Tokenize (on the tokenizer's pool) and check lengths; raises `ValidationError`. A
        prompt given as token ids (OpenAI completions) is taken as it is, each id checked
        against the tokenizer's vocabulary, and its text decoded for the record and `echo`."""

        async def ids_of(prompt: str | list[int]) -> list[int]:
            if isinstance(prompt, str):
                return await self.tokenizer.encode(
                    prompt, add_special_tokens=params.add_special_tokens
                )
            check_token_ids(prompt, self.tokenizer.vocab_size, param)
            return list(prompt)

        token_ids = await asyncio.gather(*(ids_of(prompt) for prompt in given))
        prompts = [
            p if isinstance(p, str) else self.tokenizer.decode(p, skip_special_tokens=False)
            for p in given
        ]
        return [
            validate_tokens(
                prompt=prompt,
                token_ids=ids,
                params=params,
                settings=self.settings,
                priority=priority,
                deadline=deadline,
                eos_token_ids=self.tokenizer.eos_token_ids,
                param=param,
            )
            for prompt, ids in zip(prompts, token_ids, strict=True)
        ]

    async def start(
        self,
        prompts: list[ValidatedRequest],
        ticket: Ticket,
        *,
        route: str,
        key: KeyAccess | None = None,
        keep_events: bool = False,
    ) -> Run:
        """Admits it under its key's limits, records it as a job, commits it, enqueues its
        items."""
        validated_at = time.time()
        model = prompts[0].params.adapter or self.settings.model_id
        if key is not None:
            key.check_model(model)
        if key is not None and key.capped("interactive") == "bulk":
            prompts = [dataclasses.replace(p, priority=Priority.BULK) for p in prompts]
        params = prompts[0].params
        job_id = new_job_id()
        requests = job_requests(job_id, prompts)
        num_tokens = sum(len(r.prompt_token_ids) + r.stopping.max_new_tokens for r in requests)
        ticket.add_tokens(num_tokens)
        if key is not None and key.limits.is_rated:
            check_fits(key.limits, num_tokens)
            try:
                grant = await self.limiter.acquire(
                    key.key_id, key.limits, lease_id=job_id, num_tokens=num_tokens
                )
            except RateLimitedError as error:
                self.metrics.on_key_limited(key.name, error.limit)
                raise
            key.headers.update(grant.headers())
        api_key_id = None if key is None else key.key_id
        job = store.NewJob(
            job_id=job_id,
            kind="interactive",
            route=route,
            priority=int(prompts[0].priority),
            model=model,
            params=job_params(params),
            items=job_items(requests),
            api_key_id=api_key_id,
            deadline=_as_datetime(prompts[0].deadline),
        )
        copies = num_copies(params)
        run = Run(job_id, prompts, requests, copies, ticket, ticket.admitted_at, validated_at)
        run.key = key
        if key is not None and key.limits.is_rated:
            run.holds_lease, run.num_tokens_charged = True, num_tokens
        with self.admission.submitting(len(requests)) as submission:
            try:
                await self.recorder.submit(job, requests)
            except BaseException:
                run.num_tokens_charged = 0  # it never ran
                self._release_key(run)
                raise
            submission.is_queued = True
        run.keep_events = keep_events
        self._runs[job_id] = run
        return run

    async def resubmit_unfinished(self) -> int:
        """Enqueues again, as their next attempt, the unfinished requests of the runs in
        flight here (the transport lost them); returns how many."""
        requests = [
            dataclasses.replace(r, attempt=r.attempt + 1)
            for run in list(self._runs.values())
            for r in run.requests
            if r.request_id not in run.finals
        ]
        if requests:
            await self.transport.submit(requests)
            log.warning("the transport lost its data: %d requests enqueued again", len(requests))
        return len(requests)

    async def stream(self, run: Run) -> AsyncIterator[tuple[int, TokenEvent | FinalResult]]:
        """(item index, event) for every item, interleaved as they come, each item's final last.
        Closing the iterator before the end aborts the unfinished items."""
        queue: asyncio.Queue[tuple[int, TokenEvent | FinalResult] | BaseException] = asyncio.Queue()

        async def pump(index: int, request_id: str) -> None:
            try:
                async for event in follow(self.transport, request_id):
                    queue.put_nowait((index, event))
            except Exception as error:  # Redis away mid-request: the consumer says 503
                log.error("following %s failed: %s", request_id, error)
                message = "The token stream is unavailable; the request was withdrawn. Retry later"
                queue.put_nowait(UnavailableError(message))

        tasks = [asyncio.create_task(pump(i, r.request_id)) for i, r in enumerate(run.requests)]
        is_withdrawn = False
        try:
            while not run.is_finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    await self._withdraw(run, item)
                    is_withdrawn = True
                    raise item
                index, event = item
                self._observe(run, event)
                yield index, event
        finally:
            for task in tasks:
                task.cancel()
            if not run.is_finished and not is_withdrawn:
                self.abort_soon(run)
            self._finish(run)

    async def _withdraw(self, run: Run, error: BaseException) -> None:
        """The run is answered with `error` (503): it must not run later."""
        pending = [r.request_id for r in run.requests if r.request_id not in run.finals]
        reason = f"unavailable: its tokens could not be followed ({error})"
        await self.recorder.withdrawals.withdraw([run.job_id], pending, reason)

    async def wait_finals(self, run: Run, receive: Receive) -> list[FinalResult]:
        """Every item's final result, in item order; aborts them if the client disconnects."""

        async def collect() -> None:
            async for _ in self.stream(run):
                pass

        collector = asyncio.create_task(collect())
        watcher = asyncio.create_task(_disconnected(receive))
        try:
            await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not collector.done():
                collector.cancel()  # the stream's own clean-up aborts what is unfinished
                await asyncio.wait({collector})
        if collector.cancelled():
            raise asyncio.CancelledError  # the client is gone; nothing to answer
        collector.result()
        return [run.finals[r.request_id] for r in run.requests]

    def abort_soon(self, run: Run) -> None:
        """Aborts the unfinished items, from a task of its own (this one may be cancelled)."""
        pending = [r.request_id for r in run.requests if r.request_id not in run.finals]
        if pending:
            self._in_background(self._abort(pending))

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            await self.transport.abort(request_id, "client disconnected")
        self.metrics.on_failure("dropped")

    def _observe(self, run: Run, event: TokenEvent | FinalResult) -> None:
        if isinstance(event, FinalResult):
            run.finals[event.request_id] = event
            return
        if run.keep_events:
            run.events.setdefault(event.request_id, []).append(event)
        now = time.time()
        if run.first_token_at is None:
            run.first_token_at = now
            self.metrics.observe_ttft(now - run.started_at)
        elif run.last_token_at is not None and event.token_ids:
            self.metrics.observe_itl((now - run.last_token_at) / len(event.token_ids))
        run.last_token_at = now

    def _release_key(self, run: Run) -> None:
        """Gives the run's lease back and settles its key's charge, from a task of its own."""
        if run.key is not None and run.holds_lease:
            run.holds_lease = False
            self._in_background(self._settle(run.key, run.job_id, run.num_tokens_used))

    async def _settle(self, key: KeyAccess, lease_id: str, num_tokens_used: int) -> None:
        try:
            await self.limiter.release(key.key_id, lease_id, num_tokens_used=num_tokens_used)
        except Exception as error:  # Redis away: the lease lapses by itself
            log.warning("could not release %s of key %d: %r", lease_id, key.key_id, error)

    def _finish(self, run: Run) -> None:
        self._runs.pop(run.job_id, None)
        self.release(run.ticket)
        self._release_key(run)
        if not run.is_finished:
            return
        finals = list(run.finals.values())
        if all(final.finish_reason in FAILED_REASONS for final in finals):
            self.metrics.on_failure("generation")
            return
        now = time.time()
        first = run.first_token_at or now
        generated = sum(final.num_output_tokens for final in finals)
        if run.key is not None:
            self.metrics.on_key_usage(
                run.key.name,
                num_prompt_tokens=sum(final.num_prompt_tokens for final in finals),
                num_completion_tokens=generated,
            )
        self.metrics.on_success(
            validation_s=run.validated_at - run.started_at,
            queue_s=max(first - run.validated_at, 0.0),
            inference_s=now - first,
            total_s=now - run.started_at,
            time_per_token_s=(now - first) / generated if generated > 1 else None,
            num_input_tokens=sum(p.num_prompt_tokens for p in run.prompts),
            num_generated_tokens=generated,
            max_new_tokens=run.requests[0].stopping.max_new_tokens,
        )

    async def aclose(self) -> None:
        for task in list(self._background):
            await task


def _as_datetime(deadline: float | None) -> datetime | None:
    return None if deadline is None else datetime.fromtimestamp(deadline, UTC)


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def follow(
    transport: AsyncApiTransport, request_id: str, from_seq: int = 0
) -> AsyncIterator[TokenEvent | FinalResult]:
    """The request's token events from `from_seq` on, in order, then its final result."""
    seq = from_seq
    while True:
        events = await transport.read_tokens(request_id, seq, FOLLOW_POLL_S)
        for event in events:
            yield event
            seq = event.seq_index + 1
        if events:
            continue
        final = await transport.read_final(request_id)
        if final is not None:
            for event in await transport.read_tokens(request_id, seq, 0):
                yield event
            yield final
            return
