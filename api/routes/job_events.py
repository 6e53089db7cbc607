"""`GET /v1/jobs/{id}/events`: a job as Server-Sent Events.

Events: `token` (id `"<item>.<seq>"`), `result` (id `"<item>.r"`) per item in item order, then
`done` with the job. A client that reconnects with `Last-Event-ID` continues after that event;
the state lives in Redis and the database, so any api replica can continue a stream. Closing the
stream does not cancel the job. An item's tokens come from the transport while they last (the
token streams expire after `token_ttl_s`); its result from the database once persisted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Header, Request, Response
from sse_starlette import EventSourceResponse, ServerSentEvent

from tgq.api.app import AppState, state_of
from tgq.api.db import store
from tgq.api.errors import ApiError, NotFoundError, ValidationError, unavailable
from tgq.api.ids import request_id_of
from tgq.api.routes.jobs import JobItemResult, get_visible_job, item_result, view
from tgq.api.sse import STREAM_RESPONSES, dump_json, sse_response
from tgq.batcher.messages import FinalResult

router = APIRouter(tags=["Jobs"])
EVENT_POLL_S = 2.0  # how long one wait for tokens lasts before the item's row is looked at
DONE_WAIT_S = 10.0  # after the last result, how long to wait for the persister's commit


def parse_last_event_id(value: str | None) -> tuple[int, int]:
    """(first item, first seq) to send after the event `value` ("3.7", "3.r" or "done")."""
    if not value:
        return 0, 0
    item, _, seq = value.partition(".")
    if value == "done":
        return 1 << 30, 0
    if not item.isdigit() or not (seq == "r" or seq.isdigit()):
        raise ValidationError(
            f"Invalid Last-Event-ID {value!r}: expected '<item>.<seq>', '<item>.r' or 'done'",
            param="Last-Event-ID",
        )
    return (int(item) + 1, 0) if seq == "r" else (int(item), int(seq) + 1)


@router.get(
    "/v1/jobs/{job_id}/events", response_class=EventSourceResponse, responses=STREAM_RESPONSES
)
async def job_events(
    job_id: str,
    request: Request,
    last_event_id: str | None = Header(default=None),
) -> Response:
    """Server-Sent Events of a job: tokens and results per item, then `done`."""
    state = state_of(request)
    job = await get_visible_job(state, job_id, request)
    start = parse_last_event_id(last_event_id)
    return sse_response(_events(state, job, start), {})


async def _events(
    state: AppState, job: store.JobRecord, start: tuple[int, int]
) -> AsyncIterator[ServerSentEvent]:
    first_item, first_seq = start
    try:
        for index in range(first_item, job.num_items):
            seq = first_seq if index == first_item else 0
            async for event in _item_events(state, job.id, index, seq):
                yield event
        yield await _done_event(state, job.id)
    except Exception as error:  # the stream has started: an `error` event, not a status
        failure = error if isinstance(error, ApiError) else unavailable(error)
        if failure is None:
            raise
        yield ServerSentEvent(data=dump_json({"error": failure.message}), event="error", sep="\n")


async def _item_events(
    state: AppState, job_id: str, index: int, seq: int
) -> AsyncIterator[ServerSentEvent]:
    request_id = request_id_of(job_id, index)
    transport = state.transport
    while True:
        result = await _stored_result(state, job_id, index)
        if result is not None:  # persisted: send what tokens remain, then the result
            for event in await transport.read_tokens(request_id, seq, 0):
                yield _token_event(index, event.seq_index, event.token_ids, event.text)
            yield _result_event(index, item_result(result).model_dump())
            return
        final: FinalResult | None = None
        events = await transport.read_tokens(request_id, seq, EVENT_POLL_S)
        for event in events:
            yield _token_event(index, event.seq_index, event.token_ids, event.text)
            seq = event.seq_index + 1
        if events:
            continue
        final = await transport.read_final(request_id)
        if final is not None:
            for event in await transport.read_tokens(request_id, seq, 0):
                yield _token_event(index, event.seq_index, event.token_ids, event.text)
            status = store.item_status(final.finish_reason)
            yield _result_event(index, _final_result(index, status, final))
            return
        if await _item_is_closed(state, job_id, index):  # cancelled before it ever ran
            yield _result_event(index, {"index": index, "status": "cancelled"})
            return


def _final_result(index: int, status: str, final: FinalResult) -> dict[str, Any]:
    return JobItemResult(
        index=index,
        status=status,
        text=final.text,
        token_ids=final.token_ids,
        finish_reason=final.finish_reason,
        finish_detail=final.finish_detail,
        prompt_tokens=final.num_prompt_tokens,
        completion_tokens=final.num_output_tokens,
    ).model_dump()


async def _stored_result(state: AppState, job_id: str, index: int) -> store.ResultRecord | None:
    async with state.db.connect() as conn:
        return await store.get_result(conn, job_id=job_id, item_index=index)


async def _item_is_closed(state: AppState, job_id: str, index: int) -> bool:
    async with state.db.connect() as conn:
        status = await store.get_item_status(conn, job_id=job_id, item_index=index)
    return status in store.TERMINAL_STATUSES


async def _done_event(state: AppState, job_id: str) -> ServerSentEvent:
    deadline = time.monotonic() + DONE_WAIT_S
    while True:
        async with state.db.connect() as conn:
            job = await store.get_job(conn, job_id=job_id)
        if job is None:
            raise NotFoundError(f"No job with id {job_id!r}")
        if job.is_finished or time.monotonic() > deadline:
            data = view(job).model_dump_json()
            return ServerSentEvent(data=data, event="done", id="done", sep="\n")
        await asyncio.sleep(0.05)


def _token_event(index: int, seq: int, token_ids: list[int], text: str) -> ServerSentEvent:
    data = dump_json({"index": index, "seq": seq, "token_ids": token_ids, "text": text})
    return ServerSentEvent(data=data, event="token", id=f"{index}.{seq}", sep="\n")


def _result_event(index: int, result: dict[str, Any]) -> ServerSentEvent:
    return ServerSentEvent(data=dump_json(result), event="result", id=f"{index}.r", sep="\n")
