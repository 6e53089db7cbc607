"""`tgq batch submit` and `tgq batch status`: a client of the server's OpenAI Files and Batches
API.

stdout carries only what a script reads (the batch id, the status); progress, the paths written
and errors go to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

import httpx

from tgq.cli import INTERRUPTED, CommandError

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
FINISHED = ("completed", "failed", "expired", "cancelled")
POLL_S = 0.5
LOG_EVERY_S = 5.0  # between progress lines when stderr is not a terminal (a log file, CI)
BAR_WIDTH = 20
TIMEOUT = httpx.Timeout(60.0, connect=10.0)
Batch = dict[str, Any]  # OpenAI's batch object, as the server sends it


def submit(args: argparse.Namespace) -> int:
    """Upload `args.file`, start a batch over it, print its id; with `--wait`, follow it to
    the end and download its output and error files. Exit 0 only when it completed."""
    with _session(args) as client:
        batch = _create(client, args)
        print(batch["id"], flush=True)
        return _wait(client, batch, args) if args.wait else 0


def _create(client: httpx.Client, args: argparse.Namespace) -> Batch:
    file_id = _upload(client, args.file)
    request = {
        "input_file_id": file_id,
        "endpoint": args.endpoint or _first_url(args.file),
        "completion_window": args.completion_window,
        "metadata": dict(args.metadata) or None,
    }
    return _json(client.post("/v1/batches", json=request))


def _wait(client: httpx.Client, batch: Batch, args: argparse.Namespace) -> int:
    bar = ProgressBar(sys.stderr)
    try:
        batch = _follow(client, batch, bar)
    except KeyboardInterrupt:
        bar.end()
        print(
            f"Interrupted: batch {batch['id']} keeps running on the server; "
            f"check it with `tgq batch status {batch['id']}`",
            file=sys.stderr,
        )
        return INTERRUPTED
    _download(client, batch["output_file_id"], args.output or _beside(args.file, "output"))
    _download(client, batch["error_file_id"], args.errors or _beside(args.file, "errors"))
    if batch["status"] == "completed":
        return 0
    print(f"batch {batch['id']} {batch['status']}{_reason(batch)}", file=sys.stderr)
    return 1


def status(args: argparse.Namespace) -> int:
    with _session(args) as client:
        batch = _json(client.get(f"/v1/batches/{args.batch_id}"))
    print(json.dumps(batch, indent=2) if args.json else summary(batch))
    return 0


def summary(batch: Batch) -> str:
    """The batch as a few aligned `label: value` lines, the id first."""
    counts = _counts(batch)
    finished = next((batch[f"{s}_at"] for s in FINISHED if batch.get(f"{s}_at")), None)
    metadata = " ".join(f"{k}={v}" for k, v in (batch.get("metadata") or {}).items())
    rows = [
        ("status", batch["status"] + _reason(batch)),
        ("endpoint", batch.get("endpoint")),
        ("requests", "{completed} completed, {failed} failed, {total} total".format(**counts)),
        ("created", _local_time(batch.get("created_at"))),
        ("finished", _local_time(finished)),
        ("output", batch.get("output_file_id")),
        ("errors", batch.get("error_file_id")),
        ("metadata", metadata or None),
    ]
    lines = [f"  {label + ':':<10} {value}" for label, value in rows if value is not None]
    return "\n".join([batch["id"], *lines])


def progress_line(num_completed: int, num_failed: int, num_total: int, elapsed_s: float) -> str:
    """`[####......] 12/1/40 completed/failed/total  3.2 lines/s  ETA 9s`. The rate is over the
    whole wait; there is no ETA (`?`) until a line has finished, nor while the total is 0 (the
    server counts lines as it validates them)."""
    num_done = num_completed + num_failed
    rate = num_done / elapsed_s if elapsed_s > 0 else 0.0
    filled = min(BAR_WIDTH, BAR_WIDTH * num_done // num_total) if num_total else 0
    if num_total and num_done >= num_total:
        eta = "0s"
    elif num_total and rate > 0:
        eta = _duration((num_total - num_done) / rate)
    else:
        eta = "?"
    return (
        f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {num_completed}/{num_failed}/{num_total}"
        f" completed/failed/total  {rate:.1f} lines/s  ETA {eta}"
    )


class ProgressBar:
    """A batch's progress on `stream`: on a terminal, one line redrawn in place at every update;
    elsewhere a line at most every `LOG_EVERY_S` (and the final one), so a log stays short."""

    def __init__(self, stream: TextIO, clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream
        self.clock = clock
        self.started = clock()
        self.is_tty = stream.isatty()
        self._drawn_at = -math.inf
        self._width = 0  # of the line on the terminal, 0 when the cursor is at a line's start

    def update(self, counts: dict[str, int], *, force: bool = False) -> None:
        now = self.clock()
        if not (self.is_tty or force or now - self._drawn_at >= LOG_EVERY_S):
            return
        self._drawn_at = now
        line = progress_line(
            counts["completed"], counts["failed"], counts["total"], now - self.started
        )
        if self.is_tty:
            self.stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def end(self) -> None:
        """Moves past the redrawn line, so that what is printed next starts a line of its own."""
        if self._width:
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0


@contextmanager
def _session(args: argparse.Namespace) -> Iterator[httpx.Client]:
    """A client of `args.url`; a server that cannot be reached becomes a `CommandError`."""
    headers = {} if args.api_key is None else {"Authorization": f"Bearer {args.api_key}"}
    try:
        with httpx.Client(base_url=args.url, headers=headers, timeout=TIMEOUT) as client:
            yield client
    except httpx.ConnectError as error:
        raise CommandError(
            f"cannot connect to {args.url} ({error}); is the server running? (--url, TGQ_URL)"
        ) from None
    except (httpx.HTTPError, httpx.InvalidURL) as error:
        name = type(error).__name__
        raise CommandError(f"request to {args.url} failed ({name}): {error}") from None


def _upload(client: httpx.Client, path: Path) -> str:
    try:
        file = path.open("rb")
    except OSError as error:
        raise CommandError(f"cannot read {path}: {error.strerror}") from None
    with file:  # httpx streams an open file's bytes, the file is never held whole
        response = client.post(
            "/v1/files",
            data={"purpose": "batch"},
            files={"file": (path.name, file, "application/jsonl")},
        )
    return str(_json(response)["id"])


def _first_url(path: Path) -> str:
    """The `url` of the file's first request line (the server has checked the lines by now)."""
    try:
        with path.open("rb") as file:
            url: str = json.loads(file.readline())["url"]
    except (OSError, ValueError, KeyError, TypeError):
        raise CommandError(f"cannot read the endpoint from {path}; pass --endpoint") from None
    return url


def _follow(client: httpx.Client, batch: Batch, bar: ProgressBar) -> Batch:
    """Polls the batch until it has finished, drawing its progress; returns the last state."""
    while batch["status"] not in FINISHED:
        bar.update(_counts(batch))
        time.sleep(POLL_S)
        batch = _json(client.get(f"/v1/batches/{batch['id']}"))
    bar.update(_counts(batch), force=True)
    bar.end()
    return batch


def _download(client: httpx.Client, file_id: str | None, path: Path) -> None:
    """Streams the file's content to `path`, through a `.part` file so that an interrupted
    download never looks like a whole one."""
    if file_id is None:
        return
    partial = path.with_name(path.name + ".part")
    with client.stream("GET", f"/v1/files/{file_id}/content") as response:
        if response.is_error:
            response.read()
            raise CommandError(error_message(response))
        try:
            with partial.open("wb") as file:
                for chunk in response.iter_bytes():
                    file.write(chunk)
            partial.replace(path)
        except OSError as error:
            raise CommandError(f"cannot write {path}: {error.strerror}") from None
    print(f"wrote {path}", file=sys.stderr)


def _json(response: httpx.Response) -> dict[str, Any]:
    """The body of a successful answer (a batch, a file); else the server's error message."""
    if response.is_error:
        raise CommandError(error_message(response))
    try:
        body: dict[str, Any] = response.json()
    except ValueError:
        raise CommandError(f"{response.url} answered with a body that is not JSON") from None
    return body


def error_message(response: httpx.Response) -> str:
    """`HTTP <status>: <the server's message>`, from OpenAI's `{"error": {"message": ...}}` or
    TGI's `{"error": "..."}`; the start of the body when it is neither."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict):
        error = error.get("message")
    message = error if isinstance(error, str) else response.text[:200] or response.reason_phrase
    return f"HTTP {response.status_code}: {message}"


def _beside(path: Path, kind: str) -> Path:
    """`dir/in.jsonl` -> `dir/in.<kind>.jsonl`."""
    return path.with_name(f"{path.stem}.{kind}.jsonl")


def _counts(batch: Batch) -> dict[str, int]:
    return batch.get("request_counts") or {"completed": 0, "failed": 0, "total": 0}


def _reason(batch: Batch) -> str:
    """`: <message>` of a batch's first error (why it failed), else nothing."""
    errors = (batch.get("errors") or {}).get("data") or []
    return f": {errors[0]['message']}" if errors else ""


def _local_time(unix_s: int | None) -> str | None:
    if unix_s is None:
        return None
    return datetime.fromtimestamp(unix_s).astimezone().isoformat(" ", "seconds")


def _duration(seconds: float) -> str:
    """`45s`, `3m05s` or `2h03m` (seconds rounded up)."""
    whole = math.ceil(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole // 60 % 60:02d}m"
