"""Every request field of TGI's and OpenAI's schemas (and the vLLM extras tgq takes) either works
or is rejected with a message naming it: each is listed here, sent through HTTP to the real stack,
and either checked for its effect or for its exact rejection.

The model is built so that its output never depends on what random weights happen to emit: every
position's hidden state is the same vector (embedding rows all equal, attention and MLP outputs
zero), EOS gets logit 10 and one chosen token `X` logit 5, all others about 0. Greedy output is
EOS at once; with `min_tokens: k` it is `X` k times, then EOS. OpenAI requests are greedy
(`temperature: 0`) unless the case says otherwise.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from pydantic import BaseModel
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from tests.api.stack import BLOCK_SIZE, Stack, running_stack, write_text_model
from tests.api.test_http_jobs import wait_for
from tests.polling import eventually
from tgq.api.schemas.openai import ChatCompletionRequest, CompletionRequest
from tgq.api.schemas.tgi import CompatGenerateRequest, GenerateParameters
from tgq.api.tools import TOOL_CHOICE_MESSAGE

pytestmark = pytest.mark.timeout(300)
EOS = 2  # the random model's `eos_token_id`
MODEL_ID = "tgq-test"
TGI_INPUTS = "Hello world, this is a test"
X_TEXT = "the"  # the text of `X`, the second most likely token everywhere

# Field names copied from the reference specs (TGI's openapi.json; OpenAI's API reference).
TGI_PARAMETERS = (
    "adapter_id", "best_of", "decoder_input_details", "details", "do_sample",
    "frequency_penalty", "grammar", "max_new_tokens", "repetition_penalty", "return_full_text",
    "seed", "stop", "temperature", "top_k", "top_n_tokens", "top_p", "truncate", "typical_p",
    "watermark",
)  # fmt: skip
TGI_REQUEST = ("inputs", "parameters", "stream")  # `stream`: CompatGenerateRequest (`/`)
OPENAI_CHAT = (
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions",
    "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities",
    "moderation", "n", "parallel_tool_calls", "prediction", "presence_penalty",
    "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "reasoning_effort",
    "response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
    "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user",
    "verbosity", "web_search_options",
    "tool_prompt",  # TGI's chat extension
)  # fmt: skip
OPENAI_COMPLETIONS = (
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
    "max_tokens", "n", "presence_penalty", "prompt_logprobs", "seed", "stop", "stream",
    "stream_options", "suffix",
    "temperature", "top_p", "user",
)  # fmt: skip
# vLLM's and tgq's; TGI's routes take the first four
EXTRAS = ("ignore_eos", "min_tokens", "min_p", "speculate", "top_k", "repetition_penalty")
STRUCTURED = (  # vLLM's structured output, on both OpenAI routes
    "guided_json", "guided_regex", "guided_grammar", "guided_choice", "structured_outputs",
    "guided_decoding_backend", "guided_whitespace_pattern",
)  # fmt: skip
# A schema whose every output is `{"n":D}`: a random model completes it within 8 tokens.
DIGIT = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}
DIGIT_SCHEMA = {**DIGIT, "required": ["n"]}
BAD_SCHEMA = {"type": "strin"}
PICK = {"type": "function", "function": {"name": "pick", "parameters": DIGIT_SCHEMA}}
# A random model may add calls for ever: one call, unless the case is about several.
ONE_PICK = {"tools": [PICK], "tool_choice": "required", "parallel_tool_calls": False}
NO_CALL = {"role": "assistant", "content": ""}  # no `tool_calls` key
BAD_SCHEMA_MESSAGE = "invalid json_schema: Invalid type: strin"
BAD_REGEX_MESSAGE = (
    'invalid regex: invalid regex "a(" (in regex): regex parse error: a( error: unclosed group'
)


@dataclass(frozen=True)
class Model:
    dir: Path
    x_id: int  # the second most likely token, everywhere
    x_text: str


def _write_eos_model(path: Path) -> Model:
    write_text_model(path)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    (x_id,) = tokenizer.encode(X_TEXT).ids
    tensors = load_file(str(path / "model.safetensors"))
    for name, tensor in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    tensors["model.embed_tokens.weight"].fill_(1.0)
    hidden = tensors["model.norm.weight"] / torch.sqrt(torch.tensor(1.0 + 1e-6))
    unit = hidden / hidden.dot(hidden)  # a row r with r . hidden == 1
    tensors["lm_head.weight"][EOS] = 10.0 * unit
    tensors["lm_head.weight"][x_id] = 5.0 * unit
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return Model(path, x_id, tokenizer.decode([x_id]))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    return _write_eos_model(tmp_path_factory.mktemp("eos-model"))


@pytest.fixture(scope="module")
def stack(model: Model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # Speculation on: every field must work with it (`speculate` opts a request out).
    with running_stack(
        model.dir, tmp_path_factory.mktemp("logs"), batcher_env={"SPECULATE": "3"}
    ) as running:
        yield running


@pytest.fixture(scope="module")
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=60) as client:
        yield client


# --- the cases ---------------------------------------------------------------------------------

Check = Callable[[Any, Model], None]


@dataclass(frozen=True)
class Works:
    fields: dict[str, Any]
    check: Check | None = None  # None: accepted (200) with nothing more to observe
    route: str | None = None  # None: the family's route
    top_level: bool = False  # TGI: the fields go beside `inputs`, not in `parameters`


@dataclass(frozen=True)
class Rejected:
    fields: dict[str, Any]
    message: str
    route: str | None = None
    top_level: bool = False


Case = Works | Rejected


def _eq(actual: Any, expected: Any) -> None:
    assert actual == expected


def _details(body: Any) -> dict[str, Any]:
    details: dict[str, Any] = body["details"]
    return details


TGI_CASES: dict[str, Case | tuple[Case, ...]] = {
    "inputs": Works({}, lambda b, m: _eq(_details(b)["finish_reason"], "eos_token")),
    "parameters": Works({}, lambda b, m: _eq(_details(b)["generated_tokens"], 1)),
    "adapter_id": Rejected(
        {"adapter_id": "my-lora"},
        "`adapter_id` must be null, the base model's id ('tgq-test') or a served LoRA adapter"
        " (none). Given: 'my-lora'",
    ),
    "best_of": Works(
        {"best_of": 2, "do_sample": True},
        lambda b, m: _eq(len(_details(b)["best_of_sequences"]), 1),
    ),
    "decoder_input_details": Works(
        {"decoder_input_details": True, "truncate": 2},
        lambda b, m: _eq(len(_details(b)["prefill"]), 2),
    ),
    "details": Works({}, lambda b, m: _eq(_details(b)["tokens"][0]["id"], EOS)),
    "do_sample": Works({"do_sample": True, "seed": 3}, lambda b, m: _eq(_details(b)["seed"], 3)),
    "frequency_penalty": Works({"frequency_penalty": 0.5}),
    "grammar": (
        Works(
            {"grammar": {"type": "regex", "value": "[0-9]{3}"}},
            lambda b, m: _matches(b["generated_text"], "[0-9]{3}"),
        ),
        Works(
            {"grammar": {"type": "json", "value": DIGIT_SCHEMA}, "max_new_tokens": 8},
            lambda b, m: _is_digit_object(b["generated_text"]),
        ),
        Works(
            {"grammar": {"type": "json_schema", "value": {"name": "d", "schema": DIGIT_SCHEMA}}},
            lambda b, m: _is_digit_object(b["generated_text"]),
        ),
        Rejected(
            {"grammar": {"type": "regex", "value": "a("}},
            f"grammar is not valid: {BAD_REGEX_MESSAGE}",
        ),
        Rejected(
            {"grammar": {"type": "json", "value": BAD_SCHEMA}},
            f"grammar is not valid: {BAD_SCHEMA_MESSAGE}",
        ),
    ),
    "max_new_tokens": Works(
        {"max_new_tokens": 3, "ignore_eos": True},
        lambda b, m: _eq(_details(b)["generated_tokens"], 3),
    ),
    "repetition_penalty": Works({"repetition_penalty": 1.2}),
    "return_full_text": Works(
        {"return_full_text": True}, lambda b, m: _eq(b["generated_text"], TGI_INPUTS)
    ),
    "seed": Works({"seed": 5, "do_sample": True}, lambda b, m: _eq(_details(b)["seed"], 5)),
    "stop": Works(
        {"min_tokens": 4, "stop": [X_TEXT]},
        lambda b, m: _eq(
            (_details(b)["finish_reason"], _details(b)["generated_tokens"]), ("stop_sequence", 4)
        ),
    ),
    "temperature": Works({"temperature": 0.5}),
    "top_k": Works({"top_k": 5}),
    "top_n_tokens": Works(
        {"top_n_tokens": 2},
        lambda b, m: _eq([t["id"] for t in _details(b)["top_tokens"][0]], [EOS, m.x_id]),
    ),
    "top_p": Works({"top_p": 0.9}),
    "truncate": Works(
        {"truncate": 1, "decoder_input_details": True},
        lambda b, m: _eq(len(_details(b)["prefill"]), 1),
    ),
    "typical_p": Works({"typical_p": 0.9}),
    "watermark": Rejected({"watermark": True}, "`watermark` is not supported"),
    "ignore_eos": Works(
        {"ignore_eos": True, "max_new_tokens": 4},
        lambda b, m: _eq(_details(b)["finish_reason"], "length"),
    ),
    "speculate": Works(
        {"speculate": False, "min_tokens": 4},
        lambda b, m: _eq([t["id"] for t in _details(b)["tokens"]], [m.x_id] * 4 + [EOS]),
    ),
    # min_tokens delays EOS: `X` four times, then EOS (greedy; EOS is the argmax everywhere).
    "min_tokens": Works(
        {"min_tokens": 4},
        lambda b, m: _eq([t["id"] for t in _details(b)["tokens"]], [m.x_id] * 4 + [EOS]),
    ),
    # Sampled at temperature 3, EOS has p ~ 0.05; min_p 0.5 leaves only EOS (X: p / p_max 0.19).
    "min_p": Works(
        {"min_p": 0.5, "temperature": 3.0, "ignore_eos": True, "max_new_tokens": 8},
        lambda b, m: _eq({t["id"] for t in _details(b)["tokens"]}, {EOS}),
    ),
    "stream": (
        Works(
            {"stream": True},
            lambda b, m: _eq(b[-1]["details"]["generated_tokens"], 1),
            route="/",
            top_level=True,
        ),
        Rejected({"stream": True}, "unknown field `stream`", top_level=True),
    ),
    "unknown": (
        Rejected({"foo": 1}, "unknown field `parameters.foo`"),
        Rejected({"foo": 1}, "unknown field `foo`", top_level=True),
    ),
}


def _choice(body: Any) -> dict[str, Any]:
    choice: dict[str, Any] = body["choices"][0]
    return choice


def _content(body: Any) -> str:
    content: str = _choice(body)["message"]["content"]
    return content


def _usage(body: Any) -> dict[str, Any]:
    usage: dict[str, Any] = body["usage"]
    return usage


def _finished(chunks: Any) -> None:
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"


def _usage_chunk(chunks: Any) -> None:
    assert chunks[-1]["choices"] == []
    cached = chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached % BLOCK_SIZE == 0


def _all_eos(body: Any, m: Model) -> None:
    """Every generated token was EOS: no text, as many tokens as asked for."""
    assert (_text(body), _usage(body)["completion_tokens"]) == ("", 8)


def _matches(text: str, pattern: str) -> None:
    assert re.fullmatch(pattern, text), text


def _is_in(text: str, words: str) -> None:
    assert text in words.split(), text


def _is_digit_object(text: str) -> None:
    value = json.loads(text)
    assert list(value) == ["n"] and value["n"] in range(10), text


def _is_one_pick_call(body: Any) -> None:
    """A forced call of `PICK`: `{"n": D}` arguments, the finish reason `tool_calls`."""
    choice = _choice(body)
    assert (choice["finish_reason"], choice["message"]["content"]) == ("tool_calls", None)
    (call,) = choice["message"]["tool_calls"]
    assert (call["type"], call["function"]["name"]) == ("function", "pick")
    _is_digit_object(call["function"]["arguments"])


def _text(body: Any) -> str:
    choice = _choice(body)
    text: str = choice["message"]["content"] if "message" in choice else choice["text"]
    return text


# Shared by chat and completions: the sampling fields and the vLLM extras.
OPENAI_SHARED: dict[str, Case | tuple[Case, ...]] = {
    "response_format": (
        Works({"response_format": {"type": "text"}}),
        Works(
            {"response_format": {"type": "json_schema", "json_schema": {"schema": DIGIT_SCHEMA}}},
            lambda b, m: _is_digit_object(_text(b)),
        ),
        Works(  # TGI's shape of it
            {"response_format": {"type": "json", "value": DIGIT_SCHEMA}},
            lambda b, m: _is_digit_object(_text(b)),
        ),
        Works(
            {"response_format": {"type": "json_object"}, "max_tokens": 4},
            lambda b, m: _eq(_text(b)[:2], '{"'),
        ),
        Rejected(
            {"response_format": {"type": "json_schema", "json_schema": {"schema": BAD_SCHEMA}}},
            f"`response_format.json_schema.schema` is not valid: {BAD_SCHEMA_MESSAGE}",
        ),
        Rejected(
            {"response_format": {"type": "json_schema"}},
            "`response_format` of type `json_schema` needs a `json_schema` object",
        ),
    ),
    "guided_json": (
        Works({"guided_json": DIGIT_SCHEMA}, lambda b, m: _is_digit_object(_text(b))),
        Works({"guided_json": json.dumps(DIGIT_SCHEMA)}, lambda b, m: _is_digit_object(_text(b))),
        Rejected({"guided_json": BAD_SCHEMA}, f"`guided_json` is not valid: {BAD_SCHEMA_MESSAGE}"),
        Rejected(
            {"guided_json": DIGIT_SCHEMA, "response_format": {"type": "json_object"}},
            "one kind of structured output per request; got `response_format` and `guided_json`",
        ),
    ),
    "guided_regex": (
        Works({"guided_regex": "[a-c]{2}"}, lambda b, m: _matches(_text(b), "[a-c]{2}")),
        Rejected({"guided_regex": "a("}, f"`guided_regex` is not valid: {BAD_REGEX_MESSAGE}"),
    ),
    "guided_grammar": (
        Works({"guided_grammar": 'start: "yes" | "no"'}, lambda b, m: _is_in(_text(b), "yes no")),
        Works({"guided_grammar": 'root ::= "ab" | "cd"'}, lambda b, m: _is_in(_text(b), "ab cd")),
        Rejected(
            {"guided_grammar": "start: foo"},
            '`guided_grammar` is not valid: invalid lark: at 1(8): unknown name: "foo"',
        ),
    ),
    "guided_choice": (
        Works({"guided_choice": ["left", "right"]}, lambda b, m: _is_in(_text(b), "left right")),
        Rejected({"guided_choice": []}, "`guided_choice` is a non-empty list of non-empty strings"),
        Rejected(
            {"guided_choice": ["a"], "guided_regex": "b"},
            "one kind of structured output per request; got `guided_regex` and `guided_choice`",
        ),
    ),
    "structured_outputs": (
        Works(
            {"structured_outputs": {"choice": ["up", "down"]}},
            lambda b, m: _is_in(_text(b), "up down"),
        ),
        Works(
            {"structured_outputs": {"json": DIGIT_SCHEMA}},
            lambda b, m: _is_digit_object(_text(b)),
        ),
        Rejected(
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "`structured_outputs` takes exactly one of json, regex, grammar, choice, json_object",
        ),
        Rejected(
            {"structured_outputs": {"structural_tag": "x"}},
            "`structured_outputs` does not support `structural_tag`",
        ),
    ),
    "guided_decoding_backend": Works({"guided_decoding_backend": "xgrammar"}),
    "guided_whitespace_pattern": Works({"guided_whitespace_pattern": " "}),
    "model": Works({"model": "any-name"}, lambda b, m: _eq(b["model"], MODEL_ID)),
    "frequency_penalty": Works({"frequency_penalty": 0.5}),
    "logit_bias": Rejected({"logit_bias": {"1": 5.0}}, "`logit_bias` is not supported"),
    "max_tokens": Works(
        {"max_tokens": 3, "ignore_eos": True},
        lambda b, m: _eq(_usage(b)["completion_tokens"], 3),
    ),
    "n": Works({"n": 2}, lambda b, m: _eq(len(b["choices"]), 2)),
    "presence_penalty": Works({"presence_penalty": 0.5}),
    "seed": Works({"seed": 4, "temperature": 1.0}),
    "stop": Works(
        {"stop": [X_TEXT], "min_tokens": 3},
        lambda b, m: _eq((_text(b), _choice(b)["finish_reason"]), (X_TEXT * 2, "stop")),
    ),
    "stream": Works({"stream": True}, lambda b, m: _finished(b)),
    "stream_options": Works(
        {"stream": True, "stream_options": {"include_usage": True}}, lambda b, m: _usage_chunk(b)
    ),
    "temperature": Works({"temperature": 0.5}),
    "top_p": Works({"top_p": 0.9}),
    "user": Works({"user": "user-1"}),
    "ignore_eos": Works(
        {"ignore_eos": True, "max_tokens": 3},
        lambda b, m: _eq(_choice(b)["finish_reason"], "length"),
    ),
    "speculate": Works(
        {"speculate": False, "ignore_eos": True, "max_tokens": 3},
        lambda b, m: _eq(_choice(b)["finish_reason"], "length"),
    ),
    "min_tokens": (
        Works(
            {"min_tokens": 3},
            lambda b, m: _eq((_text(b), _usage(b)["completion_tokens"]), (X_TEXT * 3, 4)),
        ),
        Rejected({"min_tokens": -1}, "`min_tokens` must be >= 0. Given: -1"),
        Rejected(
            {"min_tokens": 5, "max_tokens": 4},
            "`min_tokens` must be <= the maximum number of new tokens (4). Given: 5",
        ),
    ),
    # At temperature 2, EOS has p ~ 0.2; min_p 0.5 (or top_k 1) leaves only EOS.
    "min_p": (
        Works({"min_p": 0.5, "temperature": 2.0, "ignore_eos": True, "max_tokens": 8}, _all_eos),
        Rejected({"min_p": 1.5}, "`min_p` must be >= 0.0 and <= 1.0"),
    ),
    "top_k": (
        Works({"top_k": 1, "temperature": 2.0, "ignore_eos": True, "max_tokens": 8}, _all_eos),
        Works({"top_k": -1}),
        Rejected({"top_k": -2}, "`top_k` must be >= -1 (-1 or 0: off). Given: -2"),
    ),
    "repetition_penalty": (
        Works({"repetition_penalty": 1.2}),
        Rejected({"repetition_penalty": 0}, "`repetition_penalty` must be strictly positive"),
    ),
    "unknown": (
        Rejected({"foo": 1}, "Unrecognized request argument supplied: foo"),
        Rejected({"foo": 1, "bar": 2}, "Unrecognized request arguments supplied: bar, foo"),
    ),
}
CHAT_CASES: dict[str, Case | tuple[Case, ...]] = {
    **OPENAI_SHARED,
    "prompt_logprobs": (  # vLLM's: the rendered prompt's, beside the choices
        Works({"prompt_logprobs": 1}, lambda b, m: _eq(b["prompt_logprobs"][0], None)),
        Rejected(
            {"prompt_logprobs": 1, "stream": True},
            "`prompt_logprobs` is not supported when streaming",
        ),
    ),
    "messages": Works(
        {}, lambda b, m: _eq((_content(b), _choice(b)["finish_reason"]), ("", "stop"))
    ),
    "audio": Rejected(
        {"audio": {"voice": "alloy", "format": "wav"}},
        "`audio` output is not supported: tgq generates text only",
    ),
    "function_call": (
        Works({"function_call": "none"}),
        Rejected(
            {"function_call": {"name": "f"}},
            '`function_call` other than "none" or "auto" is not supported yet',
        ),
    ),
    "functions": Rejected({"functions": [{"name": "f"}]}, "`functions` are not supported yet"),
    "logprobs": Works(
        {"logprobs": True}, lambda b, m: _eq(len(_choice(b)["logprobs"]["content"]), 1)
    ),
    "max_completion_tokens": Works(
        {"max_completion_tokens": 3, "ignore_eos": True},
        lambda b, m: _eq(_usage(b)["completion_tokens"], 3),
    ),
    "metadata": Rejected(
        {"metadata": {"k": "v"}}, "`metadata` is not supported: tgq does not store chat completions"
    ),
    "modalities": (
        Works({"modalities": ["text"]}),
        Rejected(
            {"modalities": ["text", "audio"]}, '`modalities` other than ["text"] are not supported'
        ),
    ),
    "moderation": Rejected({"moderation": {}}, "`moderation` is not supported"),
    "parallel_tool_calls": Works(ONE_PICK, lambda b, m: _is_one_pick_call(b)),
    "prediction": Rejected(
        {"prediction": {"type": "content", "content": "x"}},
        "`prediction` (predicted outputs) is not supported",
    ),
    "prompt_cache_key": Works({"prompt_cache_key": "key-1"}),
    "prompt_cache_options": Rejected(
        {"prompt_cache_options": {}}, "`prompt_cache_options` is not supported"
    ),
    "prompt_cache_retention": (
        Works({"prompt_cache_retention": "in_memory"}),
        Rejected(
            {"prompt_cache_retention": "24h"},
            '`prompt_cache_retention` other than "in_memory" is not supported',
        ),
    ),
    "reasoning_effort": Rejected(
        {"reasoning_effort": "low"},
        "`reasoning_effort` is not supported: no reasoning model is served",
    ),
    "safety_identifier": Works({"safety_identifier": "user-1"}),
    "service_tier": (
        Works({"service_tier": "auto"}),
        Rejected(
            {"service_tier": "flex"},
            '`service_tier` other than "auto" or "default" is not supported',
        ),
    ),
    "store": (
        Works({"store": False}),
        Rejected({"store": True}, "`store` is not supported: tgq does not store chat completions"),
    ),
    "tool_choice": (
        Works({"tools": [PICK], "tool_choice": "none"}, lambda b, m: _eq(_content(b), "")),
        Works(
            {"tools": [PICK], "tool_choice": {"type": "function", "function": {"name": "pick"}}},
            lambda b, m: _is_one_pick_call(b),
        ),
        Rejected({"tool_choice": "required"}, '`tool_choice` "required" needs `tools`'),
        Rejected({"tools": [PICK], "tool_choice": {"type": "function"}}, TOOL_CHOICE_MESSAGE),
    ),
    "tools": (
        Works(ONE_PICK, lambda b, m: _is_one_pick_call(b)),
        # `auto`: the model writes EOS at once, no call
        Works({"tools": [PICK]}, lambda b, m: _eq(_choice(b)["message"], NO_CALL)),
        Rejected({"tools": [PICK, PICK]}, "`tools` has more than one function named `pick`"),
    ),
    "top_logprobs": Works(
        {"logprobs": True, "top_logprobs": 2},
        lambda b, m: _eq(len(_choice(b)["logprobs"]["content"][0]["top_logprobs"]), 2),
    ),
    "verbosity": Rejected(
        {"verbosity": "low"}, "`verbosity` is not supported: no reasoning model is served"
    ),
    "web_search_options": Rejected(
        {"web_search_options": {}}, "`web_search_options` is not supported: tgq has no web search"
    ),
    "tool_prompt": (
        Works({"tools": [PICK], "tool_prompt": "Use the tools"}),
        Rejected({"tool_prompt": "Use the tools"}, "`tool_prompt` is only used with `tools`"),
    ),
}
COMPLETION_CASES: dict[str, Case | tuple[Case, ...]] = {
    **OPENAI_SHARED,
    "prompt": Works({}, lambda b, m: _eq((_text(b), _choice(b)["finish_reason"]), ("", "stop"))),
    # Two candidates of 2 tokens each, the most likely returned; usage counts both.
    "best_of": (
        Works(
            {"best_of": 2, "temperature": 1.0, "ignore_eos": True, "max_tokens": 2},
            lambda b, m: _eq((len(b["choices"]), _usage(b)["completion_tokens"]), (1, 4)),
        ),
        Rejected({"best_of": 3}, "`best_of` must be > 0 and <= 2. Given: 3"),
        Rejected({"best_of": 1, "n": 2}, "`best_of` must be >= `n` (2). Given: 1"),
        Rejected({"best_of": 2, "stream": True}, "`best_of` > `n` is not supported when streaming"),
    ),
    "echo": Works({"echo": True}, lambda b, m: _eq(_text(b), "Hello")),
    "prompt_logprobs": (
        Works(
            {"prompt_logprobs": 1}, lambda b, m: _eq(b["choices"][0]["prompt_logprobs"][0], None)
        ),
        Rejected(
            {"prompt_logprobs": 1, "stream": True},
            "`prompt_logprobs` is not supported when streaming",
        ),
    ),
    "logprobs": Works(
        {"logprobs": 2}, lambda b, m: _eq(len(_choice(b)["logprobs"]["top_logprobs"][0]), 2)
    ),
    "suffix": Rejected(
        {"suffix": "x"}, "Suffix is not supported and can be achieved by preprocessing the prompt."
    ),
}


def _cases(table: dict[str, Case | tuple[Case, ...]]) -> list[Any]:
    return [
        pytest.param(case, id=f"{name}-{i}")
        for name, cases in table.items()
        for i, case in enumerate(cases if isinstance(cases, tuple) else (cases,))
    ]


def _post(http: httpx.Client, route: str, body: dict[str, Any]) -> tuple[int, Any]:
    response = http.post(route, json=body)
    if not response.headers["content-type"].startswith("text/event-stream"):
        return response.status_code, response.json()
    events = [line.removeprefix("data:").strip() for line in response.text.splitlines()]
    payloads = [json.loads(e) for e in events if e.startswith("{")]
    return response.status_code, payloads


def _run(http: httpx.Client, model: Model, case: Case, route: str, body: dict[str, Any]) -> Any:
    status, answer = _post(http, case.route or route, body)
    if isinstance(case, Works):
        assert status == 200, answer
        if case.check is not None:
            case.check(answer, model)
    return status, answer


@pytest.mark.parametrize("case", _cases(TGI_CASES))
def test_tgi_fields(http: httpx.Client, model: Model, case: Case) -> None:
    base = {"inputs": TGI_INPUTS}
    if case.top_level:
        body = {**base, "parameters": {"details": True}, **case.fields}
    else:
        body = {**base, "parameters": {"details": True, **case.fields}}
    status, answer = _run(http, model, case, "/generate", body)
    if isinstance(case, Rejected):
        error = {"error": f"Input validation error: {case.message}", "error_type": "validation"}
        assert (status, answer) == (422, error)


@pytest.mark.parametrize("case", _cases(CHAT_CASES))
def test_chat_fields(http: httpx.Client, model: Model, case: Case) -> None:
    body = {"messages": [{"role": "user", "content": "Hello"}], "temperature": 0, **case.fields}
    _check_openai(_run(http, model, case, "/v1/chat/completions", body), case)


@pytest.mark.parametrize("case", _cases(COMPLETION_CASES))
def test_completion_fields(http: httpx.Client, model: Model, case: Case) -> None:
    body = {"prompt": "Hello", "temperature": 0, **case.fields}
    _check_openai(_run(http, model, case, "/v1/completions", body), case)


def _check_openai(result: tuple[int, Any], case: Case) -> None:
    status, answer = result
    if isinstance(case, Rejected):
        assert status == 422, answer
        assert answer["error"]["message"] == case.message
        assert answer["error"]["type"] == "invalid_request_error"
        assert answer["error"]["param"] in case.fields


@pytest.mark.parametrize(
    ("table", "listed", "schema"),
    [
        (
            TGI_CASES,
            TGI_PARAMETERS + TGI_REQUEST + EXTRAS[:4],
            (GenerateParameters, CompatGenerateRequest),
        ),
        (
            CHAT_CASES,
            (*OPENAI_CHAT, *EXTRAS, *STRUCTURED, "prompt_logprobs"),
            (ChatCompletionRequest,),
        ),
        (
            COMPLETION_CASES,
            (*OPENAI_COMPLETIONS, *EXTRAS, *STRUCTURED, "response_format"),
            (CompletionRequest,),
        ),
    ],
    ids=["tgi", "chat", "completions"],
)
def test_every_field_is_listed(
    table: dict[str, Any], listed: tuple[str, ...], schema: tuple[type[BaseModel], ...]
) -> None:
    """The tables cover the reference field lists, and every field of tgq's own schemas."""
    assert set(table) == {*listed, "unknown"}
    assert {name for model in schema for name in model.model_fields} <= set(listed)


def test_usage_reports_the_prompt_tokens_served_from_the_prefix_cache(http: httpx.Client) -> None:
    """The same long prompt twice: the second finds all its full blocks but the last token's in
    the prefix cache; the first finds none."""
    prompt = f"{uuid.uuid4().hex} " + "the cache keeps what was computed " * 20
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    first, second = (http.post("/v1/completions", json=body).json()["usage"] for _ in range(2))
    num_prompt = first["prompt_tokens"]
    assert num_prompt > 4 * BLOCK_SIZE
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    expected = (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert second["prompt_tokens_details"] == {"cached_tokens": expected}


def test_streamed_chat_usage_reports_cached_tokens(http: httpx.Client) -> None:
    content = f"{uuid.uuid4().hex} " + "a chat prompt long enough for several blocks " * 12
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first, second = (_post(http, "/v1/chat/completions", body)[1][-1]["usage"] for _ in range(2))
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    expected = (first["prompt_tokens"] - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert second["prompt_tokens_details"] == {"cached_tokens": expected}


def test_jobs_take_the_same_parameters(http: httpx.Client, model: Model) -> None:
    """`/v1/jobs` goes through TGI's `parameters` validation: `min_tokens` works there too, and
    an unknown parameter is rejected in the OpenAI error shape of `/v1/`."""
    body = {"prompt": TGI_INPUTS, "parameters": {"min_tokens": 3}, "priority": "interactive"}
    job = wait_for(http, http.post("/v1/jobs", json=body).json()["id"])
    assert job["status"] == "succeeded"
    assert job["results"][0]["token_ids"] == [model.x_id] * 3 + [EOS]
    body = {"prompt": TGI_INPUTS, "parameters": {"foo": 1}}
    response = http.post("/v1/jobs", json=body)
    assert response.status_code == 422
    assert response.json()["error"]["message"] == "unknown field `parameters.foo`"


def test_the_stack_speculates(http: httpx.Client, model: Model) -> None:
    """The cases above ran with speculation on: a request that repeats itself (`X` eight times,
    then EOS) gets drafts, verified (the batcher's heartbeat reports them), and the same output."""
    body = {"inputs": TGI_INPUTS, "parameters": {"min_tokens": 8, "details": True}}
    tokens = http.post("/generate", json=body).json()["details"]["tokens"]
    assert [t["id"] for t in tokens] == [model.x_id] * 8 + [EOS]

    def verified() -> float:
        pattern = re.compile(r"^tgq_spec_verify_forwards(?:_total)?\{[^}]*\} (\S+)$", re.M)
        return sum(float(v) for v in pattern.findall(http.get("/metrics").text))

    eventually(verified, 30, "a heartbeat reporting verified drafts")
