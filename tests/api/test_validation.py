"""Edge validation: every rejection message (exact text), TGI's sampling rules and defaults,
the OpenAI mappings, and how errors render (bodies, status codes, headers) in both flavours."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tgq.api.errors import (
    ApiError,
    GenerationError,
    NotFoundError,
    OverloadedError,
    PayloadTooLargeError,
    RouteValidationError,
    TemplateError,
    UnauthorizedError,
    UnavailableError,
    ValidationError,
    install_error_handlers,
    stream_error_event,
)
from tgq.api.openai_validation import chat_params, completion_params, completion_prompts
from tgq.api.schemas.openai import ChatCompletionRequest, CompletionRequest
from tgq.api.schemas.tgi import Details, GenerateParameters, GenerateRequest, StreamResponse, Token
from tgq.api.settings import Settings
from tgq.api.validated import GenerationParams
from tgq.api.validation import check_inputs, tgi_params, validate_tokens
from tgq.batcher.request import Priority

SETTINGS = Settings.model_validate(
    {"max_input_tokens": 6, "max_total_tokens": 10, "enable_prefill_logprobs": True}
)
USER = [{"role": "user", "content": "hi"}]


def _tgi(parameters: dict[str, Any], *, is_stream: bool = False, **limits: Any) -> GenerationParams:
    request = GenerateRequest.model_validate({"inputs": "x", "parameters": parameters})
    settings = Settings.model_validate(limits) if limits else SETTINGS
    return tgi_params(request.parameters, settings, is_stream=is_stream)


def _chat(**fields: Any) -> GenerationParams:
    return chat_params(ChatCompletionRequest.model_validate({"messages": USER, **fields}), SETTINGS)


def _completion(**fields: Any) -> GenerationParams:
    request = CompletionRequest.model_validate({"prompt": "hi", **fields})
    return completion_params(request, SETTINGS)


def _rejection(call: Callable[[], object]) -> ValidationError:
    with pytest.raises(ValidationError) as caught:
        call()
    return caught.value


# --- TGI messages ------------------------------------------------------------------------------

TGI_REJECTIONS: list[tuple[dict[str, Any], bool, dict[str, Any], str]] = [
    ({"best_of": 2}, True, {}, "`best_of` != 1 is not supported when streaming tokens"),
    (
        {"decoder_input_details": True},
        True,
        {},
        "`decoder_input_details` == true is not supported when streaming tokens",
    ),
    ({"best_of": 2}, False, {"max_best_of": 1}, "`best_of` != 1 is not allowed for this endpoint"),
    ({"best_of": 3, "do_sample": True}, False, {}, "`best_of` must be > 0 and <= 2. Given: 3"),
    ({"best_of": 0}, False, {}, "`best_of` must be > 0 and <= 2. Given: 0"),
    ({"best_of": 2}, False, {}, "you must use sampling when `best_of` is > 1"),
    (
        {"best_of": 2, "do_sample": True, "seed": 1},
        False,
        {},
        "`seed` must not be set when `best_of` > 1",
    ),
    ({"temperature": 0.0}, False, {}, "`temperature` must be strictly positive"),
    ({"repetition_penalty": 0.0}, False, {}, "`repetition_penalty` must be strictly positive"),
    ({"frequency_penalty": 2.5}, False, {}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"frequency_penalty": -2.5}, False, {}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"top_p": 0.0}, False, {}, "`top_p` must be > 0.0 and <= 1.0"),
    ({"top_p": 1.5}, False, {}, "`top_p` must be > 0.0 and <= 1.0"),
    ({"typical_p": 0.0}, False, {}, "`typical_p` must be > 0.0 and <= 1.0"),
    ({"top_k": 0}, False, {}, "`top_k` must be strictly positive"),
    ({"top_k": -1}, False, {}, "`top_k` must be strictly positive"),
    ({"max_new_tokens": 0}, False, {}, "`max_new_tokens` must be strictly positive"),
    ({"stop": ["a"] * 5}, False, {}, "`stop` supports up to 4 stop sequences. Given: 5"),
    ({"top_n_tokens": 6}, False, {}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
    ({"truncate": 0}, False, {}, "`truncate` must be strictly positive and less than 6. Given: 0"),
    ({"truncate": 7}, False, {}, "`truncate` must be strictly positive and less than 6. Given: 7"),
    (
        {"grammar": {"type": "regex", "value": "a("}},
        False,
        {},
        'grammar is not valid: invalid regex: invalid regex "a(" (in regex): regex parse error: '
        "a( error: unclosed group",
    ),
    ({"watermark": True}, False, {}, "`watermark` is not supported"),
    # TGI's order: the first failing check wins.
    (
        {"best_of": 2, "temperature": 0.0},
        True,
        {},
        "`best_of` != 1 is not supported when streaming tokens",
    ),
    ({"temperature": 0.0, "top_p": 0.0}, False, {}, "`temperature` must be strictly positive"),
    ({"top_k": 0, "stop": ["a"] * 5}, False, {}, "`top_k` must be strictly positive"),
]


@pytest.mark.parametrize(("parameters", "is_stream", "limits", "message"), TGI_REJECTIONS)
def test_tgi_rejections(
    parameters: dict[str, Any], is_stream: bool, limits: dict[str, Any], message: str
) -> None:
    settings = {"max_input_tokens": 6, "max_total_tokens": 10, **limits}
    with pytest.raises(ValidationError) as caught:
        _tgi(parameters, is_stream=is_stream, **settings)
    assert caught.value.message == message


def test_tgi_accepts_top_p_one_and_best_of_with_sampling() -> None:
    assert _tgi({"top_p": 1.0, "typical_p": 1.0}).sampling.is_greedy
    params = _tgi({"best_of": 2, "temperature": 0.7})
    assert params.best_of == 2
    assert params.sampling.logprobs  # best_of ranks by mean logprob


# --- TGI sampling semantics and defaults --------------------------------------------------------


def test_omitted_parameters_sample_present_parameters_do_not() -> None:
    omitted = GenerateRequest.model_validate({"inputs": "x"})
    present = GenerateRequest.model_validate({"inputs": "x", "parameters": {}})
    assert omitted.parameters.do_sample
    assert not present.parameters.do_sample
    assert tgi_params(None, SETTINGS, is_stream=False).sampling.temperature == 1.0
    assert tgi_params(omitted.parameters, SETTINGS, is_stream=False).sampling.temperature == 1.0
    assert tgi_params(present.parameters, SETTINGS, is_stream=False).sampling.is_greedy


@pytest.mark.parametrize(
    ("parameters", "is_greedy"),
    [
        ({}, True),
        ({"do_sample": True}, False),
        ({"temperature": 1.0}, True),  # tokens.py: temperature 1.0 is no warper
        ({"temperature": 0.5}, False),
        ({"top_k": 10}, False),
        ({"top_p": 1.0}, True),
        ({"top_p": 0.9}, False),
        ({"typical_p": 0.9}, False),
        ({"repetition_penalty": 1.2}, True),
    ],
)
def test_tgi_do_sample_mapping(parameters: dict[str, Any], is_greedy: bool) -> None:
    assert _tgi(parameters).sampling.is_greedy is is_greedy


def test_tgi_sampling_values_and_presentation() -> None:
    params = _tgi(
        {
            "temperature": 0.5,
            "top_k": 10,
            "top_p": 0.9,
            "typical_p": 0.8,
            "repetition_penalty": 1.1,
            "frequency_penalty": 0.5,
            "seed": 7,
            "top_n_tokens": 3,
            "stop": ["\n", ""],
            "details": True,
            "max_new_tokens": 4,
            "truncate": 5,
        }
    )
    sampling = params.sampling
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.typical_p) == (
        0.5,
        10,
        0.9,
        0.8,
    )
    assert (sampling.repetition_penalty, sampling.frequency_penalty, sampling.seed) == (1.1, 0.5, 7)
    assert (sampling.logprobs, sampling.top_n_logprobs, params.top_n_tokens) == (True, 3, 3)
    assert params.stop_strings == ("\n",)  # empty stop strings are dropped
    assert params.include_stop_string
    assert (params.details, params.max_new_tokens, params.truncate) == (True, 4, 5)


def test_tgi_greedy_keeps_penalties() -> None:
    sampling = _tgi({"repetition_penalty": 1.3, "frequency_penalty": 0.2}).sampling
    assert sampling.is_greedy
    assert (sampling.repetition_penalty, sampling.frequency_penalty) == (1.3, 0.2)


def test_tgi_logprobs_only_when_shown_and_return_full_text_default() -> None:
    assert not _tgi({}).sampling.logprobs
    assert _tgi({}, is_stream=True).sampling.logprobs  # every stream event carries one
    assert not _tgi({}).return_full_text
    for parameters, expected in [({}, True), ({"return_full_text": False}, False)]:
        request = GenerateParameters.model_validate(parameters)
        params = tgi_params(request, SETTINGS, is_stream=False, return_full_text_default=True)
        assert params.return_full_text is expected  # the `/` route's pipeline-tag default


# --- OpenAI ------------------------------------------------------------------------------------

CHAT_REJECTIONS: list[tuple[dict[str, Any], str, str]] = [
    ({"messages": []}, "`messages` cannot be empty", "messages"),
    ({"temperature": -0.1}, "`temperature` must be >= 0.0 and <= 2.0", "temperature"),
    ({"temperature": 2.1}, "`temperature` must be >= 0.0 and <= 2.0", "temperature"),
    ({"top_p": 0.0}, "`top_p` must be > 0.0 and <= 1.0", "top_p"),
    (
        {"frequency_penalty": 2.1},
        "`frequency_penalty` must be >= -2.0 and <= 2.0",
        "frequency_penalty",
    ),
    (
        {"presence_penalty": -2.1},
        "`presence_penalty` must be >= -2.0 and <= 2.0",
        "presence_penalty",
    ),
    ({"n": 0}, "`n` must be >= 1 and <= 8. Given: 0", "n"),
    ({"n": 9}, "`n` must be >= 1 and <= 8. Given: 9", "n"),
    (
        {"logprobs": True, "top_logprobs": 6},
        "`top_logprobs` must be >= 0 and <= 5. Given: 6",
        "top_logprobs",
    ),
    ({"top_logprobs": 2}, "`logprobs` must be true when `top_logprobs` is set", "logprobs"),
    ({"stop": ["a"] * 5}, "`stop` supports up to 4 stop sequences. Given: 5", "stop"),
    ({"max_tokens": 0}, "`max_tokens` must be strictly positive", "max_tokens"),
    (
        {"max_completion_tokens": 0},
        "`max_completion_tokens` must be strictly positive",
        "max_completion_tokens",
    ),
    ({"logit_bias": {"42": 5.0}}, "`logit_bias` is not supported", "logit_bias"),
    ({"tool_choice": "required"}, '`tool_choice` "required" needs `tools`', "tool_choice"),
    (
        {"response_format": {"type": "xml"}},
        "`response_format` of type `xml` is not supported "
        "(text, json_object, json_schema; or TGI's json, regex with a `value`)",
        "response_format",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        },
        "image content is not supported",
        "messages[0].content",
    ),
]


@pytest.mark.parametrize(("fields", "message", "param"), CHAT_REJECTIONS)
def test_chat_rejections(fields: dict[str, Any], message: str, param: str) -> None:
    with pytest.raises(ValidationError) as caught:
        _chat(**fields)
    assert (caught.value.message, caught.value.param) == (message, param)


def test_chat_defaults_and_mappings() -> None:
    params = _chat()
    assert params.sampling.temperature == 1.0  # OpenAI's default samples
    assert (params.num_choices, params.max_new_tokens, params.stop_strings) == (1, None, ())
    assert not params.include_stop_string
    assert not params.add_special_tokens  # the chat template adds them
    assert _chat(temperature=0).sampling.is_greedy
    assert _chat(n=3).num_choices == 3
    assert _chat(stop="END").stop_strings == ("END",)
    assert _chat(stop=["a", "b"]).stop_strings == ("a", "b")
    assert _chat(top_p=1.0).sampling.top_p == 1.0


def test_chat_logprobs_penalties_and_max_tokens() -> None:
    params = _chat(logprobs=True, top_logprobs=3)
    assert (params.sampling.logprobs, params.sampling.top_n_logprobs, params.top_n_tokens) == (
        True,
        3,
        3,
    )
    sampling = _chat(presence_penalty=-2.0, frequency_penalty=0.5, seed=9).sampling
    assert (sampling.presence_penalty, sampling.repetition_penalty) == (-2.0, 1.0)
    assert (sampling.frequency_penalty, sampling.seed) == (0.5, 9)
    assert _chat(max_tokens=5).max_new_tokens == 5
    assert _chat(max_tokens=5, max_completion_tokens=7).max_new_tokens == 7
    assert _chat(max_tokens=0, max_completion_tokens=7).max_new_tokens == 7


def test_chat_accepts_what_means_plain_text() -> None:
    params = _chat(
        logit_bias={},
        tools=[],
        tool_choice="none",
        response_format={"type": "text"},
        stream=True,
        n=2,
    )
    assert params.num_choices == 2


def test_completion_suffix_is_rejected_as_tgi_does() -> None:
    with pytest.raises(RouteValidationError) as suffix:
        _completion(suffix="")
    assert suffix.value.message == (
        "Suffix is not supported and can be achieved by preprocessing the prompt."
    )
    assert (suffix.value.error_type, suffix.value.param) == ("suffix not supported", "suffix")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"logprobs": 6}, "`logprobs` must be >= 0 and <= 5. Given: 6"),
        ({"logprobs": -1}, "`logprobs` must be >= 0 and <= 5. Given: -1"),
        ({"repetition_penalty": 0.0}, "`repetition_penalty` must be strictly positive"),
        ({"max_tokens": -1}, "`max_tokens` must be >= 0 (0: score the prompt only)"),
        (
            {"max_tokens": 0, "stream": True},
            "`max_tokens` 0 (score the prompt only) is not supported when streaming",
        ),
        ({"n": 9}, "`n` must be >= 1 and <= 8. Given: 9"),
        ({"temperature": 3}, "`temperature` must be >= 0.0 and <= 2.0"),
    ],
)
def test_completion_rejections(fields: dict[str, Any], message: str) -> None:
    assert _rejection(lambda: _completion(**fields)).message == message


def test_completion_mappings() -> None:
    params = _completion(logprobs=2, echo=True, repetition_penalty=1.2, temperature=0, n=2)
    assert params.sampling.is_greedy
    assert (params.sampling.logprobs, params.sampling.top_n_logprobs) == (True, 2)
    assert (params.return_full_text, params.decoder_input_details) == (True, True)
    assert params.sampling.prompt_logprobs == 2  # the echoed prompt's tokens, with their top 2
    assert (params.sampling.repetition_penalty, params.num_choices) == (1.2, 2)
    assert params.add_special_tokens
    plain = _completion()
    assert not plain.sampling.logprobs
    assert not plain.return_full_text


def test_completion_prompts() -> None:
    def prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
        return completion_prompts(CompletionRequest(prompt=prompt), SETTINGS)

    assert prompts("a") == ["a"]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([5, 6, 7]) == [[5, 6, 7]]  # token ids, as lm-eval sends them
    assert prompts([[5, 6], [7]]) == [[5, 6], [7]]
    error = _rejection(lambda: prompts([[5], []]))
    assert error.message == "A prompt given as token ids needs at least one token."
    empty = "Empty array detected. Do not use an empty array for the prompt."
    assert _rejection(lambda: prompts([])).message == empty
    assert _rejection(lambda: prompts(["a", ""])).message == "`inputs` cannot be empty"
    with pytest.raises(RouteValidationError) as caught:
        prompts(["a"] * 5)
    assert caught.value.message == "Number of prompts exceeds the maximum allowed batch size of 4"
    assert caught.value.error_type == "batch size exceeded"


# --- After tokenization ------------------------------------------------------------------------


def _validate(token_ids: list[int], params: GenerationParams) -> Any:
    return validate_tokens(prompt="p", token_ids=token_ids, params=params, settings=SETTINGS)


def test_check_inputs() -> None:
    check_inputs(" ")
    assert _rejection(lambda: check_inputs("")).message == "`inputs` cannot be empty"


@pytest.mark.parametrize(
    ("num_tokens", "parameters", "message"),
    [
        (0, {}, "`inputs` cannot be empty"),
        (
            5,
            {"max_new_tokens": 6},
            "`inputs` tokens + `max_new_tokens` must be <= 10. Given: 5 `inputs` tokens and 6 "
            "`max_new_tokens`",
        ),
        (7, {"max_new_tokens": 1}, "`inputs` must have less than 6 tokens. Given: 7"),
        (7, {}, "`inputs` must have less than 6 tokens. Given: 7"),
        # TGI checks the total first: the default `max_new_tokens` is what is left, here 0.
        (
            11,
            {},
            "`inputs` tokens + `max_new_tokens` must be <= 10. Given: 11 `inputs` tokens and 0 "
            "`max_new_tokens`",
        ),
    ],
)
def test_token_rejections(num_tokens: int, parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as caught:
        _validate(list(range(num_tokens)), _tgi(parameters))
    assert caught.value.message == message


def test_validate_tokens_truncates_and_resolves_max_new_tokens() -> None:
    params = _tgi({"truncate": 3, "stop": ["x"]})
    request = validate_tokens(
        prompt="p",
        token_ids=list(range(20)),
        params=params,
        settings=SETTINGS,
        priority=Priority.BULK,
        deadline=12.5,
        eos_token_ids=frozenset({2}),
    )
    assert request.prompt_token_ids == [17, 18, 19]  # the last `truncate` tokens
    assert request.stopping.max_new_tokens == 7  # max_total_tokens - input length
    assert request.stopping.eos_token_ids == frozenset({2})
    assert request.stopping.stop_strings == ("x",)
    assert (request.priority, request.deadline, request.params) == (Priority.BULK, 12.5, params)
    assert _validate([1, 2], _tgi({"max_new_tokens": 3})).stopping.max_new_tokens == 3


def test_edge_modules_do_not_import_torch() -> None:
    code = "import sys, api.errors, api.validation; assert 'torch' not in sys.modules"
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


# --- Schemas -----------------------------------------------------------------------------------


def test_responses_omit_what_tgi_omits() -> None:
    token = Token(id=1, text="a", logprob=-0.5, special=False)
    details = Details(finish_reason="length", generated_tokens=1, prefill=[], tokens=[token])
    assert set(details.model_dump()) == {
        "finish_reason",
        "generated_tokens",
        "seed",
        "prefill",
        "tokens",
    }
    event = StreamResponse(index=1, token=token).model_dump()
    assert event == {
        "index": 1,
        "token": token.model_dump(),
        "generated_text": None,
        "details": None,
    }
    assert "top_tokens" in StreamResponse(index=1, token=token, top_tokens=[token]).model_dump()


# --- Rendering ---------------------------------------------------------------------------------

ERRORS: dict[str, ApiError] = {
    "validation": ValidationError("`top_k` must be strictly positive", param="top_k"),
    "suffix": RouteValidationError("No suffix.", error_type="suffix not supported", param="suffix"),
    "template": TemplateError("no chat template"),
    "generation": GenerationError("CUDA out of memory"),
    "overloaded": OverloadedError(retry_after_s=3),
    "not_found": NotFoundError("job 7 not found"),
    "unavailable": UnavailableError("database is down", retry_after_s=5),
    "too_large": PayloadTooLargeError("body over 10 bytes"),
    "unauthorized": UnauthorizedError("invalid API key"),
    "internal": ApiError("boom"),
}

# name -> (status, TGI body, OpenAI (message, type, param, code), extra headers)
RENDERED: dict[
    str, tuple[int, dict[str, str], tuple[str, str, str | None, str | None], dict[str, str]]
] = {
    "validation": (
        422,
        {
            "error": "Input validation error: `top_k` must be strictly positive",
            "error_type": "validation",
        },
        ("`top_k` must be strictly positive", "invalid_request_error", "top_k", None),
        {},
    ),
    "suffix": (
        422,
        {"error": "No suffix.", "error_type": "suffix not supported"},
        ("No suffix.", "invalid_request_error", "suffix", None),
        {},
    ),
    "template": (
        422,
        {"error": "Template error: no chat template", "error_type": "template_error"},
        ("Template error: no chat template", "invalid_request_error", None, "template_error"),
        {},
    ),
    "generation": (
        424,
        {
            "error": "Request failed during generation: CUDA out of memory",
            "error_type": "generation",
        },
        (
            "Request failed during generation: CUDA out of memory",
            "server_error",
            None,
            "generation",
        ),
        {},
    ),
    "overloaded": (
        429,
        {"error": "Model is overloaded", "error_type": "overloaded"},
        ("Model is overloaded", "rate_limit_error", None, "overloaded"),
        {"retry-after": "3"},
    ),
    "not_found": (
        404,
        {"error": "job 7 not found", "error_type": "not_found"},
        ("job 7 not found", "invalid_request_error", None, "not_found"),
        {},
    ),
    "unavailable": (
        503,
        {"error": "database is down", "error_type": "unavailable"},
        ("database is down", "server_error", None, "unavailable"),
        {"retry-after": "5"},
    ),
    "too_large": (
        413,
        {"error": "body over 10 bytes", "error_type": "payload_too_large"},
        ("body over 10 bytes", "invalid_request_error", None, "payload_too_large"),
        {},
    ),
    "unauthorized": (
        401,
        {"error": "invalid API key", "error_type": "unauthorized"},
        ("invalid API key", "invalid_request_error", None, "invalid_api_key"),
        {"www-authenticate": "Bearer"},
    ),
    "internal": (
        500,
        {"error": "boom", "error_type": "internal"},
        ("boom", "server_error", None, None),
        {},
    ),
}


def _build_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/raise/{name}")
    @app.get("/v1/raise/{name}")
    def raise_error(name: str) -> None:
        raise ERRORS[name]

    @app.post("/generate")
    def generate(body: GenerateRequest) -> dict[str, str]:
        return {"inputs": body.inputs}

    @app.post("/v1/chat/completions")
    def chat(body: ChatCompletionRequest) -> dict[str, int]:
        return {"messages": len(body.messages)}

    return app


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(_build_app())


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_renders_tgi_and_openai(client: TestClient, name: str) -> None:
    status, tgi_body, (message, kind, param, code), headers = RENDERED[name]
    tgi = client.get(f"/raise/{name}")
    openai = client.get(f"/v1/raise/{name}")
    assert (tgi.status_code, tgi.json()) == (status, tgi_body)
    expected = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    assert (openai.status_code, openai.json()) == (status, expected)
    for response in (tgi, openai):
        assert {k: response.headers.get(k) for k in headers} == headers
        assert ("retry-after" in response.headers) == ("retry-after" in headers)


def test_malformed_json_in_both_flavours(client: TestClient) -> None:
    headers = {"content-type": "application/json"}
    tgi = client.post("/generate", content=b"{bad", headers=headers)
    openai = client.post("/v1/chat/completions", content=b"{bad", headers=headers)
    reason = (
        "Failed to parse the request body as JSON: "
        "Expecting property name enclosed in double quotes"
    )
    assert (tgi.status_code, tgi.json()) == (
        422,
        {"error": f"Input validation error: {reason}", "error_type": "validation"},
    )
    assert (openai.status_code, openai.json()["error"]) == (
        422,
        {"message": reason, "type": "invalid_request_error", "param": None, "code": None},
    )


def test_wrong_types_name_the_field(client: TestClient) -> None:
    body = {"inputs": "x", "parameters": {"temperature": "hot", "max_new_tokens": -1}}
    tgi = client.post("/generate", json=body)
    assert tgi.status_code == 422
    assert tgi.json() == {
        "error": "Input validation error: `parameters.temperature`: Input should be a valid "
        "number, unable to parse string as a number; `parameters.max_new_tokens`: Input should be "
        "greater than or equal to 0",
        "error_type": "validation",
    }
    openai = client.post("/v1/chat/completions", json={"messages": [{"role": "robot"}], "stop": 3})
    assert openai.status_code == 422
    assert openai.json()["error"] == {
        "message": "`messages[0].role`: Input should be 'system', 'developer', 'user', 'assistant' "
        "or 'tool'; `stop`: Input should be a valid string or Input should be a valid list",
        "type": "invalid_request_error",
        "param": "messages[0].role",
        "code": None,
    }


def test_missing_body_and_unknown_fields(client: TestClient) -> None:
    assert client.post("/generate").json() == {
        "error": "Input validation error: request body: Field required",
        "error_type": "validation",
    }
    # Unknown fields parse: they are kept for `api.request_fields` to reject by name.
    ok = client.post("/generate", json={"inputs": "x", "stream": True, "whatever": 1})
    assert (ok.status_code, ok.json()) == (200, {"inputs": "x"})
    body = GenerateRequest.model_validate({"inputs": "x", "whatever": 1})
    assert body.model_extra == {"whatever": 1}


def test_stream_error_events() -> None:
    error = OverloadedError(retry_after_s=1)
    tgi = stream_error_event(error, flavour="tgi")
    openai = stream_error_event(error, flavour="openai")
    assert tgi.startswith("data: ")
    assert tgi.endswith("\n\n")
    assert json.loads(tgi.removeprefix("data: ")) == {
        "error": "Model is overloaded",
        "error_type": "overloaded",
    }
    assert json.loads(openai.removeprefix("data: "))["error"] == {
        "message": "Model is overloaded",
        "type": "rate_limit_error",
        "param": None,
        "code": "overloaded",
    }


def test_prompt_logprobs_need_the_flag() -> None:
    """`decoder_input_details` and completions `echo` with `logprobs` ask for the prompt's
    logprobs: without --enable-prefill-logprobs (TGI's default) a 422 names the flag; with it
    the engine computes them (`prompt_logprobs`). Echo without logprobs needs nothing."""
    off = Settings.model_validate({"max_input_tokens": 6, "max_total_tokens": 10})
    message = (
        "prompt logprobs are off on this server (asked by `{}`): start it with"
        " --enable-prefill-logprobs (env ENABLE_PREFILL_LOGPROBS=true)"
    )
    tgi = GenerateRequest.model_validate(
        {"inputs": "x", "parameters": {"decoder_input_details": True}}
    )
    error = _rejection(lambda: tgi_params(tgi.parameters, off, is_stream=False))
    assert (error.message, error.param) == (
        message.format("decoder_input_details"),
        "decoder_input_details",
    )
    echo = CompletionRequest.model_validate({"prompt": "hi", "echo": True, "logprobs": 1})
    error = _rejection(lambda: completion_params(echo, off))
    assert (error.message, error.param) == (message.format("echo"), "echo")
    plain_echo = CompletionRequest.model_validate({"prompt": "hi", "echo": True})
    assert completion_params(plain_echo, off).sampling.prompt_logprobs is None
    assert _tgi({"decoder_input_details": True}).sampling.prompt_logprobs == 0
