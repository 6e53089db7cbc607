"""The batcher's options: the first half of tgq's one configuration model (torch-free).

Each option is defined here once, with its default and its help text; `api.settings.Settings`
extends this model with the api's own, so `tgq serve` (both modes), `tgq api`, `tgq batcher`,
`python -m tgq.batcher` and the api's in-process batcher read the same fields. A field is an
environment variable of its upper-cased name and a flag of its dashed name (`max_batch_size`:
`MAX_BATCH_SIZE`, `--max-batch-size`; see `batcher.flags`). TGI's launcher names where TGI has
the flag.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ByteSize, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tgq.batcher.config import SchedulerConfig
from tgq.batcher.grammar_compiler import DEFAULT_MAX_CACHE
from tgq.batcher.transport.base import TransportConfig

_SCHEDULER = SchedulerConfig()  # the engine's defaults are the options' defaults
_TRANSPORT = TransportConfig()
Dtype = Literal["auto", "bfloat16", "float16", "float32"]


class BatcherOptions(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="", extra="ignore", frozen=True)

    # The model.
    model_id: str = Field("tgq-demo", description="the served model: a local directory or hub id")
    model_dir: str | None = Field(
        None, description="a local directory with the model's files (default: MODEL_ID's)"
    )
    revision: str | None = Field(None, description="hub revision of MODEL_ID (branch, tag, sha)")
    dtype: Dtype = Field(
        "auto", description="weights' dtype (auto: the checkpoint's; float16 runs bf16 on CPU)"
    )

    # Transport.
    redis_url: str | None = Field(
        None, description="Redis; none: the api runs its batcher in-process (embedded mode)"
    )
    redis_prefix: str = Field("tgq", description="prefix of every Redis key")
    batcher_id: str | None = Field(
        None, description="this batcher's name in Redis (default: the host name)"
    )
    heartbeat_ttl_s: float = Field(
        _TRANSPORT.heartbeat_ttl_s, gt=0, description="a batcher silent this long is dead"
    )
    lease_s: float = Field(
        _TRANSPORT.lease_s, gt=0, description="a request a batcher holds this long is reclaimed"
    )
    max_attempts: int = Field(
        _TRANSPORT.max_attempts, ge=1, description="runs of a request before it fails"
    )
    drain_timeout_s: float = Field(
        30.0, ge=0, description="on SIGTERM, in-flight requests finish within this long"
    )

    # The engine.
    device: str = Field("cpu", description="torch device of the model (cpu, cuda, cuda:1)")
    num_shard: int = Field(1, ge=1, description="tensor-parallel ranks (>1: one process each)")
    threads_per_rank: int | None = Field(None, ge=1, description="CPU torch threads of a rank")
    kv_cache_memory: ByteSize | None = Field(
        None, description="KV cache size, e.g. 2GiB (default: 1 GiB on CPU, 90% of free GPU)"
    )
    num_blocks: int | None = Field(
        None, ge=1, description="KV blocks (default: what KV_CACHE_MEMORY holds)"
    )
    block_size: int | None = Field(
        None, ge=1, description="tokens per KV block (default: the attention backend's choice)"
    )
    disable_custom_kernels: bool = Field(
        False, description="pure-PyTorch attention, no C++ or flash kernels"
    )
    greedy_head: bool = Field(
        True, description="bf16 CPUs: greedy rows read an int8 screen of the lm_head"
    )
    quantize: Literal["int8", "fp8"] | None = Field(
        None,
        description="quantize the decoder layers' linears at load, weights only, one scale per"
        " output row: int8, or fp8 (E4M3); each rank its slice",
    )
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto",
        description="the KV cache's element type: auto (the model's dtype), fp8 / fp8_e4m3 (E4M3,"
        " one byte a value: half a bf16 cache's bytes; each layer's scales from the checkpoint's"
        " kv_cache_scheme, else 1) or fp8_e5m2 (E5M2: more range, less precision); cpu and"
        " torch attention",
    )

    # The scheduler (TGI's meanings).
    max_batch_size: int = Field(_SCHEDULER.max_batch_size, ge=1, description="requests in one step")
    max_batch_prefill_tokens: int = Field(
        _SCHEDULER.max_batch_prefill_tokens, ge=1, description="tokens computed in one step"
    )
    max_batch_total_tokens: int | None = Field(
        _SCHEDULER.max_batch_total_tokens,
        ge=1,
        description="KV tokens of the whole batch (default: the whole KV cache)",
    )
    warm_up_rows: int = Field(
        64,
        ge=0,
        description="at start-up, on the cpu, one decode step of each batch size up to this (and"
        " max_batch_size) is run, so that their recorded op programs are ready before the first"
        " burst (0: none)",
    )
    waiting_served_ratio: float = Field(
        _SCHEDULER.waiting_served_ratio,
        ge=0,
        description="waiting requests join a running batch once this ratio of it can",
    )
    max_waiting_tokens: int = Field(
        _SCHEDULER.max_waiting_tokens,
        ge=0,
        description="steps after which waiting requests join whatever the ratio",
    )
    speculate: int = Field(
        _SCHEDULER.speculate,
        ge=0,
        le=16,
        description="speculative decoding: up to N draft tokens per decoding request and step,"
        " verified in the same forward (outputs unchanged); 0: off",
    )
    speculative_method: Literal["ngram", "suffix", "draft"] = Field(
        "ngram",
        description="where drafts come from: ngram (the request's own earlier tokens), suffix"
        " (also recent outputs of requests sharing its first prompt tokens) or draft (the"
        " --speculative-model's greedy guesses)",
    )
    speculative_model: str | None = Field(
        None,
        description="a draft model's local directory (the same tokenizer, smaller) for"
        " --speculative-method draft; with --num-shard > 1 run whole on rank 0",
    )
    lora_adapters: str | None = Field(
        None,
        description="LoRA adapters served beside the model, name=DIR,... (PEFT checkpoints:"
        " adapter_config.json and adapter_model.safetensors); a request picks one by name"
        " (TGI's adapter_id, OpenAI's model); not with --num-shard > 1",
    )
    speculative_max_batch_tokens: int = Field(
        _SCHEDULER.speculative_max_batch_tokens,
        ge=1,
        description="the most tokens a step with drafts computes; below it, drafts are added"
        " where they pay here (steps timed per load level: none where a batch is compute-bound)",
    )
    max_grammar_cache: int = Field(
        DEFAULT_MAX_CACHE, ge=1, description="compiled grammars kept for structured output (LRU)"
    )

    # Logs and traces, as TGI's launcher.
    json_output: bool = Field(False, description="log one JSON object per line")
    otlp_endpoint: str | None = Field(
        None, description="export OpenTelemetry traces to this OTLP/HTTP collector"
    )
    otlp_service_name: str = Field("tgq", description="service name of the exported traces")
    inject_fault: str | None = Field(
        None, description="reliability tests: engine_step:N makes the Nth engine step raise"
    )

    @property
    def adapter_dirs(self) -> dict[str, str]:
        """`--lora-adapters` as adapter name -> directory, in the order given."""
        return parse_adapters(self.lora_adapters or "")

    @property
    def model_path(self) -> str:
        """Where the model's files are: `model_dir`, else `model_id` (a directory or hub id)."""
        return self.model_dir or self.model_id

    @property
    def num_warm_up_rows(self) -> int:
        """The batch sizes `warm_up_decode` runs: none off the cpu or without the custom kernels
        (no recorded programs there)."""
        records = self.device == "cpu" and not self.disable_custom_kernels
        return min(self.warm_up_rows, self.max_batch_size) if records else 0

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_batch_total_tokens=self.max_batch_total_tokens,
            max_batch_prefill_tokens=self.max_batch_prefill_tokens,
            max_batch_size=self.max_batch_size,
            waiting_served_ratio=self.waiting_served_ratio,
            max_waiting_tokens=self.max_waiting_tokens,
            speculate=self.speculate,
            speculative_method=self.speculative_method,
            speculative_max_batch_tokens=self.speculative_max_batch_tokens,
        )

    def transport_config(self) -> TransportConfig:
        return TransportConfig(
            max_attempts=self.max_attempts,
            lease_s=self.lease_s,
            heartbeat_ttl_s=self.heartbeat_ttl_s,
        )

    @model_validator(mode="after")
    def _check_engine_configs(self) -> BatcherOptions:
        self.scheduler_config()  # their own checks, at start (a ValueError is a bad option)
        self.transport_config()
        drafting = self.speculate > 0 and self.speculative_method == "draft"
        if drafting != (self.speculative_model is not None):
            raise ValueError(
                "--speculative-method draft (with --speculate N) and --speculative-model DIR"
                " go together"
            )
        adapters = self.adapter_dirs
        if adapters and self.num_shard > 1:
            raise ValueError(
                "--lora-adapters is not supported with --num-shard > 1 (the adapters' weights"
                " are not sharded)"
            )
        if self.model_id in adapters:
            raise ValueError(f"--lora-adapters: {self.model_id!r} is the base model's id")
        return self


def parse_adapters(text: str) -> dict[str, str]:
    """`name=DIR,name=DIR` -> {name: DIR}; a ValueError for an entry without both or a name
    given twice."""
    adapters: dict[str, str] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        name, _, directory = entry.partition("=")
        name, directory = name.strip(), directory.strip()
        if not name or not directory:
            raise ValueError(f"--lora-adapters: {entry!r} is not name=DIR")
        if name in adapters:
            raise ValueError(f"--lora-adapters: adapter {name!r} is given twice")
        adapters[name] = directory
    return adapters
