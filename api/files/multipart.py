"""A `multipart/form-data` upload parsed as it arrives (`MultipartUpload`), on python-multipart's
streaming parser: the file part's bytes are handed on chunk by chunk, never held whole."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import PurePosixPath

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from tgq.api.errors import ValidationError

MAX_FIELD_BYTES = 1024  # a form field other than the file (`purpose`)


class MultipartUpload:
    """A `multipart/form-data` body parsed as it arrives: small fields are kept in `fields`;
    the bytes of the one part named `file` are handed on by `file_chunks`."""

    def __init__(self, content_type: str) -> None:
        kind, options = parse_options_header(content_type)
        if kind != b"multipart/form-data" or b"boundary" not in options:
            raise ValidationError("Expected a multipart/form-data body with `file` and `purpose`")
        self.fields: dict[str, str] = {}
        self.filename: str | None = None  # of the `file` part, once it has started
        self._headers: dict[bytes, bytes] = {}
        self._header = (bytearray(), bytearray())
        self._name = ""  # of the current part
        self._is_file = False  # the current part is the `file`
        self._value = bytearray()  # of the current field
        self._file_bytes: list[bytes] = []  # of the file, parsed but not handed on yet
        self._parser = MultipartParser(
            options[b"boundary"],
            {
                "on_part_begin": self._headers.clear,
                "on_header_field": lambda data, start, end: self._header[0].extend(data[start:end]),
                "on_header_value": lambda data, start, end: self._header[1].extend(data[start:end]),
                "on_header_end": self._on_header_end,
                "on_headers_finished": self._on_headers_finished,
                "on_part_data": self._on_part_data,
                "on_part_end": self._on_part_end,
            },
        )

    async def file_chunks(self, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            async for chunk in body:
                self._parser.write(chunk)
                for data in self._file_bytes:
                    yield data
                self._file_bytes.clear()
            self._parser.finalize()
        except MultipartParseError as error:
            raise ValidationError(f"Malformed multipart body: {error}") from None

    def _on_header_end(self) -> None:
        name, value = self._header
        self._headers[bytes(name).lower()] = bytes(value)
        name.clear()
        value.clear()

    def _on_headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition"))
        self._name = options.get(b"name", b"").decode("utf-8", "replace")
        self._is_file = self._name == "file"
        if self._is_file:
            if self.filename is not None:
                raise ValidationError("Send one `file` per upload", param="file")
            raw = options.get(b"filename", b"").decode("utf-8", "replace")
            self.filename = PurePosixPath(raw.replace("\\", "/")).name or "file"
        self._value.clear()

    def _on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._is_file:
            self._file_bytes.append(data[start:end])
            return
        self._value += data[start:end]
        if len(self._value) > MAX_FIELD_BYTES:
            raise ValidationError(f"Form field {self._name!r} is too long", param=self._name)

    def _on_part_end(self) -> None:
        if not self._is_file:
            self.fields[self._name] = self._value.decode("utf-8", "replace")
