"""OpenAI-compatible request and response bodies (`/v1/chat/completions`, `/v1/completions`,
`/v1/models`).

Requests accept the whole OpenAI surface that clients send, including fields tgq does not
support (`logit_bias`, `audio`, `suffix`, ...), and keep unknown fields
(`model_extra`): `api.request_fields` rejects both with a message naming the field instead of
dropping them silently. Range checks live in `api.openai_validation`. Nested objects (messages,
stream options) ignore unknown keys, so a message echoed back from a response (with `refusal`,
`annotations`, ...) still parses.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Seed = Annotated[int, Field(ge=0, lt=2**64)]
FinishReason = Literal["stop", "length", "tool_calls"]


def _is_none(value: object) -> bool:
    return value is None


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Body(BaseModel):
    """A request body: unknown fields are kept, for `api.request_fields` to reject by name."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(_Request):
    include_usage: bool = False  # one more chunk at the end, with `choices: []` and `usage`


class ImageUrl(_Request):
    url: str
    detail: str | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ImagePart(_Request):
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON-encoded


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class RequestMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ResponseFormat(BaseModel):
    # OpenAI's `json_schema`, or TGI's `value`: read by `api.structured`.
    model_config = ConfigDict(extra="allow")

    type: str = Field(examples=["text"])


class _VllmExtras(_Body):
    """vLLM's sampling extensions, on both routes."""

    top_k: int | None = Field(default=None, description="vLLM extension; -1 or 0: off.")
    min_p: float | None = Field(default=None, description="vLLM extension; 0: off.")
    min_tokens: int | None = Field(
        default=None, description="vLLM extension: no EOS, stop token or stop string before."
    )
    repetition_penalty: float | None = Field(
        default=None, description="vLLM/TGI extension; 1: off.", examples=[1.03]
    )
    ignore_eos: bool = Field(default=False, description="vLLM extension: generate past EOS.")
    speculate: bool = Field(
        default=True,
        description="tgq extension: false opts this request out of speculative decoding"
        " (--speculate); its output is the same either way.",
    )
    prompt_logprobs: int | None = Field(
        default=None,
        description="vLLM extension: each prompt token's logprob and rank, and the this many most"
        " likely tokens at each prompt position (needs --enable-prefill-logprobs).",
    )
    # vLLM's structured output (see `api.structured`)
    guided_json: dict[str, Any] | str | None = Field(
        default=None, description="vLLM extension: the output follows this JSON schema."
    )
    guided_regex: str | None = Field(
        default=None, description="vLLM extension: the output matches this regex."
    )
    guided_grammar: str | None = Field(
        default=None, description="vLLM extension: the output follows this Lark or GBNF grammar."
    )
    guided_choice: list[str] | None = Field(
        default=None, description="vLLM extension: the output is one of these strings."
    )
    structured_outputs: dict[str, Any] | None = Field(
        default=None,
        description="vLLM extension: one of `json`, `regex`, `grammar`, `choice`, `json_object`.",
    )
    guided_decoding_backend: str | None = Field(
        default=None, description="vLLM extension; accepted, changes nothing (one engine)."
    )
    guided_whitespace_pattern: str | None = Field(
        default=None, description="vLLM extension; accepted, changes nothing."
    )
    response_format: ResponseFormat | None = None

    def structured_fields(self) -> dict[str, Any]:
        """vLLM's structured-output fields, by name (`api.structured.openai_grammar`)."""
        names = ("guided_json", "guided_regex", "guided_grammar", "guided_choice")
        return {name: getattr(self, name) for name in (*names, "structured_outputs")}


class ChatCompletionRequest(_VllmExtras):
    model: str | None = Field(default=None, examples=["tgi"])
    messages: list[RequestMessage]
    frequency_penalty: float | None = Field(default=None, examples=[0.0])
    presence_penalty: float | None = Field(default=None, examples=[0.0])
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, examples=[5])
    max_tokens: int | None = Field(default=None, examples=[32])
    max_completion_tokens: int | None = Field(
        default=None, description="Replaces `max_tokens`; when both are set this one wins."
    )
    n: int | None = Field(default=None, examples=[1])
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, examples=[1.0])
    top_p: float | None = Field(default=None, examples=[0.95])
    user: str | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    tool_prompt: Any = Field(
        default=None, description="TGI extension: ends the last message with the tools."
    )
    # Accepted with no effect on the output: tgq records no end users, and its prefix cache
    # serves every request whatever its key.
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # Rejected unless absent, null or neutral (`api.request_fields` says why):
    audio: Any = None
    function_call: Any = None
    functions: Any = None
    metadata: Any = None
    modalities: Any = None
    moderation: Any = None
    prediction: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    reasoning_effort: Any = None
    service_tier: Any = None
    store: Any = None
    verbosity: Any = None
    web_search_options: Any = None


class CompletionRequest(_VllmExtras):
    model: str | None = Field(default=None, examples=["tgi"])
    # a string, a list of strings, a list of token ids, or a list of such lists (as OpenAI)
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        examples=["My name is Olivier and I"]
    )
    max_tokens: int | None = Field(default=None, examples=[32])
    temperature: float | None = Field(default=None, examples=[1.0])
    top_p: float | None = Field(default=None, examples=[0.95])
    n: int | None = Field(default=None, examples=[1])
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    best_of: int | None = Field(
        default=None, description="Candidates per prompt; the `n` most likely are returned."
    )
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = Field(
        default=None,
        description="Legacy: the number of most likely tokens to return at each step.",
    )
    echo: bool = Field(default=False, description="Prepend the prompt to the completion.")
    suffix: str | None = None
    user: str | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=_is_none)


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class PromptLogprob(BaseModel):
    """vLLM's entry for one token at one prompt position."""

    logprob: float
    rank: int | None = None  # 1: the most likely token there
    decoded_token: str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int  # unix seconds
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatCompletionChoice]
    usage: Usage | None = None
    # vLLM's `prompt_logprobs` (asked for only): the rendered prompt's, shared by the choices;
    # each entry as in `CompletionChoice.prompt_logprobs`
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        default=None, exclude_if=_is_none
    )


class DeltaFunction(BaseModel):
    name: str | None = Field(default=None, exclude_if=_is_none)  # on a call's first delta
    arguments: str = ""  # the next piece of the arguments' JSON text


class DeltaToolCall(BaseModel):
    index: int  # the call's position in `message.tool_calls`
    id: str | None = Field(default=None, exclude_if=_is_none)  # on a call's first delta
    type: Literal["function"] | None = Field(default=None, exclude_if=_is_none)
    function: DeltaFunction


class Delta(BaseModel):
    """What a chunk adds; unset fields are left out, as OpenAI does (`{}` on the last chunk)."""

    role: Literal["assistant"] | None = Field(default=None, exclude_if=_is_none)
    content: str | None = Field(default=None, exclude_if=_is_none)
    tool_calls: list[DeltaToolCall] | None = Field(default=None, exclude_if=_is_none)


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChunkChoice]
    usage: Usage | None = None  # only on the last chunk, with `stream_options.include_usage`


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    # null for an echoed prompt's first token, which has no distribution before it
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    # vLLM's `prompt_logprobs`: per prompt token, null for the first, else token id -> entry for
    # the prompt's own token and the most likely ones there
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class Completion(BaseModel):
    """A `/v1/completions` answer, and (with `usage` null) each of its stream events."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str
    parent: str | None = None  # a LoRA adapter's base model (as vLLM lists adapters)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class OpenAIError(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIErrorBody(BaseModel):
    error: OpenAIError
