"""Durable jobs: `POST /v1/jobs` (202), `GET /v1/jobs/{id}`, `GET /v1/jobs`, `DELETE
/v1/jobs/{id}` (cancel).

A job is committed to the database before its items are enqueued; its results come from the
persister, so a job finishes whether or not anyone is watching. `Idempotency-Key` (per api key):
a repeat with the same body returns the first job (200, nothing enqueued); the same key with a
different body is a 422.

Events (`GET /v1/jobs/{id}/events`) are in `job_events.py`.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import Any, Literal

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from tgq.api.app import AppState, state_of
from tgq.api.db import store
from tgq.api.errors import NotFoundError, RouteValidationError, ValidationError
from tgq.api.ids import new_job_id, request_id_of
from tgq.api.key_policy import KeyAccess
from tgq.api.schemas.tgi import GenerateParameters
from tgq.api.submit import job_items, job_params, job_requests
from tgq.api.validation import check_inputs, tgi_params
from tgq.batcher.request import Priority

router = APIRouter(tags=["Jobs"])
MAX_PAGE = 100


class JobRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str | list[str] = Field(description="One prompt or a list of them (one item each).")
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    priority: Literal["interactive", "bulk"] = "bulk"
    deadline: datetime | None = Field(
        default=None, description="Items not finished by then end with `deadline`."
    )
    metadata: dict[str, str] | None = None


class JobItemResult(BaseModel):
    index: int
    status: str
    text: str | None = None
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    finish_detail: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class JobView(BaseModel):
    id: str
    object: Literal["job"] = "job"
    status: str
    kind: str
    priority: str
    model: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    deadline: datetime | None
    progress: dict[str, int]
    usage: dict[str, int]
    timings: dict[str, float | None]
    metadata: dict[str, Any] | None = None
    request_ids: list[str] | None = None
    results: list[JobItemResult] | None = None


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobView]
    has_more: bool
    last_id: str | None


def _priority_name(priority: int | None) -> str:
    return "interactive" if priority == Priority.INTERACTIVE else "bulk"


def view(job: store.JobRecord, results: list[store.ResultRecord] | None = None) -> JobView:
    def seconds(start: datetime | None, end: datetime | None) -> float | None:
        return None if start is None or end is None else (end - start).total_seconds()

    return JobView(
        id=job.id,
        status=job.status,
        kind=job.kind,
        priority=_priority_name(job.priority),
        model=job.model,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        deadline=job.deadline,
        progress={
            "total": job.num_items,
            "done": job.num_items_done,
            "failed": job.num_items_failed,
        },
        usage={
            "prompt_tokens": job.prompt_tokens,
            "completion_tokens": job.completion_tokens,
            "total_tokens": job.prompt_tokens + job.completion_tokens,
        },
        timings={
            "queued_s": seconds(job.created_at, job.started_at),
            "run_s": seconds(job.started_at, job.finished_at),
            "total_s": seconds(job.created_at, job.finished_at),
        },
        metadata=job.metadata,
        results=None if results is None else [item_result(r) for r in results],
    )


def item_result(result: store.ResultRecord) -> JobItemResult:
    return JobItemResult(
        index=result.item_index,
        status=store.item_status(result.finish_reason),
        text=result.text,
        token_ids=result.token_ids,
        finish_reason=result.finish_reason,
        finish_detail=result.finish_detail,
        prompt_tokens=result.num_prompt_tokens,
        completion_tokens=result.num_output_tokens,
    )


def _scope(request: Request) -> str:
    key_id = request.state.api_key_id
    return "" if key_id is None else str(key_id)


@router.post("/v1/jobs", status_code=202, response_model=JobView)
async def create_job(
    body: JobRequest,
    request: Request,
    idempotency_key: str | None = Header(default=None, max_length=255),
) -> Response:
    """Accept a job: 202 once it is committed and queued (200 for a repeated Idempotency-Key)."""
    state = state_of(request)
    settings = state.settings
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if not prompts:
        raise ValidationError("`prompt` cannot be an empty list", param="prompt")
    if len(prompts) > settings.max_job_prompts:
        raise RouteValidationError(
            f"A job has at most {settings.max_job_prompts} prompts. Given: {len(prompts)}",
            error_type="batch size exceeded",
            param="prompt",
        )
    params = tgi_params(body.parameters, settings, is_stream=False)
    if params.best_of > 1:
        raise ValidationError("`best_of` is not supported for jobs", param="parameters.best_of")
    for prompt in prompts:
        check_inputs(prompt, "prompt")
    state.generation.admission.check_queue(len(prompts))
    key: KeyAccess | None = request.state.key
    model = params.adapter or settings.model_id
    if key is not None:
        key.check_model(model)
    asked = body.priority if key is None else key.capped(body.priority)
    priority = Priority.INTERACTIVE if asked == "interactive" else Priority.BULK
    deadline = None if body.deadline is None else _aware(body.deadline).timestamp()
    validated = await state.generation.validate(
        prompts, params, priority=priority, deadline=deadline, param="prompt"
    )
    job_id = new_job_id()
    requests = job_requests(job_id, validated)
    job = store.NewJob(
        job_id=job_id,
        kind="job",
        route="/v1/jobs",
        priority=int(priority),
        model=model,
        params=job_params(params),
        items=job_items(requests),
        idempotency_key=idempotency_key,
        idempotency_scope=_scope(request),
        fingerprint=None if idempotency_key is None else await _fingerprint(request),
        api_key_id=request.state.api_key_id,
        deadline=None if body.deadline is None else _aware(body.deadline),
        metadata=body.metadata,
    )
    recorder, admission = state.generation.recorder, state.generation.admission
    with admission.submitting(len(requests)) as submission:  # counted before the write
        if idempotency_key is None and (key is None or key.limits.max_queued_jobs is None):
            record, is_new = await recorder.submit(job, requests), True
        else:  # an Idempotency-Key's earlier job is not queued again
            record, is_new = await recorder.submit_alone(job, requests, key=key)
        submission.is_queued = is_new
    if not is_new and record.idempotency_fingerprint != job.fingerprint:
        raise ValidationError(
            "This Idempotency-Key was used with a different request body",
            param="Idempotency-Key",
        )
    status_code = 202 if is_new else 200
    answer = view(record)
    answer.request_ids = [request_id_of(record.id, i) for i in range(record.num_items)]
    headers = {"Location": f"/v1/jobs/{record.id}"}
    return JSONResponse(answer.model_dump(mode="json"), status_code=status_code, headers=headers)


async def _fingerprint(request: Request) -> str:
    return hashlib.sha256(await request.body()).hexdigest()


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


async def get_visible_job(state: AppState, job_id: str, request: Request) -> store.JobRecord:
    async with state.db.connect() as conn:
        job = await store.get_job(conn, job_id=job_id, api_key_id=request.state.api_key_id)
    if job is None:
        raise NotFoundError(f"No job with id {job_id!r}", param="job_id")
    return job


@router.get("/v1/jobs/{job_id}", response_model=JobView)
async def get_job(job_id: str, request: Request) -> JobView:
    """A job's status, progress, usage and timings; its results once it has finished."""
    state = state_of(request)
    job = await get_visible_job(state, job_id, request)
    results = None
    if job.is_finished:
        async with state.db.connect() as conn:
            results = await store.get_results(conn, job_id=job_id)
    return view(job, results)


@router.get("/v1/jobs", response_model=JobList)
async def list_jobs(
    request: Request,
    limit: int = Query(20, ge=1, le=MAX_PAGE),
    status: Literal["queued", "running", "succeeded", "failed", "cancelled"] | None = None,
    after: str | None = Query(None, description="The last job id of the previous page."),
) -> JobList:
    """Jobs, newest first, `limit` per page; `after` continues from the previous page."""
    state = state_of(request)
    async with state.db.connect() as conn:
        jobs = await store.list_jobs(
            conn,
            limit=limit + 1,
            status=status,
            after=after,
            api_key_id=request.state.api_key_id,
        )
    page = jobs[:limit]
    return JobList(
        data=[view(job) for job in page],
        has_more=len(jobs) > limit,
        last_id=page[-1].id if page else None,
    )


@router.delete("/v1/jobs/{job_id}", response_model=JobView)
async def cancel_job(job_id: str, request: Request) -> JobView:
    """Cancel a job: its unfinished items are aborted in the batcher; finished ones are kept."""
    state = state_of(request)
    await get_visible_job(state, job_id, request)  # 404 for a job of another key
    async with state.db.begin() as conn:
        request_ids = await store.cancel_job(conn, job_id=job_id)
    if request_ids is None:
        raise NotFoundError(f"No job with id {job_id!r}", param="job_id")
    # Redis away: the job is cancelled all the same; the aborts are sent once it is back.
    await state.generation.recorder.withdrawals.abort(request_ids, "job cancelled")
    return view(await get_visible_job(state, job_id, request))
