"""Wire messages: every kind round-trips exactly; garbage and other versions are rejected."""

from __future__ import annotations

import json

import pytest

from tgq.batcher.grammar import GrammarKind, GrammarSpec
from tgq.batcher.messages import (
    VERSION,
    AbortRequest,
    FinalResult,
    Heartbeat,
    Message,
    MessageError,
    SubmitRequest,
    TokenEvent,
    decode,
    encode,
)
from tgq.batcher.request import FinishReason, Priority, StoppingParams
from tgq.gpu_worker.plan import SamplingParams

SUBMIT = SubmitRequest(
    request_id="req-1",
    prompt_token_ids=[1, 2, 3],
    sampling=SamplingParams(temperature=0.7, top_k=5, seed=3, logprobs=True),
    stopping=StoppingParams(
        max_new_tokens=9, eos_token_ids=frozenset({2, 7}), stop_strings=("\n\n",)
    ),
    priority=Priority.BULK,
    deadline=1.9e9,
    attempt=2,
    speculate=False,
    adapter="support-bot",
)
MESSAGES: list[Message] = [
    SUBMIT,
    SubmitRequest(
        request_id="req-2",
        prompt_token_ids=[5],
        sampling=SamplingParams(),
        stopping=StoppingParams(),
    ),
    SubmitRequest(
        request_id="req-3",
        prompt_token_ids=[5],
        sampling=SamplingParams(),
        stopping=StoppingParams(),
        grammar=GrammarSpec(GrammarKind.REGEX, "[0-9]+"),
    ),
    AbortRequest("req-1", "client disconnected"),
    TokenEvent(
        request_id="req-1",
        seq_index=3,
        token_ids=[11, 12],
        logprobs=[-0.5, None],
        text="hé",
        attempt=2,
        created_at=1.7e9,
    ),
    FinalResult(
        request_id="req-1",
        token_ids=[11, 12],
        finish_reason=FinishReason.STOP,
        finish_detail="eos token",
        num_prompt_tokens=3,
        num_output_tokens=2,
        num_cached_tokens=0,
        attempt=1,
        batcher_id="b0",
        text="hé",
    ),
    FinalResult(
        request_id="req-1",
        token_ids=[],
        finish_reason=FinishReason.FAILED,
        finish_detail=None,
        num_prompt_tokens=3,
        num_output_tokens=0,
        num_cached_tokens=0,
        attempt=3,
        batcher_id="b1",
    ),
    Heartbeat(
        batcher_id="b0",
        num_running=3,
        num_waiting=4,
        num_free_blocks=100,
        max_batch_size=32,
        time=1.7e9,
    ),
    Heartbeat(
        batcher_id="b1",
        num_running=1,
        num_waiting=0,
        num_free_blocks=90,
        max_batch_size=8,
        time=1.7e9,
        num_usable_blocks=100,
        num_prefix_query_tokens=40,
        num_prefix_hit_tokens=16,
        num_steps=12,
        num_step_tokens=400,
        max_step_tokens=64,
        grammar_compiles=[0, 3, 1],
        grammar_compile_seconds=0.01,
        num_grammar_failures=1,
        num_grammar_cache_hits=6,
        num_grammar_masks=80,
        grammar_mask_seconds=0.02,
        num_grammar_argmax_checks=300,
        num_grammar_argmax_misses=4,
        weight_bytes=115_343_360,
        kv_block_size=16,
        num_spec_proposed=90,
        num_spec_accepted=50,
        num_spec_verified=30,
        spec_acceptance=[10, 0, 0, 0, 0, 5, 0, 0, 0, 0, 15],
        spec_acceptance_sum=17.5,
    ),  # every field
    SubmitRequest(
        request_id="req-3",
        prompt_token_ids=[5],
        sampling=SamplingParams(min_p=0.1, min_tokens=3, min_tokens_stop_ids=(2, 7)),
        stopping=StoppingParams(),
    ),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message: Message) -> None:
    data = encode(message)
    assert isinstance(data, bytes)
    assert decode(data) == message
    assert decode(data.decode()) == message


def test_the_frame_carries_version_and_kind() -> None:
    frame = json.loads(encode(SUBMIT))
    assert frame["v"] == VERSION
    assert frame["type"] == "submit"
    assert frame["body"]["stopping"]["eos_token_ids"] == [2, 7]


def _frame(**changes: object) -> bytes:
    frame = json.loads(encode(SUBMIT))
    frame.update(changes)
    return json.dumps(frame).encode()


def _body(**changes: object) -> bytes:
    frame = json.loads(encode(SUBMIT))
    frame["body"].update(changes)
    return json.dumps(frame).encode()


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"\x80\x04garbage", "not a JSON message frame"),
        (b"[1, 2]", "a message frame is an object"),
        (b"{}", "a message frame is an object"),
        (_frame(v=2), "unsupported message version 2 \\(this is 1\\)"),
        (_frame(v=None), "unsupported message version None"),
        (_frame(type="launch"), "unknown message type 'launch'"),
        (_body(request_id=7), "field 'request_id' has the wrong type: 7"),
        (_body(prompt_token_ids=[1, "2"]), "'prompt_token_ids' must be a list of integers"),
        (_body(prompt_token_ids=[True]), "'prompt_token_ids' must be a list of integers"),
        (_body(attempt=True), "field 'attempt' has the wrong type"),
        (_body(priority=9), "malformed submit message"),
        (_body(sampling={"temperature": -1.0}), "malformed submit message.*temperature"),
        (_body(sampling={"evil": 1}), "unknown sampling fields \\['evil'\\]"),
        (_body(stopping={"max_new_tokens": 3}), "missing field 'eos_token_ids'"),
        (_body(deadline="soon"), "field 'deadline' has the wrong type"),
        (_body(grammar={"kind": "regex"}), "a grammar is \\{'kind', 'value'\\}"),
        (_body(grammar={"kind": "ebnf", "value": "x"}), "malformed submit message.*'ebnf'"),
        (_body(grammar={"kind": "regex", "value": 3}), "a grammar's value is a string"),
    ],
)
def test_garbage_is_rejected_with_a_reason(data: bytes, match: str) -> None:
    with pytest.raises(MessageError, match=match):
        decode(data)


def test_a_missing_field_is_named() -> None:
    frame = json.loads(encode(MESSAGES[4]))
    del frame["body"]["seq_index"]
    with pytest.raises(MessageError, match="missing field 'seq_index'"):
        decode(json.dumps(frame))
