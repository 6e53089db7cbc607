"""Tool calls out of a chat choice's text, as OpenAI's stream deltas and `message.tool_calls`.

A `ToolCallReader` takes the text as it comes (`feed`) and at the end (`finish`), and returns
the deltas to send: content, and per call a first delta `{"index", "id", "type": "function",
"function": {"name", "arguments": ""}}` then `{"index", "function": {"arguments": <piece>}}`.
The answer without streaming is the same deltas folded (`reply_of`), so both always agree.

- Forced calls (`tool_choice` `required` or named; `api.tools`): the output is the JSON array
  the grammar allows, `[{"name":...,"arguments":...},...]`. A call's first delta goes once its
  name is read, its arguments as they come. An output cut (`max_tokens`) before any name keeps
  its text as content; one cut inside the arguments keeps what came, as OpenAI does.
- Parsed calls (`auto`; `api.tool_parsers`): text before a call's start marker streams as
  content (whitespace just before it held back); from the marker on the text is held until the
  end, then the calls come whole, and the text after them (stripped; after a newline when
  content came before) as content. An output with no call, or with a malformed one, is all
  content, as it came. With `parallel_tool_calls: false` only the first call is kept.
"""

from __future__ import annotations

import json
import secrets
import string
from typing import Protocol

from tgq.api.schemas.openai import Delta, DeltaFunction, DeltaToolCall, FunctionCall, ToolCall
from tgq.api.tool_parsers import FORCED, ToolCallParser, parser_of
from tgq.api.validated import GenerationParams

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """`call_` and 24 random letters and digits, as OpenAI's ids look."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


class ToolCallReader(Protocol):
    @property
    def has_calls(self) -> bool: ...

    def feed(self, text: str) -> list[Delta]: ...

    def finish(self) -> list[Delta]: ...


def tool_reader(params: GenerationParams) -> ToolCallReader | None:
    """The reader of a choice's text; None when the request reads no tool calls."""
    if params.tool_parser is None:
        return None
    if params.tool_parser == FORCED:
        return ForcedCalls()
    return ParsedCalls(parser_of(params.tool_parser), parallel=params.parallel_tool_calls)


def reply_of(params: GenerationParams, text: str) -> tuple[str | None, list[ToolCall] | None]:
    """A finished choice's `content` and `tool_calls`: with calls, content is null when empty;
    without, the text as it is."""
    reader = tool_reader(params)
    if reader is None:
        return text, None
    deltas = reader.feed(text) + reader.finish()
    content = "".join(delta.content for delta in deltas if delta.content is not None)
    calls: dict[int, ToolCall] = {}
    for call in (call for delta in deltas for call in delta.tool_calls or []):
        if call.index not in calls:
            function = FunctionCall(name=call.function.name or "", arguments="")
            calls[call.index] = ToolCall(id=call.id or new_call_id(), function=function)
        calls[call.index].function.arguments += call.function.arguments
    if not calls:
        return content, None
    return content or None, [calls[index] for index in sorted(calls)]


def with_tool_calls(reason: str, *, has_calls: bool) -> str:
    """A choice's `finish_reason`: `tool_calls` where it has calls and its output ended by
    itself (`stop`); otherwise `reason` as it is (`length` stays)."""
    return "tool_calls" if has_calls and reason == "stop" else reason


def _first_delta(index: int, name: str) -> Delta:
    function = DeltaFunction(name=name, arguments="")
    call = DeltaToolCall(index=index, id=new_call_id(), type="function", function=function)
    return Delta(tool_calls=[call])


def _arguments_delta(index: int, arguments: str) -> Delta:
    call = DeltaToolCall(index=index, function=DeltaFunction(arguments=arguments))
    return Delta(tool_calls=[call])


# (call index, its name for its first delta or None, a piece of its arguments)
_Event = tuple[int, str | None, str]


def _deltas(events: list[_Event]) -> list[Delta]:
    """The events as deltas, the argument pieces of one call in a row joined."""
    deltas: list[Delta] = []
    for index, name, piece in events:
        if name is not None:
            deltas.append(_first_delta(index, name))
            continue
        last = deltas[-1].tool_calls if deltas else None
        if last and last[0].index == index and last[0].function.name is None:
            last[0].function.arguments += piece
        else:
            deltas.append(_arguments_delta(index, piece))
    return deltas


class ForcedCalls:
    """Reads `[{"name":"f","arguments":{...}},...]` a character at a time, tracking JSON strings
    and depth: the array is depth 1, a call object depth 2."""

    def __init__(self) -> None:
        self.text = ""
        self.num_calls = 0
        self._depth = 0
        self._in_string = self._escaped = False
        self._key: str | None = None  # the call object's key whose value comes next
        self._token: str | None = None  # a key or the name being read, as JSON text
        self._in_arguments = False
        self._named = False  # the current call's first delta has gone
        self._pending = ""  # arguments read before their call's name (keys in another order)

    @property
    def has_calls(self) -> bool:
        return self.num_calls > 0

    def feed(self, text: str) -> list[Delta]:
        self.text += text
        events: list[_Event] = []
        for char in text:
            self._read(char, events)
        return _deltas(events)

    def finish(self) -> list[Delta]:
        if self.has_calls or not self.text:
            return []
        return [Delta(content=self.text)]

    def _read(self, char: str, events: list[_Event]) -> None:
        if self._in_arguments:
            if self._in_string or self._depth != 2 or char not in ",}":
                self._track(char)
                if self._named:
                    events.append((self.num_calls - 1, None, char))
                else:
                    self._pending += char
                return
            self._in_arguments = False  # the value ended: `char` ends the call or its key
        if self._in_string:
            self._track(char)
            if self._token is not None:
                self._token += char
                if not self._in_string:
                    self._token_read(json.loads(self._token), events)
            return
        if char == '"' and self._depth == 2 and self._key in (None, "name"):
            self._token = char
        self._track(char)
        if self._depth == 2 and char == "{":
            self._key, self._named, self._pending = None, False, ""
        elif self._depth == 2 and char == ":" and self._key == "arguments":
            self._in_arguments = True
        elif self._depth == 2 and char == ",":
            self._key = None

    def _token_read(self, value: str, events: list[_Event]) -> None:
        self._token = None
        if self._key is None:
            self._key = value
            return
        events.append((self.num_calls, value, ""))
        self.num_calls += 1
        self._named = True
        if self._pending:
            events.append((self.num_calls - 1, None, self._pending))
            self._pending = ""

    def _track(self, char: str) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
        elif char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1


class ParsedCalls:
    def __init__(self, parser: ToolCallParser, *, parallel: bool) -> None:
        self.parser = parser
        self.parallel = parallel
        self.text = ""
        self.num_emitted = 0  # characters of `text` sent as content
        self.num_calls = 0

    @property
    def has_calls(self) -> bool:
        return self.num_calls > 0

    def feed(self, text: str) -> list[Delta]:
        self.text += text
        visible = self.text[: self.parser.hold_from(self.text)]
        end = len(visible.rstrip())
        if end <= self.num_emitted:
            return []
        content, self.num_emitted = self.text[self.num_emitted : end], end
        return [Delta(content=content)]

    def finish(self) -> list[Delta]:
        parsed = self.parser.parse(self.text)
        if parsed is None or parsed.start < self.num_emitted:
            rest = self.text[self.num_emitted :]
            return [Delta(content=rest)] if rest else []
        deltas = []
        before = self.text[self.num_emitted : parsed.start].rstrip()
        if before:
            deltas.append(Delta(content=before))
        if parsed.after:
            has_content = self.num_emitted > 0 or bool(before)
            deltas.append(Delta(content=("\n" if has_content else "") + parsed.after))
        calls = parsed.calls if self.parallel else parsed.calls[:1]
        for index, call in enumerate(calls):
            deltas += [_first_delta(index, call.name), _arguments_delta(index, call.arguments)]
        self.num_calls = len(calls)
        return deltas
