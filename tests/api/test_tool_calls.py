"""Tool calls out of the generated text (`api.tool_parsers`, `api.tool_calls`): each `auto`
parser on single and several calls, text around them and malformed input (which stays content);
the forced calls' reader; and the streamed deltas, which fold into the same answer however the
text is split."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tgq.api.schemas.openai import Delta
from tgq.api.tool_calls import ForcedCalls, new_call_id, reply_of, tool_reader
from tgq.api.tool_parsers import FORCED
from tgq.api.validated import GenerationParams
from tgq.gpu_worker.plan import SamplingParams


def _params(parser: str | None, *, parallel: bool = True) -> GenerationParams:
    return GenerationParams(
        sampling=SamplingParams(),
        max_new_tokens=None,
        tool_parser=parser,
        parallel_tool_calls=parallel,
    )


def _reply(parser: str, text: str, **kwargs: Any) -> tuple[str | None, list[tuple[str, Any]]]:
    """(content, [(name, arguments as an object)]) of a finished output."""
    content, calls = reply_of(_params(parser, **kwargs), text)
    return content, [(c.function.name, json.loads(c.function.arguments)) for c in calls or []]


def _streamed(parser: str, pieces: list[str]) -> tuple[list[Delta], list[Delta]]:
    """The deltas while the pieces come, and those at the end."""
    reader = tool_reader(_params(parser))
    assert reader is not None
    during = [delta for piece in pieces for delta in reader.feed(piece)]
    return during, reader.finish()


def _all_deltas(parser: str, pieces: list[str]) -> list[Delta]:
    during, end = _streamed(parser, pieces)
    return during + end


def _folded(deltas: list[Delta]) -> tuple[str | None, list[tuple[str, str]]]:
    content = "".join(d.content for d in deltas if d.content is not None) or None
    calls: dict[int, list[str]] = {}
    for call in (call for d in deltas for call in d.tool_calls or []):
        name, arguments = calls.setdefault(call.index, ["", ""])
        calls[call.index] = [name + (call.function.name or ""), arguments + call.function.arguments]
    return content, [(name, arguments) for name, arguments in calls.values()]


F = '{"name": "f", "arguments": {"x": 1}}'
G = '{"name": "g", "arguments": {}}'
F_LLAMA = '{"name": "f", "parameters": {"x": 1}}'
G_LLAMA = '{"name": "g", "parameters": {}}'
F_CALL: tuple[str, Any] = ("f", {"x": 1})
G_CALL: tuple[str, Any] = ("g", {})


def _as_is(parser: str, text: str) -> tuple[str, str, str, list[Any]]:
    """A case whose output has no call: all of it is content."""
    return parser, text, text, []


CASES: list[tuple[str, str, str | None, list[tuple[str, Any]]]] = [
    # hermes
    ("hermes", f"<tool_call>\n{F}\n</tool_call>", None, [F_CALL]),
    (
        "hermes",
        f"Let me check.\n<tool_call>{F}</tool_call>\n<tool_call>{G}</tool_call>\nDone.",
        "Let me check.\nDone.",
        [F_CALL, G_CALL],
    ),
    ("hermes", f"<tool_call>{F}", None, [F_CALL]),  # stopped before the closing tag
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',
        None,
        [F_CALL],
    ),
    ("hermes", '<tool_call>{"name": "f"}</tool_call>', None, [("f", {})]),
    _as_is("hermes", "no call here"),
    _as_is("hermes", f"<tool_call>{F}</tool_call><tool_call>{{oops</tool_call>"),
    _as_is("hermes", '<tool_call>{"arguments": {}}</tool_call>'),
    _as_is("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),
    _as_is("hermes", "<tool_call>"),
    # llama3_json
    ("llama3_json", F_LLAMA, None, [F_CALL]),
    ("llama3_json", f" <|python_tag|>{F_LLAMA}", None, [F_CALL]),
    ("llama3_json", f"{F_LLAMA}; {G_LLAMA}", None, [F_CALL, G_CALL]),
    ("llama3_json", F, None, [F_CALL]),  # "arguments" as well as "parameters"
    _as_is("llama3_json", f"Sure: {F_LLAMA}"),
    _as_is("llama3_json", f"{F_LLAMA} and more"),
    _as_is("llama3_json", '{"name": "f", "parameters": {"x": '),
    _as_is("llama3_json", '{"answer": 42}'),
    # mistral
    ("mistral", f"[TOOL_CALLS][{F}, {G}]", None, [F_CALL, G_CALL]),
    ("mistral", f"Checking. [TOOL_CALLS][{F}]", "Checking.", [F_CALL]),
    ("mistral", f"[{F}]", None, [F_CALL]),  # the special token decoded away
    _as_is("mistral", f"[{F}] is the call"),
    _as_is("mistral", f"[TOOL_CALLS]{F}"),
    _as_is("mistral", "[TOOL_CALLS][]"),
    _as_is("mistral", "[1] a citation"),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_parsers(parser: str, text: str, content: str | None, calls: list[Any]) -> None:
    assert _reply(parser, text) == (content, calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_streaming_folds_into_the_same_answer(
    parser: str, text: str, content: str | None, calls: list[Any]
) -> None:
    whole = _folded(_all_deltas(parser, [text]))
    for size in (1, 3, 7):
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        assert _folded(_all_deltas(parser, pieces)) == whole
    if not calls:  # no call: the text as it is
        assert whole == (content or None, [])


def test_text_before_a_call_streams_before_the_end() -> None:
    pieces = ["Let me ", "check. ", "\n<tool", "_call>", F, "</tool_call>"]
    during, end = _streamed("hermes", pieces)
    assert [d.content for d in during] == ["Let me", " check."]  # whitespace before it held
    assert end[0].tool_calls is not None and end[0].tool_calls[0].function.name == "f"
    during, end = _streamed("hermes", ["a <", "b"])
    assert [d.content for d in during + end] == ["a", " <b"]


def test_only_the_first_call_without_parallel_calls() -> None:
    text = f"<tool_call>{F}</tool_call><tool_call>{G}</tool_call>"
    assert _reply("hermes", text, parallel=False) == (None, [("f", {"x": 1})])


def test_ids_look_like_openais() -> None:
    ids = {new_call_id() for _ in range(20)}
    assert len(ids) == 20 and all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)
    _, calls = reply_of(_params("hermes"), f"<tool_call>{F}</tool_call>")
    assert calls is not None and re.fullmatch(r"call_[A-Za-z0-9]{24}", calls[0].id)


def test_no_parser_keeps_the_text() -> None:
    assert reply_of(_params(None), "<tool_call>{}</tool_call>") == (
        "<tool_call>{}</tool_call>",
        None,
    )
    assert tool_reader(_params(None)) is None


# --- forced calls ------------------------------------------------------------------------------

WEATHER_ARGUMENTS = '{"unit":"c","note":"a \\"}\\" b"}'  # a string with `"}` in it
FORCED_TEXT = (
    f'[{{"name":"weather","arguments":{WEATHER_ARGUMENTS}}},{{"name":"clock","arguments":{{}}}}]'
)


def test_forced_calls_stream_a_first_delta_then_the_arguments() -> None:
    reader = ForcedCalls()
    deltas = [delta for char in FORCED_TEXT for delta in reader.feed(char)] + reader.finish()
    dumped = [d.model_dump(exclude_none=True)["tool_calls"][0] for d in deltas]
    first = dumped[0]
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", first.pop("id"))
    function = {"name": "weather", "arguments": ""}
    assert first == {"index": 0, "type": "function", "function": function}
    pieces = [d["function"]["arguments"] for d in dumped if d["index"] == 0][1:]
    assert len(pieces) > 1 and "".join(pieces) == WEATHER_ARGUMENTS
    assert [d["function"].get("name") for d in dumped if "id" in d] == ["clock"]
    assert reader.has_calls


def test_forced_calls_fold_the_same_in_one_piece() -> None:
    content, calls = reply_of(_params(FORCED), FORCED_TEXT)
    assert content is None and calls is not None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("weather", {"unit": "c", "note": 'a "}" b'}),
        ("clock", {}),
    ]


def test_forced_calls_cut_short() -> None:
    """By `max_tokens`: before any name the text is content; inside the arguments the call
    keeps what came."""
    assert reply_of(_params(FORCED), '[{"name":"wea') == ('[{"name":"wea', None)
    content, calls = reply_of(_params(FORCED), '[{"name":"weather","arguments":{"unit":"c"')
    assert content is None and calls is not None
    assert calls[0].function.arguments == '{"unit":"c"'


def test_forced_calls_with_the_arguments_first() -> None:
    _, calls = reply_of(_params(FORCED), '[{"arguments":{"a":[1,{"b":2}]},"name":"f"}]')
    assert calls is not None
    assert (calls[0].function.name, calls[0].function.arguments) == ("f", '{"a":[1,{"b":2}]}')
