"""Every request field either works or is rejected with a message naming it.

The request schemas keep the fields they do not know (`model_extra`); these checks reject them
first, in each route family's words: OpenAI's "Unrecognized request argument supplied: X" on the
OpenAI routes, serde's "unknown field `X`" (what TGI says where it denies unknown fields) on the
TGI routes and for the TGI `parameters` of jobs. Then the OpenAI fields tgq knows but does not
support are rejected unless absent, null or neutral. Pure functions, no I/O; each message is
exact and tested (`tests/api/test_request_fields.py`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from pydantic import BaseModel

from tgq.api.errors import ValidationError, require
from tgq.api.schemas.openai import ChatCompletionRequest, CompletionRequest
from tgq.api.schemas.tgi import GenerateParameters, GenerateRequest

# OpenAI chat fields tgq does not support: (values accepted, message). A field absent from the
# body is None, which is always accepted.
_CHAT_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "audio": ((), "`audio` output is not supported: tgq generates text only"),
    "modalities": ((["text"],), '`modalities` other than ["text"] are not supported'),
    "functions": (([],), "`functions` are not supported yet"),
    "function_call": (
        ("none", "auto"),
        '`function_call` other than "none" or "auto" is not supported yet',
    ),
    "metadata": ((), "`metadata` is not supported: tgq does not store chat completions"),
    "store": ((False,), "`store` is not supported: tgq does not store chat completions"),
    "moderation": ((), "`moderation` is not supported"),
    "prediction": ((), "`prediction` (predicted outputs) is not supported"),
    "prompt_cache_options": ((), "`prompt_cache_options` is not supported"),
    "prompt_cache_retention": (
        ("in_memory",),
        '`prompt_cache_retention` other than "in_memory" is not supported',
    ),
    "reasoning_effort": ((), "`reasoning_effort` is not supported: no reasoning model is served"),
    "verbosity": ((), "`verbosity` is not supported: no reasoning model is served"),
    "service_tier": (
        ("auto", "default"),
        '`service_tier` other than "auto" or "default" is not supported',
    ),
    "web_search_options": ((), "`web_search_options` is not supported: tgq has no web search"),
}
LOGIT_BIAS_MESSAGE = "`logit_bias` is not supported"


def check_openai_fields(body: ChatCompletionRequest | CompletionRequest) -> None:
    """Unknown fields first (all named in one message, as OpenAI does), then the unsupported."""
    unknown = sorted(body.model_extra or {})
    if unknown:
        plural = "s" if len(unknown) > 1 else ""
        message = f"Unrecognized request argument{plural} supplied: {', '.join(unknown)}"
        raise ValidationError(message, param=unknown[0])
    require(not body.logit_bias, LOGIT_BIAS_MESSAGE, "logit_bias")
    if isinstance(body, ChatCompletionRequest):
        for name, (accepted, message) in _CHAT_UNSUPPORTED.items():
            value = getattr(body, name)
            require(value is None or value in accepted, message, name)


def check_tgi_fields(body: GenerateRequest) -> None:
    """The TGI body's own unknown fields (`tgi_params` checks its `parameters`)."""
    _check_tgi_unknown(body, prefix="")


def check_parameter_fields(parameters: GenerateParameters | None) -> None:
    """The unknown fields of TGI `parameters` (of a TGI route, or of a job)."""
    if parameters is not None:
        _check_tgi_unknown(parameters, prefix="parameters.")


def adapter_of(adapter_id: str | None, model_id: str, adapters: Collection[str]) -> str | None:
    """TGI's `adapter_id`: one of the served LoRA adapters (`--lora-adapters`), or the base model
    (None for null or the base model's id)."""
    if adapter_id is None or adapter_id == model_id:
        return None
    served = ", ".join(repr(name) for name in sorted(adapters)) or "none"
    require(
        adapter_id in adapters,
        f"`adapter_id` must be null, the base model's id ({model_id!r}) or a served LoRA"
        f" adapter ({served}). Given: {adapter_id!r}",
        "adapter_id",
    )
    return adapter_id


def _check_tgi_unknown(body: BaseModel, *, prefix: str) -> None:
    unknown = sorted(body.model_extra or {})
    if unknown:
        name = prefix + unknown[0]
        raise ValidationError(f"unknown field `{name}`", param=name)
