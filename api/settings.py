"""Settings of tgq: the batcher's options (`batcher.options.BatcherOptions`) and the api's own,
validated at start. Every field is an environment variable of the same upper-case name and a
flag of the `tgq` commands (`batcher.flags`), with TGI launcher names where TGI has the flag
(`MAX_INPUT_TOKENS`, `MAX_CONCURRENT_REQUESTS`, `PAYLOAD_LIMIT`, ...)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tgq.api.limits import default_total_tokens
from tgq.batcher.options import BatcherOptions


class Settings(BatcherOptions):
    hostname: str = Field("127.0.0.1", description="address the api listens on")
    port: int = Field(3000, description="port the api listens on")
    database_url: str = Field(
        "sqlite+aiosqlite:///tgq.db", description="the database (Postgres in production)"
    )
    auto_migrate: bool = Field(
        False, description="upgrade the schema at start (the embedded default does)"
    )
    compute_type: str = Field(
        "gpu+optimized", description="TGI's `x-compute-type` header: a deployment label"
    )

    # TGI's limits, same names and defaults.
    max_concurrent_requests: int = Field(128, ge=1, description="requests the api runs at once")
    max_best_of: int = Field(2, ge=1, description="largest `best_of`")
    max_stop_sequences: int = Field(4, ge=0, description="most `stop` sequences")
    max_top_n_tokens: int = Field(5, ge=0, description="largest `top_n_tokens` / `top_logprobs`")
    # 0: from the model (api.limits): its context length capped by the KV cache, and one less.
    max_input_tokens: int = Field(
        0, ge=0, description="longest prompt in tokens (0: MAX_TOTAL_TOKENS - 1)"
    )
    max_total_tokens: int = Field(
        0, ge=0, description="prompt plus generated tokens (0: the model's context length)"
    )
    max_client_batch_size: int = Field(
        4, ge=1, description="prompts in one /v1/completions request"
    )
    max_choices: int = Field(8, ge=1, description="largest OpenAI `n` (tgq runs n samples)")
    payload_limit: int = Field(2_000_000, ge=1, description="largest request body in bytes")
    validation_workers: int = Field(2, ge=1, description="tokenizer threads of the api")
    # What TGI lacks: a bounded queue (requests queued but not finished, over all api replicas)
    # and a bound on the tokens this replica has in flight; past either: 429 with Retry-After.
    max_queued_requests: int = Field(4096, ge=1, description="requests queued, all replicas")
    max_queued_tokens: int = Field(4_000_000, ge=1, description="tokens in flight per replica")
    max_job_prompts: int = Field(1000, ge=1, description="prompts in one POST /v1/jobs")
    # TGI's flag: prompt tokens' logprobs (`decoder_input_details`, completions `echo` with
    # `logprobs`, vLLM's `prompt_logprobs`) cost a full-vocabulary softmax per prompt token and
    # skip the prefix cache, so they are off unless the server is started with them.
    enable_prefill_logprobs: bool = Field(
        False, description="answer requests for prompt tokens' logprobs (else 422)"
    )
    retry_after_s: int = Field(1, ge=1, description="`Retry-After` of a 429 or 503")

    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "auto"] = Field(
        "hermes",
        description="how `tool_choice: auto` reads calls in the output (auto: from the template)",
    )

    # Uploaded files (POST /v1/files): not bound by `payload_limit`, streamed to storage.
    max_file_bytes: int = Field(200_000_000, ge=1, description="largest uploaded file (413)")
    max_file_lines: int = Field(50_000, ge=1, description="requests in one batch input file")
    file_storage_dir: str = Field(
        ".cache/files", description="uploads and batch outputs (shared by api and workers)"
    )

    # Batches (POST /v1/batches) run on the Celery workers (`celery`), or on a task of the api
    # process that took them (`api`); `auto`: Celery with Redis, the api process without.
    batch_runner: Literal["auto", "api", "celery"] = Field(
        "auto", description="where batches run (auto: Celery with Redis, else the api)"
    )
    batch_window: int = Field(256, ge=1, description="a batch's requests in the transport")
    batch_lease_s: float = Field(
        30.0, gt=0, description="a batch's runner silent this long is replaced"
    )

    # Cache-aware routing (`batcher.transport.routing`): with Redis, a request whose prefix a
    # live batcher holds is enqueued for that batcher unless it is much busier than the others.
    cache_routing: bool = Field(
        True, description="enqueue a request for the batcher that holds its prefix"
    )

    # The reconciler: open items older than `reconcile_grace_s` that the transport has lost are
    # enqueued again, checked every `reconcile_interval_s` (0: off).
    reconcile_interval_s: float = Field(30.0, ge=0, description="reconciler period (0: off)")
    reconcile_grace_s: float = Field(
        30.0, ge=0, description="open items older than this that Redis lost are enqueued again"
    )

    # Retention (Celery beat, every `retention_interval_s`).
    retention_days: float = Field(
        30.0, ge=0, description="finished jobs are deleted this long after (0: kept)"
    )
    retention_interval_s: float = Field(3600.0, gt=0, description="retention period")
    file_retention_days: float = Field(
        30.0, ge=0, description="files are deleted this long after creation (0: kept)"
    )

    # Auth: when on, every route outside `public_routes` needs `Authorization: Bearer <key>`.
    api_key: str | None = Field(None, description="one static key, as TGI's --api-key")
    require_api_keys: bool = Field(False, description="require keys stored in the database")
    # How long a replica trusts a stored key it has checked (revocations and new limits take
    # effect within it); 0: every request looks its key up.
    key_cache_s: float = Field(1.0, ge=0, description="a checked key is trusted this long")
    # The window a key's per-minute limits count over (`api/key_policy.py`); shorter only in tests.
    rate_limit_window_s: float = Field(60.0, gt=0, description="window of per-key rpm/tpm")
    public_routes: tuple[str, ...] = Field(
        ("/health", "/ping", "/info", "/metrics", "/v1/models"),
        description="routes open without a key",
    )
    cors_allow_origin: tuple[str, ...] = Field(
        (), description="origins allowed by CORS (default: none)"
    )

    @property
    def batches_on_celery(self) -> bool:
        if self.batch_runner == "auto":
            return self.redis_url is not None
        return self.batch_runner == "celery"

    @model_validator(mode="after")
    def _check_lengths(self) -> Settings:
        if not self.max_total_tokens:
            # Filled in at validation, before anyone reads it (the model is frozen after).
            object.__setattr__(self, "max_total_tokens", default_total_tokens(self))
        if not self.max_input_tokens:
            object.__setattr__(self, "max_input_tokens", self.max_total_tokens - 1)
        if self.max_input_tokens >= self.max_total_tokens:
            raise ValueError(
                "`max_input_tokens` must be < `max_total_tokens`. Given: "
                f"{self.max_input_tokens} and {self.max_total_tokens}"
            )
        return self

    def capped_by_kv(self, capacity: int) -> Settings:
        """These settings with the token limits that came from the model (not given) cut to
        what the KV cache holds, once the batcher has sized it (embedded mode)."""
        given = self.model_fields_set
        if "max_total_tokens" in given or self.max_total_tokens <= capacity:
            return self
        update = {"max_total_tokens": capacity}
        if "max_input_tokens" not in given:
            update["max_input_tokens"] = capacity - 1
        return self.model_copy(update=update)

    @property
    def is_auth_enabled(self) -> bool:
        return self.api_key is not None or self.require_api_keys
