"""TGI's request and response bodies, mirroring its OpenAPI spec
(`shared/reference/tgi-openapi.json`): same field names, types, docs and examples. Unknown
request fields are kept (`model_extra`) and rejected by name in `api.request_fields`, where TGI
ignores them.

Range checks that TGI makes in its router (temperature, top_p, ...) are not schema constraints
here: `api.validation` makes them with TGI's exact messages. Only fields that TGI types as
unsigned integers carry `ge=0`, because TGI rejects negatives while parsing the body.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

FinishReason = Literal["length", "eos_token", "stop_sequence"]
Unsigned = Annotated[int, Field(ge=0)]
Seed = Annotated[int, Field(ge=0, lt=2**64)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


def _is_empty(value: object) -> bool:
    return value is None or value == []


def _omitted_if_empty(default: Any) -> Any:
    """A field left out of the body when empty or null, as TGI's serde does
    (`skip_serializing_if`)."""
    return Field(default=default, exclude_if=_is_empty)


class GenerateParameters(_Request):
    best_of: Unsigned | None = Field(
        default=None,
        description="Generate best_of sequences and return the one if the highest token logprobs.",
        examples=[1],
    )
    temperature: float | None = Field(
        default=None,
        description="The value used to module the logits distribution.",
        examples=[0.5],
    )
    repetition_penalty: float | None = Field(
        default=None,
        description="The parameter for repetition penalty. 1.0 means no penalty.\n"
        "See [this paper](https://arxiv.org/pdf/1909.05858.pdf) for more details.",
        examples=[1.03],
    )
    frequency_penalty: float | None = Field(
        default=None,
        description="The parameter for frequency penalty. 0.0 means no penalty\n"
        "Penalize new tokens based on their existing frequency in the text so far,\n"
        "decreasing the model's likelihood to repeat the same line verbatim.",
        examples=[0.1],
    )
    top_k: int | None = Field(
        default=None,
        description="The number of highest probability vocabulary tokens to keep for "
        "top-k-filtering.",
        examples=[10],
    )
    top_p: float | None = Field(
        default=None, description="Top-p value for nucleus sampling.", examples=[0.95]
    )
    typical_p: float | None = Field(
        default=None,
        description="Typical Decoding mass\nSee [Typical Decoding for Natural Language "
        "Generation](https://arxiv.org/abs/2202.00666) for more information.",
        examples=[0.95],
    )
    do_sample: bool = Field(default=False, description="Activate logits sampling.", examples=[True])
    max_new_tokens: Unsigned | None = Field(
        default=None, description="Maximum number of tokens to generate.", examples=[20]
    )
    return_full_text: bool | None = Field(
        default=None,
        description="Whether to prepend the prompt to the generated text",
        examples=[False],
    )
    stop: list[str] = Field(
        default_factory=list,
        description="Stop generating tokens if a member of `stop` is generated.",
        examples=[["photographer"]],
    )
    truncate: Unsigned | None = Field(
        default=None, description="Truncate inputs tokens to the given size.", examples=[None]
    )
    watermark: bool = Field(
        default=False,
        description="Watermarking with [A Watermark for Large Language "
        "Models](https://arxiv.org/abs/2301.10226).",
        examples=[True],
    )
    details: bool = Field(default=False, description="Whether to return generation details.")
    decoder_input_details: bool = Field(
        default=False, description="Whether to return decoder input token logprobs and ids."
    )
    seed: Seed | None = Field(default=None, description="Random sampling seed.", examples=[None])
    top_n_tokens: Unsigned | None = Field(
        default=None,
        description="The number of highest probability vocabulary tokens to keep for "
        "top-n-filtering.",
        examples=[5],
    )
    grammar: dict[str, Any] | None = Field(
        default=None,
        description="Structured output: {type: json|json_object|regex|json_schema, value}.",
    )
    adapter_id: str | None = Field(default=None, description="Lora adapter id", examples=[None])
    ignore_eos: bool = Field(
        default=False, description="tgq extension (as vLLM's): keep generating past EOS."
    )
    speculate: bool = Field(
        default=True,
        description="tgq extension: false opts this request out of speculative decoding"
        " (--speculate); its output is the same either way.",
    )
    min_tokens: int | None = Field(
        default=None,
        description="tgq extension (as vLLM's): no EOS, stop token or stop sequence before this "
        "many tokens.",
        examples=[None],
    )
    min_p: float | None = Field(
        default=None,
        description="tgq extension (as vLLM's): drop tokens less likely than min_p times the "
        "most likely one.",
        examples=[None],
    )


def default_parameters() -> GenerateParameters:
    """What TGI uses when the body has no `parameters` at all: sampling on, the rest unset."""
    return GenerateParameters(do_sample=True)


class GenerateRequest(_Request):
    inputs: str = Field(examples=["My name is Olivier and I"])
    parameters: GenerateParameters = Field(default_factory=default_parameters)


class CompatGenerateRequest(GenerateRequest):
    stream: bool = False


class Token(BaseModel):
    id: int = Field(ge=0, examples=[0])
    text: str = Field(examples=["test"])
    logprob: float | None = Field(examples=[-0.34])
    special: bool = Field(examples=[False])


class PrefillToken(BaseModel):
    id: int = Field(ge=0, examples=[0])
    text: str = Field(examples=["test"])
    logprob: float | None = Field(examples=[-0.34])


class BestOfSequence(BaseModel):
    generated_text: str = Field(examples=["test"])
    finish_reason: FinishReason
    generated_tokens: int = Field(ge=0, examples=[1])
    seed: int | None = Field(default=None, examples=[42])
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] = _omitted_if_empty([])


class Details(BaseModel):
    finish_reason: FinishReason
    generated_tokens: int = Field(ge=0, examples=[1])
    seed: int | None = Field(default=None, examples=[42])
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] = _omitted_if_empty([])
    best_of_sequences: list[BestOfSequence] | None = _omitted_if_empty(None)


class GenerateResponse(BaseModel):
    generated_text: str = Field(examples=["test"])
    details: Details | None = None


class StreamDetails(BaseModel):
    finish_reason: FinishReason
    generated_tokens: int = Field(ge=0, examples=[1])
    seed: int | None = Field(default=None, examples=[42])
    input_length: int = Field(ge=0, examples=[1])


class StreamResponse(BaseModel):
    """One SSE event of `/generate_stream`; the last one carries `generated_text` (and
    `details` when asked for)."""

    index: int = Field(ge=0)  # 1-based counter of the events
    token: Token
    top_tokens: list[Token] = _omitted_if_empty([])
    generated_text: str | None = Field(default=None, examples=["test"])
    details: StreamDetails | None = None


class SimpleToken(BaseModel):
    """One token of a `/tokenize` answer; `start`/`stop` are offsets into the input."""

    id: int = Field(ge=0, examples=[0])
    text: str = Field(examples=["test"])
    start: int = Field(ge=0, examples=[0])
    stop: int = Field(ge=0, examples=[2])


class Info(BaseModel):
    model_id: str = Field(description="Model info", examples=["bigscience/blomm-560m"])
    model_sha: str | None = Field(
        default=None, examples=["e985a63cdc139290c5f700ff1929f0b5942cced2"]
    )
    model_pipeline_tag: str | None = Field(default=None, examples=["text-generation"])
    model_dtype: str | None = Field(default=None, examples=["torch.float16"])
    quantize: str | None = Field(
        default=None,
        description="`--quantize` (how the weights were quantized at load), or the method of a"
        " checkpoint stored quantized",
        examples=["int8", "fp8", "compressed-tensors"],
    )
    weight_bytes: int | None = Field(
        default=None,
        description="tgq: bytes of the model's weights as a batcher holds them (one rank's;"
        " null until a batcher has reported)",
        examples=[115_343_360],
    )
    kv_cache_blocks: int | None = Field(
        default=None,
        description="tgq: usable KV-cache blocks over the live batchers (null before any)",
        examples=[2200],
    )
    kv_block_size: int | None = Field(
        default=None, description="tgq: tokens per KV-cache block", examples=[16]
    )
    max_concurrent_requests: int = Field(ge=0, description="Router Parameters", examples=[128])
    max_best_of: int = Field(ge=0, examples=[2])
    max_stop_sequences: int = Field(ge=0, examples=[4])
    max_input_tokens: int = Field(ge=0, examples=[1024])
    max_total_tokens: int = Field(ge=0, examples=[2048])
    validation_workers: int = Field(ge=0, examples=[2])
    max_client_batch_size: int = Field(ge=0, examples=[32])
    router: str = Field(description="Router Info", examples=["text-generation-router"])
    version: str = Field(examples=["0.5.0"])
    sha: str | None = Field(default=None, examples=[None])
    docker_label: str | None = Field(default=None, examples=[None])


class ErrorResponse(BaseModel):
    error: str
    error_type: str
