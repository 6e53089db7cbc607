"""Running one batch: its input file becomes one job of kind `batch` (one item per valid line),
fed to the transport in a bounded window, then its results become the output and error files.

`run_batch` can be run again at any point (a worker that died, an api restart) and goes on
where the database says the batch is: lines and the job are committed once, together; the
window enqueues only items the transport does not know (as the reconciler does), so a line is
never run twice on purpose and a finished one is never redone.

Statuses, as OpenAI's: validating → in_progress → finalizing → completed; failed (the input
could not be read); cancelling → cancelled; expired (past `expires_at`: unfinished lines go to
the error file as `batch_expired`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from api.chat_template import TemplateError as RenderError
from api.chat_template import normalize_messages
from api.db import batches as db_batches
from api.db import files as db_files
from api.db import store
from api.errors import ApiError
from api.files.storage import FileStorage
from api.generation import new_job_id, request_id_of
from api.schemas.openai import ChatCompletionRequest, CompletionRequest
from api.service import job_params
from api.settings import Settings
from api.tokenizer import ModelTokenizer
from api.validated import GenerationParams, ValidatedRequest
from api.validation import chat_params, completion_params, validate_tokens
from batcher.messages import SubmitRequest
from batcher.request import Priority
from batcher.transport.aio import AsyncApiTransport

log = logging.getLogger(__name__)
POLL_S = 0.25


@dataclass(frozen=True, slots=True)
class BatchContext:
    engine: AsyncEngine
    transport: AsyncApiTransport
    storage: FileStorage
    tokenizer: ModelTokenizer
    settings: Settings
    window: int = 256  # at most this many of a batch's requests in the transport at once


async def run_batch(ctx: BatchContext, batch_id: str) -> str:
    """Drives the batch to a terminal status; returns it."""
    batch = await _get(ctx, batch_id)
    if batch.is_finished:
        return batch.status
    if batch.job_id is None and batch.status != "cancelling":
        batch = await _prepare(ctx, batch)
    final_status = await _drive(ctx, batch)
    return await _finalize(ctx, batch_id, final_status)


async def _get(ctx: BatchContext, batch_id: str) -> db_batches.BatchRecord:
    async with ctx.engine.connect() as conn:
        batch = await db_batches.get_batch(conn, batch_id=batch_id)
    if batch is None:
        raise LookupError(f"no batch {batch_id!r}")
    return batch


# --- validating: lines → one job ------------------------------------------------------------


async def _prepare(ctx: BatchContext, batch: db_batches.BatchRecord) -> db_batches.BatchRecord:
    try:
        raw_lines = await _read_lines(ctx, batch.input_file_id)
    except (OSError, LookupError) as error:
        async with ctx.engine.begin() as conn:
            await db_batches.set_status(
                conn, batch_id=batch.id, status="failed", only_from=("validating",),
                error=f"the input file could not be read: {error}",
            )  # fmt: skip
        return await _get(ctx, batch.id)
    job_id = new_job_id()
    lines: list[db_batches.LineRecord] = []
    requests: list[SubmitRequest] = []
    params_seen: GenerationParams | None = None
    for line_index, raw in enumerate(raw_lines):
        custom_id = str(raw.get("custom_id", ""))
        try:
            if raw.get("url") != batch.endpoint:
                raise ValueError(f"url {raw.get('url')!r} is not the batch's {batch.endpoint}")
            validated = await _validate(ctx, batch.endpoint, raw.get("body", {}))
        except (ApiError, RenderError, ValueError) as error:
            message = error.message if isinstance(error, ApiError) else str(error)
            lines.append(db_batches.LineRecord(batch.id, line_index, custom_id, None, message))
            continue
        item_index = len(requests)
        params_seen = params_seen or validated.params
        requests.append(
            SubmitRequest(
                request_id_of(job_id, item_index),
                validated.prompt_token_ids,
                validated.sampling,
                validated.stopping,
                Priority.BULK,
                batch.expires_at.timestamp(),
            )
        )
        lines.append(db_batches.LineRecord(batch.id, line_index, custom_id, item_index, None))
    async with ctx.engine.begin() as conn:
        if requests:
            await store.create_jobs(
                conn,
                jobs=[
                    store.NewJob(
                        job_id=job_id,
                        kind="batch",
                        route=batch.endpoint,
                        priority=int(Priority.BULK),
                        model=ctx.settings.model_id,
                        params=job_params(params_seen) if params_seen else {},
                        items=[(r.request_id, r.prompt_token_ids) for r in requests],
                        api_key_id=batch.api_key_id,
                        deadline=batch.expires_at,
                        metadata={"batch_id": batch.id},
                    )
                ],
            )
        await db_batches.add_lines(conn, lines=lines)
        await db_batches.set_status(
            conn, batch_id=batch.id, status="in_progress", only_from=("validating",),
            job_id=job_id if requests else None, num_total=len(lines),
        )  # fmt: skip
    _built[batch.id] = {r.request_id: r for r in requests}
    return await _get(ctx, batch.id)


# Per batch, its requests as built at validation, kept for the window of this process (a
# restarted runner rebuilds them from the file).
_built: dict[str, dict[str, SubmitRequest]] = {}


async def _read_lines(ctx: BatchContext, file_id: str) -> list[dict[str, Any]]:
    async with ctx.engine.connect() as conn:
        record = await db_files.get_file(conn, file_id=file_id)
    if record is None:
        raise LookupError(f"file {file_id} is gone")
    content = b"".join([chunk async for chunk in ctx.storage.read(record.storage_key)])
    return [json.loads(line) for line in content.splitlines() if line.strip()]


async def _validate(ctx: BatchContext, endpoint: str, body: dict[str, Any]) -> ValidatedRequest:
    """A line's body through the same checks as the interactive route."""
    settings, tokenizer = ctx.settings, ctx.tokenizer
    if endpoint == "/v1/chat/completions":
        chat = ChatCompletionRequest.model_validate(body)
        params = chat_params(chat, settings)
        if tokenizer.chat_template is None:
            raise ValueError("this model has no chat template")
        messages = normalize_messages([m.model_dump(exclude_none=True) for m in chat.messages])
        prompt = await tokenizer.run(tokenizer.chat_template.render, messages)
    else:
        completion = CompletionRequest.model_validate(body)
        params = completion_params(completion, settings)
        if not isinstance(completion.prompt, str):
            raise ValueError("a batch line takes one prompt (a string)")
        prompt = completion.prompt
    if params.num_choices > 1:
        raise ValueError("`n` > 1 is not supported in batches")
    token_ids = await tokenizer.encode(prompt, add_special_tokens=params.add_special_tokens)
    return validate_tokens(
        prompt=prompt, token_ids=token_ids, params=params, settings=settings,
        priority=Priority.BULK, eos_token_ids=tokenizer.eos_token_ids,
    )  # fmt: skip


# --- in_progress: the window ------------------------------------------------------------------


async def _drive(ctx: BatchContext, batch: db_batches.BatchRecord) -> str:
    """Feeds the window until the job ends, the batch is cancelled or it expires."""
    while True:
        batch = await _get(ctx, batch.id)
        if batch.status == "cancelling":
            await _stop_job(ctx, batch)
            return "cancelled"
        if batch.status != "in_progress" or batch.job_id is None:
            return "completed" if batch.status == "in_progress" else batch.status
        if datetime.now(UTC) >= batch.expires_at:
            await _stop_job(ctx, batch)
            return "expired"
        async with ctx.engine.connect() as conn:
            job = await store.get_job(conn, job_id=batch.job_id)
            window = await db_batches.open_items(conn, job_id=batch.job_id, limit=ctx.window)
        assert job is not None
        completed = job.num_items_done - job.num_items_failed
        if (completed, job.num_items_failed) != (batch.num_completed, batch.num_failed):
            async with ctx.engine.begin() as conn:
                await db_batches.set_counts(
                    conn, batch_id=batch.id, completed=completed, failed=job.num_items_failed
                )
        if job.is_finished:
            return "completed"
        missing = await ctx.transport.missing(window)
        if missing:
            await ctx.transport.submit(await _requests_for(ctx, batch, missing))
        await asyncio.sleep(POLL_S)


async def _requests_for(
    ctx: BatchContext, batch: db_batches.BatchRecord, request_ids: list[str]
) -> list[SubmitRequest]:
    built = _built.get(batch.id, {})
    if all(r in built for r in request_ids):
        return [built[r] for r in request_ids]
    # A restarted runner: validate the lines again (same file, same rules, same requests).
    raw_lines = await _read_lines(ctx, batch.input_file_id)
    async with ctx.engine.connect() as conn:
        lines = await db_batches.get_lines(conn, batch_id=batch.id)
    assert batch.job_id is not None
    rebuilt = {}
    for line in lines:
        if line.item_index is None:
            continue
        validated = await _validate(ctx, batch.endpoint, raw_lines[line.line_index]["body"])
        request_id = request_id_of(batch.job_id, line.item_index)
        rebuilt[request_id] = SubmitRequest(
            request_id, validated.prompt_token_ids, validated.sampling, validated.stopping,
            Priority.BULK, batch.expires_at.timestamp(), attempt=2,
        )  # fmt: skip
    _built[batch.id] = rebuilt
    return [rebuilt[r] for r in request_ids]


async def _stop_job(ctx: BatchContext, batch: db_batches.BatchRecord) -> None:
    if batch.job_id is None:
        return
    async with ctx.engine.begin() as conn:
        request_ids = await store.cancel_job(conn, job_id=batch.job_id) or []
    for request_id in request_ids:
        await ctx.transport.abort(request_id, "batch cancelled or expired")


# --- finalizing: the output and error files ---------------------------------------------------


async def _finalize(ctx: BatchContext, batch_id: str, final_status: str) -> str:
    batch = await _get(ctx, batch_id)
    if batch.is_finished:
        return batch.status
    if final_status == "failed" or batch.status == "failed":
        return "failed"
    async with ctx.engine.begin() as conn:
        is_mine = await db_batches.set_status(
            conn, batch_id=batch_id, status="finalizing",
            only_from=("in_progress", "cancelling"),
        )  # fmt: skip
    if not is_mine:  # another runner of this batch is finalizing it
        return (await _get(ctx, batch_id)).status
    async with ctx.engine.connect() as conn:
        lines = await db_batches.get_lines(conn, batch_id=batch_id)
        results = {}
        if batch.job_id is not None:
            results = {r.item_index: r for r in await store.get_results(conn, job_id=batch.job_id)}
    outputs, errors = [], []
    for line in lines:
        result = None if line.item_index is None else results.get(line.item_index)
        if line.error is not None:
            errors.append(_error_line(line, "invalid_request", line.error))
        elif result is not None and result.finish_reason in ("stop", "length"):
            outputs.append(_output_line(ctx, batch, line, result))
        elif final_status == "expired" and (
            result is None or result.finish_reason in ("deadline", "abort")
        ):  # the batcher ends what is still running at `expires_at` itself ("deadline")
            errors.append(_error_line(line, "batch_expired", "the batch expired first"))
        elif result is None or result.finish_reason == "abort":
            errors.append(_error_line(line, "batch_cancelled", "the batch was cancelled first"))
        else:
            errors.append(_error_line(line, result.finish_reason, result.finish_detail or ""))
    output_id = await _write_file(ctx, batch, f"{batch_id}_output.jsonl", outputs)
    error_id = await _write_file(ctx, batch, f"{batch_id}_error.jsonl", errors)
    async with ctx.engine.begin() as conn:
        await db_batches.set_status(
            conn, batch_id=batch_id, status=final_status, only_from=("finalizing",),
            output_file_id=output_id, error_file_id=error_id, num_total=len(lines),
            num_completed=len(outputs), num_failed=len(errors),
        )  # fmt: skip
    _built.pop(batch_id, None)
    return final_status


def _output_line(
    ctx: BatchContext,
    batch: db_batches.BatchRecord,
    line: db_batches.LineRecord,
    result: store.ResultRecord,
) -> dict[str, Any]:
    usage = {
        "prompt_tokens": result.num_prompt_tokens,
        "completion_tokens": result.num_output_tokens,
        "total_tokens": result.num_prompt_tokens + result.num_output_tokens,
    }
    finish_reason = "length" if result.finish_reason == "length" else "stop"
    text = result.text or ""
    created = int(result.created_at.timestamp())
    body: dict[str, Any]
    if batch.endpoint == "/v1/chat/completions":
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
        body = {"id": f"chatcmpl-{result.request_id}", "object": "chat.completion"}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        body = {"id": f"cmpl-{result.request_id}", "object": "text_completion"}
    body.update(created=created, model=ctx.settings.model_id, choices=[choice], usage=usage)
    response = {"status_code": 200, "request_id": result.request_id, "body": body}
    return {"id": _line_id(), "custom_id": line.custom_id, "response": response, "error": None}


def _error_line(line: db_batches.LineRecord, code: str, message: str) -> dict[str, Any]:
    error = {"code": code, "message": message}
    return {"id": _line_id(), "custom_id": line.custom_id, "response": None, "error": error}


def _line_id() -> str:
    return f"batch_req_{secrets.token_hex(12)}"


async def _write_file(
    ctx: BatchContext, batch: db_batches.BatchRecord, filename: str, rows: list[dict[str, Any]]
) -> str | None:
    if not rows:
        return None
    file_id = f"file-{secrets.token_hex(12)}"

    async def chunks() -> AsyncIterator[bytes]:
        for row in rows:
            yield (json.dumps(row, ensure_ascii=False) + "\n").encode()

    num_bytes = await ctx.storage.write(file_id, chunks())
    async with ctx.engine.begin() as conn:
        await db_files.create_file(
            conn, file_id=file_id, purpose="batch_output", filename=filename,
            num_bytes=num_bytes, num_lines=len(rows), storage_key=file_id,
            api_key_id=batch.api_key_id,
        )  # fmt: skip
    return file_id
