"""Every flag of `tgq serve` takes effect in both of its modes: ONE embedded `tgq serve` (the
api with its in-process batcher) and ONE with Postgres and Redis (api, batcher and Celery worker
as children), started with the same non-default flags; each effect is checked against both."""

from __future__ import annotations

import json
import re
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis

from tests.api.stack import create_database, drop_database, free_port, wait_healthy
from tests.api.test_http_routes import encode
from tests.cli.test_processes_cli import REDIS_URL, _children, _serve
from tests.polling import eventually

pytestmark = pytest.mark.timeout(600)

BATCHER_ID = "flags-b"
NUM_KV_BLOCKS = 201  # what --kv-cache-memory holds, block 0 reserved: 200 x 16 = 3200 tokens
BLOCK_SIZE = 16  # the torch attention backend's (--disable-custom-kernels)
NUM_SHARD = 2
ORIGIN = "http://app.example"
PAYLOAD_LIMIT = 50_000
LONG = 400  # tokens of the requests that hold the batch
MAX_BATCH_TOTAL_TOKENS = 2800  # below the 3200 the KV cache holds
MAX_WAITING_TOKENS = 40  # with a waiting-served ratio no single request meets


def kv_cache_bytes(model_dir: Path) -> int:
    """--kv-cache-memory for NUM_KV_BLOCKS blocks per rank: bf16 K and V of every layer, the KV
    heads split over the ranks."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    local_kv_heads = config["num_key_value_heads"] // NUM_SHARD
    per_token = 2 * config["num_hidden_layers"] * local_kv_heads * head_dim * 2
    return per_token * BLOCK_SIZE * NUM_KV_BLOCKS


def flags(model_dir: Path, port: int) -> list[str]:
    return [
        "--model-id", str(model_dir), "--port", str(port), "--batcher-id", BATCHER_ID,
        "--dtype", "bfloat16", "--num-shard", str(NUM_SHARD), "--disable-custom-kernels",
        "--kv-cache-memory", str(kv_cache_bytes(model_dir)), "--max-batch-size", "2",
        "--max-batch-prefill-tokens", "64", "--max-best-of", "1", "--max-stop-sequences", "1",
        "--max-top-n-tokens", "1", "--max-client-batch-size", "1", "--validation-workers", "3",
        "--payload-limit", str(PAYLOAD_LIMIT), "--cors-allow-origin", ORIGIN,
        "--heartbeat-ttl-s", "2", "--drain-timeout-s", "5",
        "--max-batch-total-tokens", str(MAX_BATCH_TOTAL_TOKENS), "--waiting-served-ratio", "5",
        "--max-waiting-tokens", str(MAX_WAITING_TOKENS),
    ]  # fmt: skip


@dataclass
class Served:
    url: str
    log: Path
    pid: int
    model_dir: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="module", params=["embedded", "services"])
def served(
    request: pytest.FixtureRequest, text_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    cwd, port = tmp_path_factory.mktemp(request.param), free_port()
    env: dict[str, str] = {}
    if request.param == "services":
        env = {"DATABASE_URL": create_database(), "REDIS_URL": REDIS_URL}
        env["REDIS_PREFIX"] = f"tgq-test-{secrets.token_hex(4)}"
    process = _serve(cwd, env, *flags(text_model_dir, port))
    log = cwd / "serve.log"
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process, log, 120)
        yield Served(f"http://127.0.0.1:{port}", log, process.pid, text_model_dir)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        finally:
            process.kill()
            if env:
                drop_database(env["DATABASE_URL"])
                client = redis.Redis.from_url(REDIS_URL)
                keys = list(client.scan_iter(match=f"{env['REDIS_PREFIX']}:*"))
                if keys:
                    client.delete(*keys)
                client.close()


def generate(url: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{url}/generate", json=body, timeout=120)


def validation_error(message: str) -> dict[str, str]:
    return {"error": f"Input validation error: {message}", "error_type": "validation"}


def test_info_reports_the_flags_and_the_limits_from_the_model(served: Served) -> None:
    """The limits default to the model's context (4096), capped by the KV cache the
    --kv-cache-memory flag sizes (200 usable blocks of 16 tokens: 3200) and by
    --max-batch-total-tokens (2800)."""
    info = httpx.get(f"{served.url}/info", timeout=10).json()
    assert info["model_dtype"] == "torch.bfloat16"
    assert (info["max_total_tokens"], info["max_input_tokens"]) == (2800, 2799)
    assert (info["max_best_of"], info["max_stop_sequences"]) == (1, 1)
    assert (info["validation_workers"], info["max_client_batch_size"]) == (3, 1)


def test_a_2000_token_prompt_is_served(served: Served) -> None:
    prompt = "The Python language has lists, dictionaries and classes. " * 70
    num_tokens = len(encode(served.model_dir, prompt))
    assert 2000 <= num_tokens < 2799, num_tokens
    parameters = {"max_new_tokens": 2, "ignore_eos": True, "details": True}
    answer = generate(served.url, {"inputs": prompt, "parameters": parameters})
    assert answer.status_code == 200, answer.text
    assert answer.json()["details"]["generated_tokens"] == 2
    # The KV cache would hold it; --max-batch-total-tokens does not.
    max_new_tokens = MAX_BATCH_TOTAL_TOKENS - num_tokens + 1
    parameters = {"max_new_tokens": max_new_tokens}
    response = generate(served.url, {"inputs": prompt, "parameters": parameters})
    assert response.status_code == 422
    message = (
        f"`inputs` tokens + `max_new_tokens` must be <= {MAX_BATCH_TOTAL_TOKENS}. Given:"
        f" {num_tokens} `inputs` tokens and {max_new_tokens} `max_new_tokens`"
    )
    assert response.json() == validation_error(message)


def test_request_limits_are_the_flags(served: Served) -> None:
    stops = generate(served.url, {"inputs": "a", "parameters": {"stop": ["x", "y"]}})
    assert stops.status_code == 422
    assert stops.json() == validation_error("`stop` supports up to 1 stop sequences. Given: 2")
    best_of = generate(served.url, {"inputs": "a", "parameters": {"best_of": 2, "do_sample": True}})
    assert best_of.json() == validation_error("`best_of` != 1 is not allowed for this endpoint")
    top_n = generate(served.url, {"inputs": "a", "parameters": {"top_n_tokens": 2}})
    assert top_n.json() == validation_error("`top_n_tokens` must be >= 0 and <= 1. Given: 2")
    completions = httpx.post(
        f"{served.url}/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1}, timeout=30
    )
    assert completions.status_code == 422
    message = "Number of prompts exceeds the maximum allowed batch size of 1"
    assert completions.json()["error"]["message"] == message
    big = generate(served.url, {"inputs": "x" * PAYLOAD_LIMIT})
    assert big.status_code == 413
    assert big.json()["error"] == f"Payload too large: the limit is {PAYLOAD_LIMIT} bytes"


def test_cors_allows_the_origin_given(served: Served) -> None:
    allowed = httpx.get(f"{served.url}/info", headers={"Origin": ORIGIN}, timeout=10)
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(f"{served.url}/info", headers={"Origin": "http://x.example"}, timeout=10)
    assert "access-control-allow-origin" not in other.headers


@dataclass
class _Stream:
    """One /generate_stream request on a thread: when each token and the end arrived."""

    url: str
    max_new_tokens: int
    token_times: list[float] = field(default_factory=list)
    end_time: float | None = None

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        parameters = {"max_new_tokens": self.max_new_tokens, "ignore_eos": True}
        body = {"inputs": "def main():", "parameters": parameters}
        with httpx.stream("POST", f"{self.url}/generate_stream", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    self.token_times.append(time.monotonic())
        self.end_time = time.monotonic()

    def tokens_before(self, moment: float) -> int:
        return sum(1 for t in self.token_times if t < moment)


def test_max_batch_size_caps_the_running_batch(served: Served) -> None:
    """With two long requests running, a third starts only when one of them has finished."""
    first, second, third = (_Stream(served.url, n) for n in (LONG, LONG, 4))
    threads = [first.start()]
    eventually(lambda: first.token_times, 60, "the first stream's first token", interval_s=0.01)
    threads.append(second.start())
    eventually(lambda: second.token_times, 60, "the second stream's first token", interval_s=0.01)
    sent = time.monotonic()
    threads.append(third.start())
    for thread in threads:
        thread.join(120)
    assert first.end_time is not None and sent < first.end_time  # both held the batch then
    assert len(third.token_times) == 4  # one event per token, the last with the text
    started = third.token_times[0]
    # The first long request had (all but a relay's delay of) its tokens when the third began.
    assert first.tokens_before(started) >= LONG - 40, (first.tokens_before(started), LONG)


def test_waiting_requests_join_a_running_batch_as_the_gate_says(served: Served) -> None:
    """TGI's admission gate: with one request running, a second joins only when
    floor(5 x 1) = 5 waiting ones could (never here), or after --max-waiting-tokens steps
    without admission. By default (ratio 0.3: floor(0.3) = 0) it would join at the next step."""
    running, waiting = _Stream(served.url, 150), _Stream(served.url, 4)
    threads = [running.start()]
    eventually(lambda: running.token_times, 60, "the stream's first token", interval_s=0.01)
    sent = time.monotonic()
    threads.append(waiting.start())
    for thread in threads:
        thread.join(120)
    assert len(waiting.token_times) == 4 and running.end_time is not None
    started = waiting.token_times[0]
    num_sent, num_started = running.tokens_before(sent), running.tokens_before(started)
    # Steps count from the running request's admission (its first token); a relay's delay aside.
    assert num_sent < MAX_WAITING_TOKENS // 2, num_sent
    assert num_started - num_sent >= MAX_WAITING_TOKENS // 2, (num_sent, num_started)
    assert num_started <= MAX_WAITING_TOKENS + 40 and started < running.end_time, num_started


def _step_metrics(url: str) -> tuple[float, float, float]:
    """tgq_batch_steps, tgq_batch_step_tokens and tgq_batch_step_tokens_max of the batcher, as
    its last heartbeat said."""
    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    values = dict(line.rsplit(" ", 1) for line in lines if f'{{batcher="{BATCHER_ID}"}}' in line)
    names = ("tgq_batch_steps", "tgq_batch_step_tokens", "tgq_batch_step_tokens_max")
    steps, tokens, max_tokens = (
        float(values.get(f'{n}{{batcher="{BATCHER_ID}"}}', 0)) for n in names
    )
    return steps, tokens, max_tokens


def test_no_step_computes_more_than_the_prefill_budget(served: Served) -> None:
    """A prompt of hundreds of tokens is computed in steps of at most 64 tokens
    (--max-batch-prefill-tokens), as the batcher's step metrics show."""
    prompt = " ".join(str(n) for n in range(1000, 1200))  # shares no prefix with the others
    num_tokens = len(encode(served.model_dir, prompt))
    assert num_tokens > 300, num_tokens
    num_steps, num_step_tokens, _ = _step_metrics(served.url)
    parameters = {"max_new_tokens": 1, "ignore_eos": True}
    answer = generate(served.url, {"inputs": prompt, "parameters": parameters})
    assert answer.status_code == 200, answer.text
    eventually(
        lambda: _step_metrics(served.url)[1] >= num_step_tokens + num_tokens,
        60,
        lambda: f"step tokens counted: {_step_metrics(served.url)}",
        interval_s=0.01,
    )
    after = _step_metrics(served.url)
    assert after[0] - num_steps >= -(-num_tokens // 64), (num_steps, after, num_tokens)
    assert after[2] == 64, after


def test_the_batcher_runs_as_the_flags_say(served: Served) -> None:
    """Its start-up line: the dtype, the ranks, the pure-torch kernels, a rank's weights, the KV
    cache, the batch bounds; its id on /metrics; the rank processes."""
    eventually(
        lambda: f"batcher {BATCHER_ID} serving" in served.log_text(),
        60,
        f"the log says batcher {BATCHER_ID} serving",
        interval_s=0.01,
    )
    line = next(x for x in served.log_text().splitlines() if f"batcher {BATCHER_ID} serving" in x)
    expected = re.compile(
        rf"on cpu x{NUM_SHARD}: dtype bfloat16, attention torch, 0 modules on C\+\+ kernels,"
        rf" weights \d+\.\d MiB; KV {NUM_KV_BLOCKS} blocks of {BLOCK_SIZE} tokens in bfloat16;"
        r" batches of 2 requests, 64 tokens$"
    )
    assert expected.search(line), line
    metrics = httpx.get(f"{served.url}/metrics", timeout=10).text
    assert f'batcher="{BATCHER_ID}"' in metrics
    ranks = [pid for pid in _children(served.pid) if b"tgq.gpu_worker.rank" in _cmdline(pid)]
    assert len(ranks) == NUM_SHARD


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
