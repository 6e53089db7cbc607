"""The api's edge through real HTTP, against real processes: every validation message with its
status and body shape per route flavour (TGI or OpenAI), invalid streams refused before any SSE
byte, the payload limit (413), backpressure (429: concurrency and the queue bound, before any
tokenization), API-key auth on every non-public route, the refusal to start on an un-migrated
database and `/health` without a live batcher.

Several api processes share the module's database; those with the `stack`'s Redis prefix share
its batcher, the one on a prefix of its own has none (its jobs just queue).
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from tests.api.stack import Stack
from tests.polling import eventually
from tgq.api.chat_template import ChatTemplate
from tgq.api.openai_validation import EMPTY_PROMPTS_MESSAGE, SUFFIX_MESSAGE
from tgq.api.security import INVALID_KEY, MISSING_KEY
from tgq.devtools.demo import CHAT_TEMPLATE

pytestmark = pytest.mark.timeout(300)
StartApi = Callable[..., Stack]  # (log name, **env) -> a started api on the stack's prefix

PAYLOAD_LIMIT = 1000
LIMITED_ENV = {
    "MAX_INPUT_TOKENS": "16",
    "MAX_TOTAL_TOKENS": "32",
    "MAX_BEST_OF": "1",
    "MAX_STOP_SEQUENCES": "1",
    "MAX_TOP_N_TOKENS": "2",
    "MAX_CLIENT_BATCH_SIZE": "2",
    "PAYLOAD_LIMIT": str(PAYLOAD_LIMIT),
}
MAX_QUEUED = 3
API_KEY = "secret"
PUBLIC_ROUTES = ("/health", "/ping", "/info", "/metrics", "/v1/models")
TGI_PREFIX = "Input validation error: "
HOLD = {"inputs": "hold the only slot", "parameters": {"max_new_tokens": 900, "ignore_eos": True}}
TOO_LONG = {"inputs": "x", "parameters": {"max_new_tokens": 5000}}  # a 422 once tokenized


def stop_api(running: Stack) -> None:
    """Stops an api that shares another stack's prefix (`Stack.stop` would clear its keys)."""
    if running.api is not None:
        running.api.terminate()
        try:
            running.api.wait(30)
        except subprocess.TimeoutExpired:
            running.api.kill()  # the test fails, but leaves no process behind
            raise


@contextlib.contextmanager
def sibling_api(stack: Stack, name: str, **env: str) -> Iterator[Stack]:
    """One more api process on the stack's database and Redis prefix (its batcher)."""
    api = Stack(
        stack.model_dir, stack.database_url, stack.log_dir, prefix=stack.prefix, name=name,
        api_env=env,
    )  # fmt: skip
    try:
        api.start_api()
        yield api
    finally:
        stop_api(api)


@pytest.fixture(scope="module")
def sibling(stack: Stack) -> Iterator[StartApi]:
    """Starts more api processes on the stack's database and Redis prefix (its batcher)."""
    started: list[Stack] = []

    def start(name: str, **env: str) -> Stack:
        api = Stack(
            stack.model_dir, stack.database_url, stack.log_dir, prefix=stack.prefix, name=name,
            api_env=env,
        )  # fmt: skip
        started.append(api)
        api.start_api()
        return api

    yield start
    for api in started:
        stop_api(api)


@pytest.fixture(scope="module")
def default(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def limited(sibling: StartApi) -> Iterator[httpx.Client]:
    """An api with small limits (`LIMITED_ENV`)."""
    with httpx.Client(base_url=sibling("api-limited", **LIMITED_ENV).url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(stack: Stack) -> Tokenizer:
    return Tokenizer.from_file(str(stack.model_dir / "tokenizer.json"))


def tgi_error(message: str, error_type: str = "validation", prefix: str = TGI_PREFIX) -> Any:
    return {"error": prefix + message, "error_type": error_type}


def openai_error(
    message: str,
    param: str | None,
    *,
    kind: str = "invalid_request_error",
    code: str | None = None,
) -> Any:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def expected_error(route: str, message: str, param: str | None) -> Any:
    """A 422's body: TGI's (prefixed) on TGI routes, OpenAI's under `/v1/`."""
    return openai_error(message, param) if route.startswith("/v1/") else tgi_error(message)


def metrics(client: httpx.Client) -> dict[str, float]:
    """Every sample of one `/metrics` scrape, by name with labels: one consistent snapshot."""
    samples = {}
    for line in client.get("/metrics").text.splitlines():
        name, _, value = line.rpartition(" ")
        if name and not line.startswith("#"):
            samples[name] = float(value)
    return samples


def metric(client: httpx.Client, sample: str) -> float:
    """One sample of `/metrics`, e.g. `tgi_request_failure{err="overloaded"}`."""
    return metrics(client)[sample]


def chat(content: Any = "hi", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


def generate(**parameters: Any) -> dict[str, Any]:
    return {"inputs": "hello", "parameters": {"max_new_tokens": 4, **parameters}}


def completion(**extra: Any) -> dict[str, Any]:
    return {"prompt": "hello", "max_tokens": 4, **extra}


def job(**parameters: Any) -> dict[str, Any]:
    return {"prompt": "hello", "parameters": {"max_new_tokens": 4, **parameters}}


def case(api: str, route: str, body: Any, message: str, param: str | None = None) -> Any:
    return pytest.param(api, route, body, message, param, id=f"{route}:{message[:48]}")


IMAGE = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
GRAMMAR = {"type": "json", "value": {"type": "strin"}}
SCHEMA = {"name": "bad", "schema": {"type": "strin"}}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
VALIDATION_CASES = [
    # TGI's checks, in TGI's order.
    case("default", "/generate", generate(best_of=3, do_sample=True),
         "`best_of` must be > 0 and <= 2. Given: 3", "best_of"),
    case("default", "/generate", generate(best_of=0, do_sample=True),
         "`best_of` must be > 0 and <= 2. Given: 0", "best_of"),
    case("limited", "/generate", generate(best_of=2, do_sample=True),
         "`best_of` != 1 is not allowed for this endpoint", "best_of"),
    case("default", "/generate", generate(best_of=2),
         "you must use sampling when `best_of` is > 1", "best_of"),
    case("default", "/generate", generate(temperature=0),
         "`temperature` must be strictly positive", "temperature"),
    case("default", "/generate", generate(repetition_penalty=0),
         "`repetition_penalty` must be strictly positive", "repetition_penalty"),
    case("default", "/generate", generate(frequency_penalty=2.5),
         "`frequency_penalty` must be >= -2.0 and <= 2.0", "frequency_penalty"),
    case("default", "/generate", generate(top_p=0),
         "`top_p` must be > 0.0 and <= 1.0", "top_p"),
    case("default", "/generate", generate(typical_p=1.5),
         "`typical_p` must be > 0.0 and <= 1.0", "typical_p"),
    case("default", "/generate", generate(top_k=0), "`top_k` must be strictly positive", "top_k"),
    case("default", "/generate", generate(max_new_tokens=0),
         "`max_new_tokens` must be strictly positive", "max_new_tokens"),
    case("default", "/generate", generate(stop=["a", "b", "c", "d", "e"]),
         "`stop` supports up to 4 stop sequences. Given: 5", "stop"),
    case("limited", "/generate", generate(stop=["a", "b"]),
         "`stop` supports up to 1 stop sequences. Given: 2", "stop"),
    case("default", "/generate", generate(best_of=2, do_sample=True, seed=1),
         "`seed` must not be set when `best_of` > 1", "seed"),
    case("default", "/generate", generate(top_n_tokens=6),
         "`top_n_tokens` must be >= 0 and <= 5. Given: 6", "top_n_tokens"),
    case("limited", "/generate", generate(top_n_tokens=3),
         "`top_n_tokens` must be >= 0 and <= 2. Given: 3", "top_n_tokens"),
    case("default", "/generate", generate(truncate=0),
         "`truncate` must be strictly positive and less than 1023. Given: 0", "truncate"),
    case("limited", "/generate", generate(truncate=17),
         "`truncate` must be strictly positive and less than 16. Given: 17", "truncate"),
    case("default", "/generate", generate(grammar=GRAMMAR),
         "grammar is not valid: invalid json_schema: Invalid type: strin", "grammar"),
    case("default", "/generate", generate(watermark=True),
         "`watermark` is not supported", "watermark"),
    case("default", "/generate", {"inputs": ""}, "`inputs` cannot be empty", "inputs"),
    case("default", "/", {"inputs": ""}, "`inputs` cannot be empty", "inputs"),
    # OpenAI chat.
    case("default", CHAT, chat(logit_bias={"1": 1.0}), "`logit_bias` is not supported",
         "logit_bias"),
    case("default", CHAT, chat(tool_choice="required"),
         '`tool_choice` "required" needs `tools`', "tool_choice"),
    case("default", CHAT, chat(response_format={"type": "json_schema", "json_schema": SCHEMA}),
         "`response_format.json_schema.schema` is not valid: invalid json_schema: "
         "Invalid type: strin", "response_format"),
    case("default", CHAT, chat(IMAGE), "image content is not supported", "messages[0].content"),
    case("default", CHAT, {"messages": []}, "`messages` cannot be empty", "messages"),
    case("default", CHAT, chat(logprobs=True, top_logprobs=6),
         "`top_logprobs` must be >= 0 and <= 5. Given: 6", "top_logprobs"),
    case("limited", CHAT, chat(logprobs=True, top_logprobs=3),
         "`top_logprobs` must be >= 0 and <= 2. Given: 3", "top_logprobs"),
    case("default", CHAT, chat(top_logprobs=2),
         "`logprobs` must be true when `top_logprobs` is set", "logprobs"),
    case("default", CHAT, chat(max_completion_tokens=0),
         "`max_completion_tokens` must be strictly positive", "max_completion_tokens"),
    case("default", CHAT, chat(max_tokens=0),
         "`max_tokens` must be strictly positive", "max_tokens"),
    case("default", CHAT, chat(temperature=2.5),
         "`temperature` must be >= 0.0 and <= 2.0", "temperature"),
    case("default", CHAT, chat(top_p=0), "`top_p` must be > 0.0 and <= 1.0", "top_p"),
    case("default", CHAT, chat(frequency_penalty=-3),
         "`frequency_penalty` must be >= -2.0 and <= 2.0", "frequency_penalty"),
    case("default", CHAT, chat(presence_penalty=3),
         "`presence_penalty` must be >= -2.0 and <= 2.0", "presence_penalty"),
    case("default", CHAT, chat(n=9), "`n` must be >= 1 and <= 8. Given: 9", "n"),
    case("default", CHAT, chat(n=0), "`n` must be >= 1 and <= 8. Given: 0", "n"),
    case("default", CHAT, chat(stop=["a", "b", "c", "d", "e"]),
         "`stop` supports up to 4 stop sequences. Given: 5", "stop"),
    case("limited", CHAT, chat(stop=["a", "b"]),
         "`stop` supports up to 1 stop sequences. Given: 2", "stop"),
    case("default", CHAT, chat(None),
         "messages[0]: `content` may be null only with `tool_calls`", "messages"),
    # OpenAI completions.
    case("default", COMPLETIONS, completion(suffix="end"), SUFFIX_MESSAGE, "suffix"),
    case("default", COMPLETIONS, completion(prompt=[]), EMPTY_PROMPTS_MESSAGE, "prompt"),
    case("default", COMPLETIONS, completion(prompt=["a"] * 5),
         "Number of prompts exceeds the maximum allowed batch size of 4", "prompt"),
    case("limited", COMPLETIONS, completion(prompt=["a"] * 3),
         "Number of prompts exceeds the maximum allowed batch size of 2", "prompt"),
    case("default", COMPLETIONS, completion(prompt=["a", ""]), "`inputs` cannot be empty",
         "prompt"),
    case("default", COMPLETIONS, completion(logprobs=6),
         "`logprobs` must be >= 0 and <= 5. Given: 6", "logprobs"),
    case("default", COMPLETIONS, completion(repetition_penalty=-1),
         "`repetition_penalty` must be strictly positive", "repetition_penalty"),
    case("default", COMPLETIONS, completion(max_tokens=-1),
         "`max_tokens` must be >= 0 (0: score the prompt only)", "max_tokens"),
    case("default", COMPLETIONS, completion(temperature=-0.5),
         "`temperature` must be >= 0.0 and <= 2.0", "temperature"),
    # Jobs: TGI's parameters, OpenAI's error shape.
    case("default", "/v1/jobs", {"prompt": []}, "`prompt` cannot be an empty list", "prompt"),
    case("default", "/v1/jobs", {"prompt": ["a"] * 1001},
         "A job has at most 1000 prompts. Given: 1001", "prompt"),
    case("default", "/v1/jobs", job(best_of=2, do_sample=True),
         "`best_of` is not supported for jobs", "parameters.best_of"),
    case("default", "/v1/jobs", job(temperature=0),
         "`temperature` must be strictly positive", "temperature"),
    case("default", "/v1/jobs", {"prompt": ["a", ""]}, "`inputs` cannot be empty", "prompt"),
    case("default", "/v1/jobs", {"prompt": "x", "parameters": {"max_new_tokens": 5000}},
         "`inputs` tokens + `max_new_tokens` must be <= 1024. Given: 1 `inputs` tokens and "
         "5000 `max_new_tokens`"),
    # Wrong types and missing fields, as FastAPI reports them.
    case("default", "/generate", {"inputs": 5}, "`inputs`: Input should be a valid string",
         "inputs"),
    case("default", "/generate", {}, "`inputs`: Field required", "inputs"),
    case("default", "/generate", generate(max_new_tokens="many"),
         "`parameters.max_new_tokens`: Input should be a valid integer, unable to parse string "
         "as an integer", "parameters.max_new_tokens"),
    case("default", "/generate", generate(best_of=-1),
         "`parameters.best_of`: Input should be greater than or equal to 0",
         "parameters.best_of"),
    case("default", "/generate", generate(stop="x"),
         "`parameters.stop`: Input should be a valid list", "parameters.stop"),
    case("default", CHAT, {"messages": "hi"}, "`messages`: Input should be a valid list",
         "messages"),
    case("default", CHAT, {"messages": [{"role": "robot", "content": "hi"}]},
         "`messages[0].role`: Input should be 'system', 'developer', 'user', 'assistant' or "
         "'tool'", "messages[0].role"),
    case("default", COMPLETIONS, completion(stop=5),
         "`stop`: Input should be a valid string or Input should be a valid list", "stop"),
    case("default", COMPLETIONS, [1],
         "request body: Input should be a valid dictionary or object to extract fields from"),
    case("default", "/v1/jobs", {"prompt": "x", "priority": "urgent"},
         "`priority`: Input should be 'interactive' or 'bulk'", "priority"),
]  # fmt: skip


@pytest.mark.parametrize(("api", "route", "body", "message", "param"), VALIDATION_CASES)
def test_validation_message(
    default: httpx.Client,
    limited: httpx.Client,
    api: str,
    route: str,
    body: Any,
    message: str,
    param: str | None,
) -> None:
    client = default if api == "default" else limited
    response = client.post(route, json=body)
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.json() == expected_error(route, message, param)


@pytest.mark.parametrize("route", ["/generate", CHAT, COMPLETIONS, "/v1/jobs"])
def test_malformed_json(default: httpx.Client, route: str) -> None:
    raw = '{"inputs": "x", '
    with pytest.raises(json.JSONDecodeError) as parse_error:
        json.loads(raw)
    message = f"Failed to parse the request body as JSON: {parse_error.value.msg}"
    response = default.post(route, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    assert response.json() == expected_error(route, message, None)


def test_invalid_last_event_id(default: httpx.Client) -> None:
    created = default.post("/v1/jobs", json=job(max_new_tokens=1))
    events = f"/v1/jobs/{created.json()['id']}/events"
    response = default.get(events, headers={"Last-Event-ID": "x"})
    message = "Invalid Last-Event-ID 'x': expected '<item>.<seq>', '<item>.r' or 'done'"
    assert response.status_code == 422
    assert response.json() == openai_error(message, "Last-Event-ID")


# --- token counts, after tokenization (the `limited` api: 16 input, 32 total tokens) -----------

LONG_PROMPT = "The Python language is a programming"


@pytest.fixture(scope="module")
def num_long(tokenizer: Tokenizer) -> int:
    """The tokens of `LONG_PROMPT` as TGI routes count them (special tokens added)."""
    num_tokens = len(tokenizer.encode(LONG_PROMPT).ids)
    assert 16 < num_tokens < 32, num_tokens  # over max_input_tokens, under max_total_tokens
    return num_tokens


def total_message(num_input: int, max_new: int, max_total: int = 32) -> str:
    return (
        f"`inputs` tokens + `max_new_tokens` must be <= {max_total}. "
        f"Given: {num_input} `inputs` tokens and {max_new} `max_new_tokens`"
    )


def input_message(num_input: int, max_input: int = 16) -> str:
    return f"`inputs` must have less than {max_input} tokens. Given: {num_input}"


def test_token_counts_on_tgi_routes(limited: httpx.Client, num_long: int) -> None:
    for route in ("/generate", "/generate_stream", "/"):
        params = {"max_new_tokens": 20}
        response = limited.post(route, json={"inputs": LONG_PROMPT, "parameters": params})
        assert response.status_code == 422, (route, response.text)
        assert response.json() == tgi_error(total_message(num_long, 20)), route
        params = {"max_new_tokens": 1}
        response = limited.post(route, json={"inputs": LONG_PROMPT, "parameters": params})
        assert response.status_code == 422, (route, response.text)
        assert response.json() == tgi_error(input_message(num_long)), route
    fits = {"max_new_tokens": 2, "truncate": 8}  # the last 8 tokens are kept: it fits
    response = limited.post("/generate", json={"inputs": LONG_PROMPT, "parameters": fits})
    assert response.status_code == 200, response.text


def test_token_counts_on_openai_routes(
    limited: httpx.Client, tokenizer: Tokenizer, num_long: int
) -> None:
    rendered = ChatTemplate(CHAT_TEMPLATE).render([{"role": "user", "content": LONG_PROMPT}])
    num_chat = len(tokenizer.encode(rendered, add_special_tokens=False).ids)  # as the chat route
    response = limited.post(CHAT, json=chat(LONG_PROMPT, max_tokens=30))
    assert response.status_code == 422, response.text
    assert response.json() == openai_error(total_message(num_chat, 30), None)
    response = limited.post(COMPLETIONS, json=completion(prompt=LONG_PROMPT, max_tokens=1))
    assert response.status_code == 422, response.text
    assert response.json() == openai_error(input_message(num_long), "prompt")
    response = limited.post("/v1/jobs", json={"prompt": LONG_PROMPT, "parameters": {}})
    assert response.status_code == 422, response.text
    assert response.json() == openai_error(input_message(num_long), "prompt")


# --- invalid streams: a JSON 4xx before any SSE byte -------------------------------------------

STREAM_CASES = [
    ("/generate_stream", generate(best_of=2, do_sample=True),
     "`best_of` != 1 is not supported when streaming tokens", "best_of"),
    ("/generate_stream", generate(decoder_input_details=True),
     "`decoder_input_details` == true is not supported when streaming tokens",
     "decoder_input_details"),
    ("/generate_stream", TOO_LONG,
     "`inputs` tokens + `max_new_tokens` must be <= 1024. Given: 1 `inputs` tokens and 5000 "
     "`max_new_tokens`", None),
    ("/", {**generate(top_k=0), "stream": True}, "`top_k` must be strictly positive", "top_k"),
    (CHAT, chat(stream=True, temperature=3), "`temperature` must be >= 0.0 and <= 2.0",
     "temperature"),
    (CHAT, chat(stream=True, max_tokens=5000),
     "`inputs` tokens + `max_new_tokens` must be <= 1024. Given: {} `inputs` tokens and 5000 "
     "`max_new_tokens`", None),
    (COMPLETIONS, completion(stream=True, suffix="x"), SUFFIX_MESSAGE, "suffix"),
    (COMPLETIONS, completion(stream=True, prompt=["a"] * 5),
     "Number of prompts exceeds the maximum allowed batch size of 4", "prompt"),
]  # fmt: skip


@pytest.mark.parametrize(("route", "body", "message", "param"), STREAM_CASES)
def test_invalid_stream_is_a_json_error(
    default: httpx.Client,
    tokenizer: Tokenizer,
    route: str,
    body: Any,
    message: str,
    param: str | None,
) -> None:
    if "{}" in message:  # the chat prompt's tokens, as the route counts them
        rendered = ChatTemplate(CHAT_TEMPLATE).render(body["messages"])
        message = message.format(len(tokenizer.encode(rendered, add_special_tokens=False).ids))
    with default.stream("POST", route, json=body) as response:
        assert response.status_code == 422
        assert response.headers["content-type"] == "application/json"
        raw = response.read()
    assert b"data:" not in raw
    assert json.loads(raw) == expected_error(route, message, param)


# --- 413: the payload limit ---------------------------------------------------------------------


def test_payload_limit(limited: httpx.Client) -> None:
    message = f"Payload too large: the limit is {PAYLOAD_LIMIT} bytes"
    big = {"inputs": "x" * PAYLOAD_LIMIT}
    response = limited.post("/generate", json=big)
    assert response.status_code == 413
    assert response.json() == tgi_error(message, "payload_too_large", prefix="")
    response = limited.post(CHAT, json=chat("x" * PAYLOAD_LIMIT))
    assert response.status_code == 413
    assert response.json() == openai_error(message, None, code="payload_too_large")
    body = b'{"inputs": "x"}'  # padded with JSON whitespace (an unknown field is a 422)
    at_limit = body[:-1] + b" " * (PAYLOAD_LIMIT - len(body)) + b"}"
    assert len(at_limit) == PAYLOAD_LIMIT
    headers = {"content-type": "application/json"}
    response = limited.post("/generate", content=at_limit, headers=headers)
    assert response.status_code == 200, response.text


def test_payload_limit_on_a_chunked_body(limited: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"inputs": "'
        for _ in range(4):
            yield b"x" * (PAYLOAD_LIMIT // 2)
        yield b'"}'

    headers = {"content-type": "application/json"}
    response = limited.post("/generate", content=chunks(), headers=headers)
    assert response.status_code == 413
    assert "content-length" not in response.request.headers  # it was sent chunked
    message = f"Payload too large: the limit is {PAYLOAD_LIMIT} bytes"
    assert response.json() == tgi_error(message, "payload_too_large", prefix="")
    assert limited.post("/generate", json=generate()).status_code == 200  # the api is fine


# --- 429: concurrency ---------------------------------------------------------------------------


@contextlib.contextmanager
def paused(process: subprocess.Popen[bytes]) -> Iterator[None]:
    """The batcher frozen (SIGSTOP): what it was sent waits, so a request holds its slot for as
    long as the test needs, however fast the tiny model is."""
    process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        process.send_signal(signal.SIGCONT)


def test_concurrency_limit(sibling: StartApi, stack: Stack) -> None:
    url = sibling("api-single", MAX_CONCURRENT_REQUESTS="1").url
    rejected = 'tgq_requests_rejected{reason="concurrency"}'
    overloaded = 'tgi_request_failure{err="overloaded"}'
    invalid = 'tgi_request_failure{err="validation"}'
    with (
        httpx.Client(base_url=url, timeout=60) as client,
        httpx.Client(base_url=url, timeout=60) as holder,
        contextlib.ExitStack() as hold,
    ):
        before = {name: metric(client, name) for name in (rejected, overloaded, invalid)}
        successes = metric(client, "tgi_request_success")
        with paused(stack.batchers[0]):
            held = hold.enter_context(holder.stream("POST", "/generate_stream", json=HOLD))
            assert held.status_code == 200  # admitted and enqueued: the only slot is taken
            response = client.post("/generate", json=generate())
            assert response.status_code == 429 and response.headers["retry-after"] == "1"
            assert response.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
            response = client.post(CHAT, json=chat())
            assert response.status_code == 429 and response.headers["retry-after"] == "1"
            assert response.json() == openai_error(
                "Model is overloaded", None, kind="rate_limit_error", code="overloaded"
            )
            response = client.post("/generate", json=TOO_LONG)  # a 422, had it been tokenized
            assert response.status_code == 429
        first = json.loads(next(held.iter_lines()).removeprefix("data:"))
        assert first["index"] == 1  # the held request really runs
        assert metric(client, "tgi_request_success") == successes
        hold.close()  # the client hangs up: the slot is given back
        assert metric(client, rejected) == before[rejected] + 3
        assert metric(client, overloaded) == before[overloaded] + 3
        assert metric(client, invalid) == before[invalid]  # none reached the tokenizer
        eventually(
            lambda: metric(client, "tgq_requests_in_flight") == 0, 10, "the slot is given back"
        )
        assert client.post("/generate", json=generate()).status_code == 200
        assert client.post(CHAT, json=chat()).status_code == 200
        assert client.post("/generate", json=TOO_LONG).status_code == 422  # now it is tokenized
        assert metric(client, invalid) == before[invalid] + 1
        assert metric(client, rejected) == before[rejected] + 3


# --- an api whose prefix has no batcher: the queue bound and /health ---------------------------


@pytest.fixture(scope="module")
def orphan(stack: Stack) -> Iterator[httpx.Client]:
    """An api on a Redis prefix that no batcher serves: what it enqueues stays queued."""
    api = Stack(
        stack.model_dir, stack.database_url, stack.log_dir, prefix=f"test-{uuid.uuid4().hex}",
        name="api-orphan", api_env={"MAX_QUEUED_REQUESTS": str(MAX_QUEUED)},
    )  # fmt: skip
    try:
        api.start_api(healthy=False)
        with httpx.Client(base_url=api.url, timeout=60) as client:
            yield client
    finally:
        api.stop()  # its own prefix: clearing its keys is right


def test_health_without_a_batcher(orphan: httpx.Client) -> None:
    for path in ("/health", "/ping", "/"):
        response = orphan.get(path)
        assert response.status_code == 503, path
        assert response.json() == {
            "error": "unhealthy: no batcher is alive",
            "error_type": "healthcheck",
        }


def test_queue_bound(orphan: httpx.Client) -> None:
    rejected = 'tgq_requests_rejected{reason="queue_requests"}'
    invalid = 'tgi_request_failure{err="validation"}'
    before, invalid_before = metric(orphan, rejected), metric(orphan, invalid)
    for _ in range(MAX_QUEUED):
        assert orphan.post("/v1/jobs", json=job()).status_code == 202
    # The monitor reads the queue's depth from Redis (every 0.25 s) into the admission and the
    # gauge at once: the gauge shows when the admission knows the queue is full.
    eventually(
        lambda: metric(orphan, "tgi_queue_size") == MAX_QUEUED, 10, "the monitor read a full queue"
    )
    message = f"Queue is full: {MAX_QUEUED} requests queued (max_queued_requests={MAX_QUEUED})"
    response = orphan.post("/v1/jobs", json=job())
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    assert response.json() == openai_error(
        message, None, kind="rate_limit_error", code="overloaded"
    )
    response = orphan.post("/generate", json=TOO_LONG)  # admission first: no tokenization
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    assert response.json() == {"error": message, "error_type": "overloaded"}
    response = orphan.post(CHAT, json=chat())
    assert response.status_code == 429
    assert response.json()["error"]["type"] == "rate_limit_error"
    assert metric(orphan, rejected) == before + 3
    assert metric(orphan, invalid) == invalid_before
    assert metric(orphan, "tgi_queue_size") == MAX_QUEUED
    assert metric(orphan, "tgi_request_success") == 0


# --- auth ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(sibling: StartApi) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sibling("api-keyed", API_KEY=API_KEY).url, timeout=60) as client:
        yield client


def all_routes(keyed: httpx.Client) -> set[tuple[str, str]]:
    """(method, path) of every route in the OpenAPI document, path parameters filled in, plus
    the routes the document leaves out."""
    spec = keyed.get("/openapi.json", headers={"Authorization": f"Bearer {API_KEY}"})
    assert spec.status_code == 200
    routes = {
        (method.upper(), path.replace("{job_id}", "job_x"))
        for path, operations in spec.json()["paths"].items()
        for method in operations
    }
    assert {("POST", "/generate"), ("POST", CHAT), ("GET", "/v1/jobs/job_x")} <= routes
    hidden = ("/metrics", "/ping", "/", "/docs", "/redoc", "/openapi.json", "/api-doc/openapi.json")
    return routes | {("GET", path) for path in hidden}


def test_every_non_public_route_needs_the_key(keyed: httpx.Client) -> None:
    routes = all_routes(keyed)
    protected = sorted(route for route in routes if route[1] not in PUBLIC_ROUTES)
    assert len(protected) >= 15, protected
    attempts = [
        ({}, MISSING_KEY),
        ({"Authorization": "Bearer wrong"}, INVALID_KEY),
        ({"Authorization": f"Basic {API_KEY}"}, MISSING_KEY),
    ]
    for method, path in protected:
        for headers, message in attempts:
            response = keyed.request(method, path, headers=headers)
            where = (method, path, headers)
            assert response.status_code == 401, where
            assert response.headers["www-authenticate"] == "Bearer", where
            if path.startswith("/v1/"):
                expected = openai_error(message, None, code="invalid_api_key")
            else:
                expected = tgi_error(message, "unauthorized", prefix="")
            assert response.json() == expected, where


def test_public_routes_and_the_key(keyed: httpx.Client) -> None:
    for path in PUBLIC_ROUTES:
        assert keyed.get(path).status_code == 200, path
    headers = {"Authorization": f"Bearer {API_KEY}"}
    response = keyed.post("/generate", json=generate(), headers=headers)
    assert response.status_code == 200, response.text
    assert keyed.post(CHAT, json=chat(), headers=headers).status_code == 200
    assert keyed.get("/v1/jobs", headers=headers).status_code == 200
    assert keyed.get("/docs", headers=headers).status_code == 200


# --- start-up on a database that was never migrated ---------------------------------------------


def test_refuses_an_unmigrated_database(
    text_model_dir: Path, empty_pg_url: str, tmp_path: Path
) -> None:
    api = Stack(text_model_dir, empty_pg_url, tmp_path, name="api-unmigrated")
    try:
        with pytest.raises(RuntimeError, match="the api exited"):
            api.start_api()
        assert api.api is not None and api.api.returncode != 0
        log = api.api_log()
        assert "database schema is at revision none" in log
        assert "run `tgq migrate` (or `python -m tgq.api.db.migrate`)" in log
    finally:
        api.stop()


def test_every_rejection_is_counted_once(default: httpx.Client) -> None:
    """TGI counts every validation error: before tokenization, after it, and template errors."""
    sample = 'tgi_request_failure{err="validation"}'
    before = metric(default, sample), metric(default, "tgi_request_count")
    assert default.post("/generate", json=generate(temperature=0)).status_code == 422
    assert default.post("/generate", json=generate(max_new_tokens=5000)).status_code == 422
    assert default.post(CHAT, json=chat(top_logprobs=3)).status_code == 422
    after = metric(default, sample), metric(default, "tgi_request_count")
    assert (after[0] - before[0], after[1] - before[1]) == (3, 3)
