"""Tool calling in batches: a chat line's tools go through the same checks as the interactive
route (the calls' grammar recorded with its item), and its output line carries the calls read
from the result, as `/v1/chat/completions` answers them."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from tests.bulk.test_batch_driver import (
    CHAT,
    _status_is,
    context,
    get,
    new_batch,
    wait_for,
)
from tgq.api.db import store
from tgq.api.submit import recorded_params
from tgq.api.tool_parsers import FORCED
from tgq.batcher.grammar import GrammarKind
from tgq.bulk.batches.context import BatchContext
from tgq.bulk.batches.driver import run_batch

__all__ = ["context"]  # the fixture
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"days": {"type": "integer"}}},
    },
}
CALLS_TEXT = '[{"name":"weather","arguments":{"days":3}}]'


def _line(custom_id: str, **body: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Weather in Bern?"}]
    body = {"messages": messages, "tools": [WEATHER], **body}
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}


def test_a_batch_line_with_forced_calls(context: BatchContext) -> None:
    rows = [
        _line("required", tool_choice="required"),
        _line("auto"),
        _line("both", tool_choice="required", response_format={"type": "json_object"}),
    ]
    content = "\n".join(json.dumps(row) for row in rows).encode()

    async def main() -> list[dict[str, Any]]:
        batch_id = await new_batch(context, len(rows), content)
        runner = asyncio.create_task(run_batch(context, batch_id))
        await wait_for(lambda: _status_is(context, batch_id, "in_progress"))
        job_id = (await get(context, batch_id)).job_id
        assert job_id is not None
        async with context.db.begin() as conn:
            items = await store.get_items(conn, job_id=job_id)
            required, auto = (recorded_params(item.params or {}) for item in items)
            assert required.tool_parser == FORCED and required.grammar is not None
            assert required.grammar.kind is GrammarKind.JSON_SCHEMA
            assert (auto.tool_parser, auto.grammar) == ("hermes", None)
            await store.record_results(
                conn,
                results=[
                    store.NewResult(
                        job_id=job_id, item_index=item.item_index, request_id=item.request_id,
                        text=CALLS_TEXT, token_ids=[5], logprobs=None, finish_reason="stop",
                        finish_detail=None, num_prompt_tokens=len(item.prompt_token_ids),
                        num_output_tokens=1, num_cached_tokens=0, attempt=1, batcher_id="b0",
                    )
                    for item in items
                ],
            )  # fmt: skip
        assert await asyncio.wait_for(runner, 10) == "completed"
        done = await get(context, batch_id)
        output = b"".join([c async for c in context.storage.read(done.output_file_id or "")])
        errors = b"".join([c async for c in context.storage.read(done.error_file_id or "")])
        lines = [json.loads(row) for row in (output + errors).splitlines()]
        return sorted(lines, key=lambda line: line["custom_id"])

    auto, both, required = asyncio.run(main())
    choice = required["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"].pop("tool_calls")
    assert choice["message"] == {"role": "assistant", "content": None}
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", call.pop("id"))
    assert call == {"type": "function", "function": {"name": "weather", "arguments": '{"days":3}'}}
    # `auto` reads Hermes' format: this text has no call, it is the content
    auto_choice = auto["response"]["body"]["choices"][0]
    assert auto_choice["message"] == {"role": "assistant", "content": CALLS_TEXT}
    assert auto_choice["finish_reason"] == "stop"
    assert both["error"]["message"] == (
        '`response_format` cannot be used with `tool_choice` "required" or a named function: '
        "the tool calls' schema constrains the output"
    )
