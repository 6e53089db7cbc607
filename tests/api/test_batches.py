"""The Batches API through the unmodified `openai` SDK against the real stack (api process,
Postgres, Redis, a batcher process): files.create → batches.create → poll → output and error
files; cancel mid-batch; expiry."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import jsonschema_rs
import openai
import pytest
from sqlalchemy import text

from tests.api.stack import BLOCK_SIZE, Stack, migrated_database, running, running_stack
from tgq.api.db import create_engine

pytestmark = pytest.mark.timeout(300)
CHAT: Literal["/v1/chat/completions"] = "/v1/chat/completions"


@pytest.fixture(scope="module")
def stack(text_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The stack with a Celery worker: batches run on it (`BATCH_RUNNER=auto` with Redis)."""
    log_dir = tmp_path_factory.mktemp("logs")
    with running_stack(text_model_dir, log_dir, celery_worker=True) as running:
        yield running


def line(custom_id: str, url: str = CHAT, **body: Any) -> str:
    if url == CHAT:
        body = {"messages": [{"role": "user", "content": f"hi {custom_id}"}], **body}
    else:
        body = {"prompt": f"say {custom_id}", **body}
    request = {"custom_id": custom_id, "method": "POST", "url": url, "body": body}
    return json.dumps(request)


def sdk(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", timeout=60)


def wait(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...], timeout_s: float = 120):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.2)
    raise TimeoutError(f"batch {batch_id} stayed {batch.status}")


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(row) for row in client.files.content(file_id).content.splitlines()]


def test_the_openai_sdk_flow(stack: Stack) -> None:
    client = sdk(stack)
    rows = [line(f"req-{i}", max_tokens=4) for i in range(20)]
    rows.append(line("bad", messages=[], max_tokens=4))  # fails validation: an error line
    uploaded = client.files.create(file=("in.jsonl", "\n".join(rows).encode()), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h", metadata={"k": "v"}
    )
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"k": "v"}
    done = wait(client, batch.id, ("completed", "failed"))
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed) == (21, 20)
    assert done.request_counts.failed == 1
    outputs, errors = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    custom_ids = [row["custom_id"] for row in outputs + errors]
    assert sorted(custom_ids) == sorted([f"req-{i}" for i in range(20)] + ["bad"])
    for row in outputs:
        body = row["response"]["body"]
        assert row["response"]["status_code"] == 200 and row["error"] is None
        assert body["object"] == "chat.completion"
        assert isinstance(body["choices"][0]["message"]["content"], str)
        assert body["usage"]["completion_tokens"] <= 4
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] % BLOCK_SIZE == 0
    (bad,) = errors
    assert bad["custom_id"] == "bad" and bad["response"] is None
    assert "`messages` cannot be empty" in bad["error"]["message"]
    listed = client.batches.list(limit=5)
    assert batch.id in [b.id for b in listed.data]
    assert "Task tgq.run_batch[" in stack.worker_log()  # it ran on the Celery worker


CONTRACT = {
    "type": "object",
    "properties": {
        "parties": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "role": {"enum": ["buyer", "seller", "agent"]},
                },
                "required": ["name", "role"],
            },
            "minItems": 1,
            "maxItems": 2,
        },
        "amount": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "currency": {"enum": ["EUR", "USD", "GBP"]},
        "signed": {"type": "boolean"},
    },
    "required": ["parties", "amount", "currency", "signed"],
}


def test_a_thousand_line_extraction_batch_all_follows_its_schema(stack: Stack) -> None:
    """Every output of a 1,000-line batch with one JSON schema, sampled, parses and validates;
    a line whose schema cannot compile is in the error file with the reason, and only it."""
    client = sdk(stack)
    response_format = {"type": "json_schema", "json_schema": {"name": "c", "schema": CONTRACT}}
    rows = [
        line(f"c{i}", response_format=response_format, max_tokens=120, temperature=1.0, seed=i)
        for i in range(1000)
    ]
    bad_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}
    rows.insert(500, line("bad-schema", response_format=bad_format, max_tokens=8))
    uploaded = client.files.create(file=("in.jsonl", "\n".join(rows).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    done = wait(client, batch.id, ("completed", "failed"), timeout_s=280)
    assert done.status == "completed", done
    outputs, errors = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    assert len(outputs) == 1000
    validator = jsonschema_rs.validator_for(CONTRACT)
    for row in outputs:
        choice = row["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "stop", row
        assert validator.is_valid(json.loads(choice["message"]["content"])), row
    (bad,) = errors
    assert bad["custom_id"] == "bad-schema"
    assert bad["error"]["message"] == (
        "`response_format.json_schema.schema` is not valid: invalid json_schema: "
        "Invalid type: strin"
    )


def test_cancel_mid_batch_keeps_what_finished(text_model_dir: Path, tmp_path: Path) -> None:
    """Its own stack with BATCH_WINDOW 2: the lines run two at a time, so the batch is still
    running when its first result is counted (with all 30 in flight at once, a CI run finished
    every line before the first count showed, and the cancel met a batch already finalizing)."""
    with (
        migrated_database() as url,
        running(
            Stack(text_model_dir, url, tmp_path, api_env={"BATCH_WINDOW": "2"}),
            celery_worker=True,
        ) as stack,
    ):
        cancel_mid_batch(stack)


def cancel_mid_batch(stack: Stack) -> None:
    client = sdk(stack)
    # Lines of 10 to 358 tokens: they finish one after another, and together they fit the test
    # batcher's KV blocks (no preemption churn).
    rows = [line(f"c-{i}", max_tokens=10 + 12 * i, ignore_eos=True) for i in range(30)]
    uploaded = client.files.create(file=("c.jsonl", "\n".join(rows).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    deadline = time.monotonic() + 120
    while (counts := client.batches.retrieve(batch.id).request_counts) is None or (
        counts.completed == 0
    ):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    cancelling = client.batches.cancel(batch.id)
    acknowledged = datetime.now(UTC)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait(client, batch.id, ("cancelled",))
    assert done.request_counts is not None
    outputs, errors = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    assert 1 <= len(outputs) == done.request_counts.completed < 30
    assert len(outputs) + len(errors) == 30 == done.request_counts.total
    assert {row["error"]["code"] for row in errors} == {"batch_cancelled"}
    assert sorted(row["custom_id"] for row in outputs + errors) == sorted(
        f"c-{i}" for i in range(30)
    )
    assert asyncio.run(results_after(stack.database_url, batch.id, acknowledged)) == 0


async def results_after(database_url: str, batch_id: str, moment: datetime) -> int:
    """The batch's successful results recorded after `moment`."""
    engine = create_engine(database_url)
    async with engine.connect() as conn:
        count = await conn.scalar(
            text(
                "SELECT count(*) FROM results r JOIN batches b ON b.job_id = r.job_id"
                " WHERE b.id = :b AND r.created_at > :t AND r.finish_reason IN ('stop', 'length')"
            ),
            {"b": batch_id, "t": moment},
        )
    await engine.dispose()
    return int(count or 0)


def test_a_batch_past_its_window_expires(stack: Stack) -> None:
    client = sdk(stack)
    rows = [
        line(f"e-{i}", url="/v1/completions", max_tokens=500, ignore_eos=True) for i in range(60)
    ]
    uploaded = client.files.create(file=("e.jsonl", "\n".join(rows).encode()), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/completions",
        completion_window="2s",  # type: ignore[arg-type]  # tgq takes any window
    )
    done = wait(client, batch.id, ("expired",), timeout_s=60)
    assert done.request_counts is not None
    outputs, errors = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    assert len(outputs) + len(errors) == 60 == done.request_counts.total
    assert len(outputs) == done.request_counts.completed
    assert "batch_expired" in {row["error"]["code"] for row in errors}


def test_bad_batch_requests(stack: Stack) -> None:
    client = sdk(stack)
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint=CHAT, completion_window="24h")
    uploaded = client.files.create(file=("x.jsonl", line("x").encode()), purpose="batch")
    with pytest.raises(openai.UnprocessableEntityError, match="endpoint must be one of"):
        client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/embeddings",
            completion_window="24h",
        )
    with pytest.raises(openai.UnprocessableEntityError, match="completion_window must be like"):
        client.batches.create(
            input_file_id=uploaded.id,
            endpoint=CHAT,
            completion_window="soon",  # type: ignore[arg-type]
        )
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
