"""`finalizing`: the output file, then the error file, written a chunk of lines at a time; the
files have ids of the batch's own, so a redone finalizing replaces them. A chat line's output is
read for tool calls as its item's parameters say (`api.tool_calls`), as the chat route does."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from tgq.api.db import batches as db_batches
from tgq.api.db import files as db_files
from tgq.api.db import store
from tgq.api.submit import recorded_params
from tgq.api.tool_calls import reply_of, with_tool_calls
from tgq.api.validated import GenerationParams
from tgq.batcher.request import FinishReason
from tgq.bulk.batches.context import BatchContext, get_batch
from tgq.bulk.batches.lease import BatchLease


@dataclass
class _Tally:
    num_lines: int = 0
    num_outputs: int = 0
    num_errors: int = 0


async def finalize(ctx: BatchContext, batch_id: str, lease: BatchLease) -> None:
    """Writes the output file, then the error file, a chunk of lines at a time, and ends the
    batch in the status recorded when it entered `finalizing`."""
    batch = await get_batch(ctx, batch_id)
    outcome = batch.finalizing_to or "completed"
    tally = _Tally()

    async def rows(want_output: bool) -> AsyncIterator[bytes]:
        first = 0
        while True:
            await lease.renew()
            async with ctx.db.connect() as conn:
                lines = await db_batches.get_lines(
                    conn, batch_id=batch_id, first=first, limit=ctx.chunk_lines
                )
                indexes = [line.item_index for line in lines if line.item_index is not None]
                results, params = {}, {}
                if batch.job_id is not None and indexes:
                    found = await store.get_results(conn, job_id=batch.job_id, item_indexes=indexes)
                    results = {result.item_index: result for result in found}
                    params = await _item_params(conn, batch, indexes)
            if not lines:
                return
            for line in lines:
                result = None if line.item_index is None else results.get(line.item_index)
                item_params = None if line.item_index is None else params.get(line.item_index)
                is_output, row = _line_of(ctx, batch, line, result, item_params, outcome)
                if is_output == want_output:
                    yield (json.dumps(row, ensure_ascii=False) + "\n").encode()
                if want_output:
                    tally.num_lines += 1
                    tally.num_outputs += is_output
                else:
                    tally.num_errors += not is_output
            first = lines[-1].line_index + 1

    output_id = await _write_file(ctx, batch, "output", rows(want_output=True))
    error_id = await _write_file(ctx, batch, "error", rows(want_output=False))
    async with ctx.db.begin() as conn:
        await db_batches.set_status(
            conn, batch_id=batch_id, status=outcome, only_from=("finalizing",),
            output_file_id=output_id, error_file_id=error_id, num_total=tally.num_lines,
            num_completed=tally.num_outputs, num_failed=tally.num_errors,
        )  # fmt: skip


async def _item_params(
    conn: AsyncConnection, batch: db_batches.BatchRecord, indexes: list[int]
) -> dict[int, GenerationParams]:
    """The items' parameters, which a chat line's output needs (its tool calls)."""
    if batch.endpoint != "/v1/chat/completions" or batch.job_id is None:
        return {}
    items = await store.get_items(conn, job_id=batch.job_id, item_indexes=indexes)
    return {item.item_index: recorded_params(item.params or {}) for item in items}


def _line_of(
    ctx: BatchContext,
    batch: db_batches.BatchRecord,
    line: db_batches.LineRecord,
    result: store.ResultRecord | None,
    params: GenerationParams | None,
    outcome: str,
) -> tuple[bool, dict[str, Any]]:
    """The line's row, and whether it goes to the output file (else the error file)."""
    if line.error is not None:
        return False, _error_line(line, "invalid_request", line.error)
    if result is not None and result.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
        return True, _output_line(ctx, batch, line, result, params)
    if outcome == "expired" and (
        result is None or result.finish_reason in (FinishReason.DEADLINE, FinishReason.ABORT)
    ):
        # the batcher ends what is still running at `expires_at` itself ("deadline")
        return False, _error_line(line, "batch_expired", "the batch expired first")
    if result is None or result.finish_reason == FinishReason.ABORT:
        return False, _error_line(line, "batch_cancelled", "the batch was cancelled first")
    return False, _error_line(line, result.finish_reason, result.finish_detail or "")


def _output_line(
    ctx: BatchContext,
    batch: db_batches.BatchRecord,
    line: db_batches.LineRecord,
    result: store.ResultRecord,
    params: GenerationParams | None,
) -> dict[str, Any]:
    usage = {
        "prompt_tokens": result.num_prompt_tokens,
        "completion_tokens": result.num_output_tokens,
        "total_tokens": result.num_prompt_tokens + result.num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": result.num_cached_tokens},
    }
    finish_reason = "length" if result.finish_reason == FinishReason.LENGTH else "stop"
    text = result.text or ""
    created = int(result.created_at.timestamp())
    body: dict[str, Any]
    if batch.endpoint == "/v1/chat/completions":
        content, tool_calls = (text, None) if params is None else reply_of(params, text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls is not None:
            message["tool_calls"] = [call.model_dump() for call in tool_calls]
        finish_reason = with_tool_calls(finish_reason, has_calls=tool_calls is not None)
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
        body = {"id": f"chatcmpl-{result.request_id}", "object": "chat.completion"}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        body = {"id": f"cmpl-{result.request_id}", "object": "text_completion"}
    body.update(created=created, model=ctx.settings.model_id, choices=[choice], usage=usage)
    response = {"status_code": 200, "request_id": result.request_id, "body": body}
    return {"id": _line_id(line), "custom_id": line.custom_id, "response": response, "error": None}


def _error_line(line: db_batches.LineRecord, code: str, message: str) -> dict[str, Any]:
    error = {"code": code, "message": message}
    return {"id": _line_id(line), "custom_id": line.custom_id, "response": None, "error": error}


def _line_id(line: db_batches.LineRecord) -> str:
    """The line's id in the output: the same when finalizing is redone."""
    return f"batch_req_{line.batch_id.removeprefix('batch_')}_{line.line_index}"


async def _write_file(
    ctx: BatchContext, batch: db_batches.BatchRecord, kind: str, rows: AsyncIterator[bytes]
) -> str | None:
    """Streams the rows to the batch's `kind` file; its id, or None when there were no rows.
    The id is the batch's own, so a redone finalizing replaces the file."""
    file_id = f"file-{kind}-{batch.id.removeprefix('batch_')}"
    num_lines = 0

    async def counted() -> AsyncIterator[bytes]:
        nonlocal num_lines
        async for row in rows:
            num_lines += 1
            yield row

    num_bytes = await ctx.storage.write(file_id, counted())
    if num_lines == 0:
        await ctx.storage.delete(file_id)
        return None
    async with ctx.db.begin() as conn:
        await db_files.purge_file(conn, file_id=file_id)
        await db_files.create_file(
            conn, file_id=file_id, purpose="batch_output", filename=f"{batch.id}_{kind}.jsonl",
            num_bytes=num_bytes, num_lines=num_lines, storage_key=file_id,
            api_key_id=batch.api_key_id,
        )  # fmt: skip
    return file_id
