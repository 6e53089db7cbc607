"""Settings of the api process, validated at start. Every field is also an environment variable
of the same upper-case name (TGI launcher names where TGI has the flag: `MAX_INPUT_TOKENS`,
`MAX_CONCURRENT_REQUESTS`, `PAYLOAD_LIMIT`, ...)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="", extra="ignore", frozen=True)

    model_id: str = "tgq-demo"
    model_dir: str | None = None  # local directory with tokenizer.json (and config.json)
    database_url: str = "sqlite+aiosqlite:///tgq.db"
    auto_migrate: bool = False  # upgrade the schema at start (the embedded default does)
    redis_url: str | None = None  # None: the in-process transport (api and batcher together)
    redis_prefix: str = "tgq"
    hostname: str = "127.0.0.1"
    port: int = 3000
    drain_timeout_s: float = Field(30.0, ge=0)  # on SIGTERM: in-flight requests finish within
    compute_type: str = "gpu+optimized"  # TGI's `x-compute-type` header: a deployment label

    # Observability, as TGI's launcher: JSON log lines; OpenTelemetry traces exported over
    # OTLP/HTTP to `otlp_endpoint` (the collector's base URL; needs the `otel` extra).
    json_output: bool = False
    otlp_endpoint: str | None = None
    otlp_service_name: str = "tgq"

    # TGI's limits, same names and defaults.
    max_concurrent_requests: int = Field(128, ge=1)
    max_best_of: int = Field(2, ge=1)
    max_stop_sequences: int = Field(4, ge=0)
    max_top_n_tokens: int = Field(5, ge=0)
    max_input_tokens: int = Field(1023, ge=1)
    max_total_tokens: int = Field(1024, ge=2)
    max_client_batch_size: int = Field(4, ge=1)
    max_choices: int = Field(8, ge=1)  # OpenAI `n` (TGI ignores `n`; tgq runs n samples)
    payload_limit: int = Field(2_000_000, ge=1)
    validation_workers: int = Field(2, ge=1)
    # What TGI lacks: a bounded queue (requests queued but not finished, over all api replicas)
    # and a bound on the tokens this replica has in flight; past either: 429 with Retry-After.
    max_queued_requests: int = Field(4096, ge=1)
    max_queued_tokens: int = Field(4_000_000, ge=1)
    max_job_prompts: int = Field(1000, ge=1)  # prompts in one POST /v1/jobs
    retry_after_s: int = Field(1, ge=1)

    # Uploaded files (POST /v1/files): not bound by `payload_limit`, streamed to storage.
    max_file_bytes: int = Field(200_000_000, ge=1)  # OpenAI's 200 MB; past it: 413
    max_file_lines: int = Field(50_000, ge=1)  # requests in one batch input file
    file_storage_dir: str = ".cache/files"  # relative to the working directory

    # Batches (POST /v1/batches) run on the Celery workers (`celery`), or on a task of the api
    # process that took them (`api`); `auto`: Celery with Redis, the api process without.
    batch_runner: Literal["auto", "api", "celery"] = "auto"
    batch_window: int = Field(256, ge=1)  # a batch's requests in the transport at once
    batch_lease_s: float = Field(30.0, gt=0)  # a batch's runner silent this long is replaced

    # The reconciler: open items older than `reconcile_grace_s` that the transport has lost are
    # enqueued again, checked every `reconcile_interval_s` (0: off).
    reconcile_interval_s: float = Field(30.0, ge=0)
    reconcile_grace_s: float = Field(30.0, ge=0)

    # Retention (Celery beat, every `retention_interval_s`): finished jobs, with their items,
    # results and usage, are deleted `retention_days` after they finished (0: kept forever).
    retention_days: float = Field(30.0, ge=0)
    retention_interval_s: float = Field(3600.0, gt=0)
    # Files (uploads and batch outputs) are deleted `file_retention_days` after they were
    # created, unless an unfinished batch reads them (0: kept until deleted).
    file_retention_days: float = Field(30.0, ge=0)

    # Auth: when on, every route outside `public_routes` needs `Authorization: Bearer <key>`.
    api_key: str | None = None  # a single static key, as TGI's --api-key
    require_api_keys: bool = False  # keys stored (hashed) in the database
    public_routes: tuple[str, ...] = ("/health", "/ping", "/info", "/metrics", "/v1/models")
    cors_allow_origin: tuple[str, ...] = ()

    @property
    def batches_on_celery(self) -> bool:
        if self.batch_runner == "auto":
            return self.redis_url is not None
        return self.batch_runner == "celery"

    @model_validator(mode="after")
    def _check_lengths(self) -> Settings:
        if self.max_input_tokens >= self.max_total_tokens:
            raise ValueError(
                "`max_input_tokens` must be < `max_total_tokens`. Given: "
                f"{self.max_input_tokens} and {self.max_total_tokens}"
            )
        return self

    @property
    def is_auth_enabled(self) -> bool:
        return self.api_key is not None or self.require_api_keys
