"""`tgq batch` as a user runs it: the command line as a subprocess against a real api process in
embedded mode (SQLite, batches run in the api process), with a static API key, so that every
call also shows the key is sent. The progress formatting is tested on its own."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.stack import ROOT, Stack, free_port
from tgq.cli.batch import ProgressBar, progress_line

pytestmark = pytest.mark.timeout(120)
KEY = "cli-test-key"
CHAT = "/v1/chat/completions"


def request_line(custom_id: str, url: str = CHAT, **body: Any) -> str:
    if url == CHAT:
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
    else:
        body = {"prompt": f"say {custom_id}", **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def tgq(url: str, *args: str, api_key: str | None = KEY) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tgq.cli", "--url", url, *args],
        check=False,
        cwd=ROOT,
        env=cli_env(api_key),
        capture_output=True,
        text=True,
        timeout=90,
    )


def cli_env(api_key: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TGQ_URL", "TGQ_API_KEY")}
    return env if api_key is None else {**env, "TGQ_API_KEY": api_key}


def custom_ids(path: Path) -> set[str]:
    return {json.loads(row)["custom_id"] for row in path.read_text().splitlines()}


@pytest.fixture(scope="module")
def server(text_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("cli")
    url = f"sqlite+aiosqlite:///{root / 'tgq.db'}"
    api_env = {"AUTO_MIGRATE": "true", "API_KEY": KEY}
    running = Stack(text_model_dir, url, root, redis_url=None, api_env=api_env)
    try:
        running.start_api()
        yield running
    finally:
        running.stop()


@dataclass
class Submitted:
    run: subprocess.CompletedProcess[str]
    batch_id: str
    input_path: Path


@pytest.fixture(scope="module")
def submitted(server: Stack, tmp_path_factory: pytest.TempPathFactory) -> Submitted:
    """`tgq batch submit --wait` of nine good chat lines and one that fails validation."""
    path = tmp_path_factory.mktemp("submit") / "chat.jsonl"
    rows = [request_line(f"req-{i}", max_tokens=4) for i in range(9)]
    rows.insert(4, request_line("bad", messages=[], max_tokens=4))
    path.write_text("\n".join(rows) + "\n")
    run = tgq(server.url, "batch", "submit", str(path), "--wait", "--metadata", "run=cli")
    return Submitted(run, run.stdout.strip(), path)


def test_progress_line_shows_rate_and_eta() -> None:
    line = progress_line(10, 2, 40, elapsed_s=4.0)
    assert line == ("[######..............] 10/2/40 completed/failed/total  3.0 lines/s  ETA 10s")


def test_progress_line_without_a_total_or_a_finished_line_has_no_eta() -> None:
    idle = progress_line(0, 0, 0, elapsed_s=3.0)
    assert idle == "[....................] 0/0/0 completed/failed/total  0.0 lines/s  ETA ?"
    assert progress_line(0, 0, 10, elapsed_s=0.0).endswith("ETA ?")
    assert progress_line(0, 0, 10, elapsed_s=5.0).endswith("ETA ?")


def test_progress_line_when_finished() -> None:
    line = progress_line(38, 2, 40, elapsed_s=8.0)
    assert line.startswith("[" + "#" * 20 + "] 38/2/40")
    assert line.endswith("5.0 lines/s  ETA 0s")


def test_progress_line_long_eta() -> None:
    assert progress_line(1, 0, 10_000, elapsed_s=2.0).endswith("0.5 lines/s  ETA 5h33m")
    assert progress_line(10, 0, 100, elapsed_s=10.0).endswith("ETA 1m30s")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_in_a_log_prints_a_line_every_few_seconds_and_the_last() -> None:
    stream, clock = io.StringIO(), Clock()
    bar = ProgressBar(stream, clock)
    for now, completed in ((0.0, 0), (1.0, 1), (4.0, 2), (5.5, 3), (6.0, 4)):
        clock.now = now
        bar.update({"completed": completed, "failed": 0, "total": 5})
    bar.update({"completed": 5, "failed": 0, "total": 5}, force=True)
    bar.end()
    counts = [line.split()[1] for line in stream.getvalue().splitlines()]
    assert counts == ["0/0/5", "3/0/5", "5/0/5"]


def test_progress_bar_on_a_terminal_redraws_one_line() -> None:
    stream, clock = Terminal(), Clock()
    bar = ProgressBar(stream, clock)
    clock.now = 1.0
    bar.update({"completed": 1, "failed": 0, "total": 100})  # ETA 1m39s
    clock.now = 2.0
    bar.update({"completed": 50, "failed": 0, "total": 100})  # ETA 2s: a shorter line
    bar.end()
    text = stream.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n") and text.count("\n") == 1
    first, second = text.removesuffix("\n").split("\r")[1:]
    assert "50/0/100" in second and second.endswith(" ") and len(second) == len(first)


def test_submit_wait_writes_the_output_and_error_files(submitted: Submitted) -> None:
    run = submitted.run
    assert run.returncode == 0, run.stderr
    assert submitted.batch_id.startswith("batch_") and "\n" not in submitted.batch_id
    directory = submitted.input_path.parent
    assert custom_ids(directory / "chat.output.jsonl") == {f"req-{i}" for i in range(9)}
    assert custom_ids(directory / "chat.errors.jsonl") == {"bad"}
    last = run.stderr.splitlines()[-3]  # then one `wrote PATH` line per file
    assert "9/1/10 completed/failed/total" in last and last.endswith("ETA 0s")
    assert run.stderr.splitlines()[-2:] == [
        f"wrote {directory / 'chat.output.jsonl'}",
        f"wrote {directory / 'chat.errors.jsonl'}",
    ]


def test_status_summary_and_json(server: Stack, submitted: Submitted) -> None:
    as_json = tgq(server.url, "batch", "status", submitted.batch_id, "--json")
    assert as_json.returncode == 0, as_json.stderr
    batch = json.loads(as_json.stdout)
    assert batch["id"] == submitted.batch_id and batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 10, "completed": 9, "failed": 1}
    assert batch["metadata"] == {"run": "cli"} and batch["endpoint"] == CHAT

    summary = tgq(server.url, "batch", "status", submitted.batch_id)
    assert summary.returncode == 0, summary.stderr
    lines = summary.stdout.splitlines()
    assert lines[0] == submitted.batch_id
    rows = dict(line.strip().split(maxsplit=1) for line in lines[1:])
    assert rows["status:"] == "completed"
    assert rows["requests:"] == "9 completed, 1 failed, 10 total"
    assert rows["output:"] == batch["output_file_id"]
    assert rows["errors:"] == batch["error_file_id"]
    assert rows["metadata:"] == "run=cli"
    assert {"created:", "finished:"} <= rows.keys()


def test_completions_with_explicit_endpoint_and_output(server: Stack, tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    rows = [request_line(f"p-{i}", "/v1/completions", max_tokens=3) for i in range(2)]
    path.write_text("\n".join(rows))
    output = tmp_path / "out" / "results.jsonl"
    output.parent.mkdir()
    args = ["--endpoint", "/v1/completions", "--wait", "--output", str(output)]
    run = tgq(server.url, "batch", "submit", str(path), *args)
    assert run.returncode == 0, run.stderr
    assert custom_ids(output) == {"p-0", "p-1"}
    assert not (tmp_path / "in.errors.jsonl").exists()  # no line failed: no error file


def test_a_malformed_line_is_rejected_with_the_server_message(
    server: Stack, tmp_path: Path
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(request_line("ok") + '\n{"custom_id": "broken",\n')
    run = tgq(server.url, "batch", "submit", str(path), "--wait")
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.startswith("tgq: error: HTTP 422: Line 2: not valid JSON")


def test_errors_of_the_server_exit_2(server: Stack) -> None:
    missing = tgq(server.url, "batch", "status", "batch_nope")
    assert missing.returncode == 2
    assert missing.stderr == "tgq: error: HTTP 404: No batch with id 'batch_nope'\n"
    keyless = tgq(server.url, "batch", "status", "batch_nope", api_key=None)
    assert keyless.returncode == 2 and "Missing API key" in keyless.stderr


def test_an_unreachable_server_exits_2() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    run = tgq(url, "batch", "status", "batch_x")
    assert run.returncode == 2
    assert run.stderr.startswith(f"tgq: error: cannot connect to {url}")


def sigint_as_at_a_terminal() -> None:
    """A shell starts background jobs with SIGINT ignored, and a child inherits that: so that
    the test also passes under one (CI), the CLI gets Ctrl-C's default back."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_while_waiting_leaves_the_batch_running(server: Stack, tmp_path: Path) -> None:
    path = tmp_path / "slow.jsonl"
    rows = [request_line(f"s-{i}", max_tokens=1000, ignore_eos=True) for i in range(32)]
    path.write_text("\n".join(rows))
    command = [sys.executable, "-m", "tgq.cli", "--url", server.url, "batch", "submit", str(path)]
    process = subprocess.Popen(
        [*command, "--wait"],
        cwd=ROOT,
        env=cli_env(KEY),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_as_at_a_terminal,  # noqa: PLW1509 (the test process starts no threads)
    )
    assert process.stdout is not None and process.stderr is not None
    batch_id = process.stdout.readline().strip()
    # Its first progress line: it is in the polling loop (the batch takes seconds).
    progress = next((line for line in process.stderr if "completed/failed/total" in line), None)
    assert progress is not None, "no progress line"
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 130, stderr
    assert f"batch {batch_id} keeps running" in stderr
    assert f"`tgq batch status {batch_id}`" in stderr
    headers = {"Authorization": f"Bearer {KEY}"}
    batch = httpx.get(f"{server.url}/v1/batches/{batch_id}", headers=headers, timeout=10).json()
    assert batch["status"] in ("validating", "in_progress")
    httpx.post(f"{server.url}/v1/batches/{batch_id}/cancel", headers=headers, timeout=10)
