"""Log lines (`batcher.logs`): JSON objects with the fixed keys, the request id from `extra=` or
from the api's context; the human format as before, plus the request id. And the submit
message's request id and trace context, optional on the wire."""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timedelta

import pytest

from tgq.batcher.logs import HumanFormatter, JsonFormatter, current_request_id
from tgq.batcher.messages import MessageError, SubmitRequest, decode, encode
from tgq.batcher.request import StoppingParams
from tgq.gpu_worker.plan import SamplingParams


def record(message: str = "request %s pulled", *args: object, **extra: object) -> logging.LogRecord:
    logger = logging.getLogger("batcher.serving")
    return logger.makeRecord(
        logger.name, logging.INFO, __file__, 1, message, args, None, extra=extra
    )


def test_a_json_line_has_the_fixed_keys_then_the_extra_fields() -> None:
    line = JsonFormatter().format(
        record("request %s pulled", "job_1.0", request_id="r-1", item_id="job_1.0")
    )
    fields = json.loads(line)
    assert list(fields)[:5] == ["timestamp", "level", "target", "message", "request_id"]
    assert fields["level"] == "INFO"
    assert fields["target"] == "batcher.serving"
    assert fields["message"] == "request job_1.0 pulled"
    assert fields["request_id"] == "r-1"
    assert fields["item_id"] == "job_1.0"
    assert fields["timestamp"].endswith("Z")
    moment = datetime.fromisoformat(fields["timestamp"])
    assert moment.utcoffset() == timedelta(0)
    assert "\n" not in line


def test_the_request_id_comes_from_the_context_when_not_given() -> None:
    token = current_request_id.set("from-context")
    try:
        assert json.loads(JsonFormatter().format(record()))["request_id"] == "from-context"
        explicit = JsonFormatter().format(record(request_id="explicit"))
        assert json.loads(explicit)["request_id"] == "explicit"
    finally:
        current_request_id.reset(token)
    assert "request_id" not in json.loads(JsonFormatter().format(record()))


def test_an_exception_is_one_string_field() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        logger = logging.getLogger("api")
        failed = logger.makeRecord("api", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    fields = json.loads(JsonFormatter().format(failed))
    assert fields["level"] == "ERROR"
    assert fields["exception"].startswith("Traceback")
    assert "ValueError: boom" in fields["exception"]


def test_fields_json_cannot_encode_are_strings_and_fixed_keys_win() -> None:
    fields = json.loads(JsonFormatter().format(record(level="forged", when=datetime(2026, 1, 2))))
    assert fields["level"] == "INFO"
    assert fields["when"] == "2026-01-02 00:00:00"


def test_the_human_format_is_unchanged_without_a_request_id() -> None:
    pulled = record("request %s pulled", "job_1.0")
    plain = HumanFormatter().format(pulled)
    assert plain.endswith(" batcher.serving request job_1.0 pulled")
    pulled.request_id = "r-1"
    assert HumanFormatter().format(pulled) == plain + " request_id=r-1"


def submit(http_request_id: str = "", traceparent: str = "") -> SubmitRequest:
    return SubmitRequest(
        request_id="job_1.0",
        prompt_token_ids=[1, 2],
        sampling=SamplingParams(),
        stopping=StoppingParams(),
        http_request_id=http_request_id,
        traceparent=traceparent,
    )


def test_the_submit_message_carries_request_id_and_traceparent() -> None:
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    sent = submit(http_request_id="r-1", traceparent=traceparent)
    assert decode(encode(sent)) == sent


def test_a_submit_message_without_them_still_decodes() -> None:
    """Messages of api replicas older than these fields (same version 1)."""
    frame = json.loads(encode(submit()))
    del frame["body"]["http_request_id"], frame["body"]["traceparent"]
    received = decode(json.dumps(frame))
    assert isinstance(received, SubmitRequest)
    assert (received.http_request_id, received.traceparent) == ("", "")


def test_a_request_id_of_the_wrong_type_is_rejected() -> None:
    frame = json.loads(encode(submit()))
    frame["body"]["http_request_id"] = 7
    with pytest.raises(MessageError, match="field 'http_request_id' has the wrong type"):
        decode(json.dumps(frame))
