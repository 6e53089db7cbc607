"""A batch input file, checked line by line as its bytes arrive (`BatchInputChecker`): what
`POST /v1/files` with `purpose=batch` accepts."""

from __future__ import annotations

import json

from tgq.api.errors import PayloadTooLargeError, ValidationError

BATCH_URLS = ("/v1/chat/completions", "/v1/completions")
EMPTY_FILE_MESSAGE = "File is empty: a batch input file needs at least one request line"


class BatchInputChecker:
    """Checks a batch input file as its bytes arrive: every line one request
    `{"custom_id": str, "method": "POST", "url": <a BATCH_URL>, "body": {...}}`, custom ids
    unique, at most `max_lines` lines and `max_bytes` bytes. Lines are numbered from 1; a
    final newline ends the last line, it does not start another."""

    def __init__(self, *, max_bytes: int, max_lines: int) -> None:
        self.max_bytes = max_bytes
        self.max_lines = max_lines
        self.num_bytes = 0
        self.num_lines = 0
        self._partial = bytearray()  # the line being received
        self._first_lines: dict[str, int] = {}  # custom_id -> the line it is on

    def feed(self, chunk: bytes) -> None:
        self.num_bytes += len(chunk)
        if self.num_bytes > self.max_bytes:
            raise PayloadTooLargeError(f"File is larger than {self.max_bytes} bytes", param="file")
        start = 0
        while (end := chunk.find(b"\n", start)) != -1:
            self._partial += chunk[start:end]
            self._line(bytes(self._partial))
            self._partial.clear()
            start = end + 1
        self._partial += chunk[start:]

    def finish(self) -> None:
        if self._partial:
            self._line(bytes(self._partial))
        if self.num_lines == 0:
            raise ValidationError(EMPTY_FILE_MESSAGE, param="file")

    def _line(self, line: bytes) -> None:
        self.num_lines += 1
        if self.num_lines > self.max_lines:
            raise ValidationError(f"File has more than {self.max_lines} lines", param="file")
        custom_id = _check_request(line, self.num_lines)
        first = self._first_lines.setdefault(custom_id, self.num_lines)
        if first != self.num_lines:
            raise _line_error(
                self.num_lines, f"duplicate custom_id {custom_id!r} (first on line {first})"
            )


def _check_request(line: bytes, number: int) -> str:
    """The custom_id of a valid request line; else a `ValidationError` naming the line."""
    if not line.strip():
        raise _line_error(number, "empty line")
    try:
        request = json.loads(line)
    except ValueError as error:
        raise _line_error(number, f"not valid JSON: {error}") from None
    if not isinstance(request, dict):
        raise _line_error(number, f"a request must be a JSON object, got {type(request).__name__}")
    for name, kind, description in _FIELDS:
        if name not in request:
            raise _line_error(number, f"missing field {name!r}")
        if not isinstance(request[name], kind):
            raise _line_error(number, f"{name} must be {description}")
    if not request["custom_id"]:
        raise _line_error(number, "custom_id must not be empty")
    if request["method"] != "POST":
        raise _line_error(number, f"method must be POST; got {request['method']!r}")
    if request["url"] not in BATCH_URLS:
        urls = ", ".join(BATCH_URLS)
        raise _line_error(number, f"url must be one of {urls}; got {request['url']!r}")
    custom_id: str = request["custom_id"]
    return custom_id


_FIELDS = (
    ("custom_id", str, "a string"),
    ("method", str, "a string"),
    ("url", str, "a string"),
    ("body", dict, "an object"),
)


def _line_error(number: int, reason: str) -> ValidationError:
    return ValidationError(f"Line {number}: {reason}", param="file")
