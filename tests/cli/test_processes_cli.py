"""`tgq api/batcher/serve/migrate/download`: the flag-to-environment mapping, and the commands
run for real (Postgres, a hub-style cache offline, `tgq serve` as a child process)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from tests.api.stack import create_database, drop_database, free_port, wait_healthy
from tests.gpu_worker.test_weights import make_hub_cache, safetensors_bytes
from tests.polling import eventually
from tgq.api.db.migrate import head_revision
from tgq.api.settings import Settings
from tgq.batcher.__main__ import parse_args
from tgq.batcher.flags import as_env, flag_of, given
from tgq.batcher.options import BatcherOptions
from tgq.cli import CommandError
from tgq.cli.main import build_parser, main
from tgq.cli.processes import celery_argv, set_environment

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    """`set_environment` writes the flags into this process's environment, as `tgq` does."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_flags_are_the_settings_fields() -> None:
    """One model: `tgq serve`, `api`, `worker` and `beat` take every setting; `tgq batcher` and
    `python -m tgq.batcher` the batcher's options, which the settings extend."""
    assert set(BatcherOptions.model_fields) < set(Settings.model_fields)
    for command in ("serve", "api", "worker", "beat"):
        args = build_parser().parse_args([command])
        assert set(vars(args)) >= {f"option_{name}" for name in Settings.model_fields}, command
    args = build_parser().parse_args(["batcher"])
    assert {key for key in vars(args) if key.startswith("option_")} == {
        f"option_{name}" for name in BatcherOptions.model_fields
    }


# A value for every option unlike its default (typed as the flag takes it: text).
TRIED_APART = {"lora_adapters"}  # `test_lora_adapters_reach_the_api_and_the_batcher_children`
SAMPLES: dict[str, str | list[str]] = {
    "model_id": "/nowhere", "model_dir": "/nowhere/dir", "revision": "v2", "dtype": "float16",
    "redis_url": "redis://r:6379/1", "redis_prefix": "p", "batcher_id": "b7",
    "heartbeat_ttl_s": "4.5", "lease_s": "12.5", "max_attempts": "5", "drain_timeout_s": "7.5",
    "device": "cuda:1", "num_shard": "2", "threads_per_rank": "3", "kv_cache_memory": "3MiB",
    "num_blocks": "9", "block_size": "32", "max_batch_size": "3", "max_batch_prefill_tokens": "99",
    "max_batch_total_tokens": "5000", "waiting_served_ratio": "0.8", "max_waiting_tokens": "7",
    "warm_up_rows": "5",
    "max_grammar_cache": "21", "tool_call_parser": "mistral", "quantize": "int8",
    "kv_cache_dtype": "fp8", "speculate": "3", "speculative_method": "draft",
    "speculative_model": "/nowhere/draft", "speculative_max_batch_tokens": "64",
    "otlp_endpoint": "http://c:4318", "otlp_service_name": "s", "inject_fault": "engine_step:5",
    "hostname": "0.0.0.0", "port": "8080", "database_url": "postgresql+asyncpg://d/x",
    "compute_type": "cpu", "max_concurrent_requests": "9", "max_best_of": "3",
    "max_stop_sequences": "6", "max_top_n_tokens": "7", "max_input_tokens": "100",
    "max_total_tokens": "200", "max_client_batch_size": "5", "max_choices": "3",
    "payload_limit": "1234", "validation_workers": "3", "max_queued_requests": "11",
    "max_queued_tokens": "12", "max_job_prompts": "13", "retry_after_s": "4",
    "max_file_bytes": "14", "max_file_lines": "15", "file_storage_dir": "/files",
    "batch_runner": "celery", "batch_window": "16", "batch_lease_s": "17.5",
    "reconcile_interval_s": "18.5", "reconcile_grace_s": "19.5", "retention_days": "2.5",
    "retention_interval_s": "20.5", "file_retention_days": "3.5", "api_key": "k",
    "public_routes": ["/a", "/b"], "cors_allow_origin": ["http://o.example"],
    "key_cache_s": "2.5", "rate_limit_window_s": "21.5",
}  # fmt: skip


def argv_of(values: dict[str, str | list[str]]) -> list[str]:
    argv: list[str] = []
    for name, value in values.items():
        argv += [f"--{name.replace('_', '-')}", *([value] if isinstance(value, str) else value)]
    for name, field in Settings.model_fields.items():  # the switches: the other way round
        if field.annotation is bool:
            argv.append(flag_of(name, field))
    return argv


def test_every_flag_reaches_the_api_and_the_batcher_children() -> None:
    """`tgq serve --FLAG VALUE` for every option at once: what the api child (`Settings()`),
    the Celery children (the same) and the batcher child (`BatcherOptions()`) read from the
    environment they inherit is VALUE, in either mode (both start their children that way)."""
    switches = {n for n, f in Settings.model_fields.items() if f.annotation is bool}
    every = set(SAMPLES) | switches | TRIED_APART
    assert every == set(Settings.model_fields)  # every option is tried
    args = build_parser().parse_args(["serve", *argv_of(SAMPLES)])
    given_settings = set_environment(args, Settings)
    api_child, batcher_child = Settings(), BatcherOptions()
    for name, field in Settings.model_fields.items():
        if name in TRIED_APART:
            continue
        expected = getattr(given_settings, name)
        assert expected != field.default, name  # the flag changed it
        assert getattr(api_child, name) == expected, name
        if name in BatcherOptions.model_fields:
            assert getattr(batcher_child, name) == expected, name
    assert (api_child.kv_cache_memory, api_child.public_routes) == (3 << 20, ("/a", "/b"))


def test_lora_adapters_reach_the_api_and_the_batcher_children() -> None:
    """Apart from the others: adapters refuse `--num-shard` > 1, which the test above sets."""
    args = build_parser().parse_args(["serve", "--lora-adapters", "a=/nowhere/a"])
    set_environment(args, Settings)
    assert Settings().lora_adapters == BatcherOptions().lora_adapters == "a=/nowhere/a"


def test_flags_become_the_childs_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PORT", "3000")
    monkeypatch.setenv("API_KEY", "k")
    args = build_parser().parse_args(
        ["api", "--model-id", "/m", "--port", "8080", "--max-total-tokens", "2048"]
    )
    assert as_env(given(args, Settings)) == {
        "MODEL_ID": "/m", "PORT": "8080", "MAX_TOTAL_TOKENS": "2048",
    }  # fmt: skip
    settings = set_environment(args, Settings)
    assert os.environ["PORT"] == "8080" and os.environ["API_KEY"] == "k"  # a flag beats its var
    assert (settings.port, settings.api_key, settings.max_input_tokens) == (8080, "k", 2047)


def test_switches_lists_and_sizes_reach_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    args = build_parser().parse_args(
        [
            "serve", "--no-greedy-head", "--disable-custom-kernels", "--cors-allow-origin",
            "http://a", "http://b", "--kv-cache-memory", "2GiB", "--dtype", "float32",
        ]
    )  # fmt: skip
    env = as_env(given(args, Settings))
    assert env == {
        "GREEDY_HEAD": "false", "DISABLE_CUSTOM_KERNELS": "true",
        "CORS_ALLOW_ORIGIN": '["http://a", "http://b"]', "KV_CACHE_MEMORY": "2GiB",
        "DTYPE": "float32",
    }  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = Settings(model_dir="/nowhere")
    assert settings.cors_allow_origin == ("http://a", "http://b")
    assert (settings.greedy_head, settings.disable_custom_kernels) == (False, True)
    assert settings.kv_cache_memory == 2 << 30 and settings.dtype == "float32"


def test_bad_values_are_refused_in_tgq_words(monkeypatch: pytest.MonkeyPatch) -> None:
    args = build_parser().parse_args(["api", "--max-input-tokens", "9", "--max-total-tokens", "9"])
    with pytest.raises(CommandError, match="`max_input_tokens` must be < `max_total_tokens`"):
        set_environment(args, Settings)
    bad_size = build_parser().parse_args(["batcher", "--kv-cache-memory", "lots"])
    with pytest.raises(CommandError, match=r"^--kv-cache-memory: could not parse value and unit"):
        set_environment(bad_size, BatcherOptions)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--dtype", "float8"])
    with pytest.raises(SystemExit):
        parse_args(["--max-batch-size", "0"])


def test_the_servers_api_key_is_not_the_clients() -> None:
    args = build_parser().parse_args(["--api-key", "client", "api", "--api-key", "server"])
    assert args.api_key == "client"
    assert given(args, Settings) == {"api_key": "server"}


def test_the_batcher_reads_its_options_from_flags_and_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MODEL_DIR", "/d")
    monkeypatch.setenv("NUM_SHARD", "2")
    monkeypatch.setenv("REDIS_PREFIX", "p")
    args = build_parser().parse_args(["batcher", "--max-batch-size", "8", "--batcher-id", "b1"])
    options = set_environment(args, BatcherOptions)
    assert (options.model_path, options.num_shard, options.redis_prefix) == ("/d", 2, "p")
    assert (options.max_batch_size, options.batcher_id) == (8, "b1")
    assert parse_args(["--prefix", "q"]).redis_prefix == "q"  # the older spelling


def test_celery_options_follow_a_double_dash() -> None:
    args = build_parser().parse_args(["worker", "--port", "1", "--", "-c", "2"])
    assert celery_argv("worker", args.celery_args)[-4:] == ["-l", "INFO", "-c", "2"]
    assert given(args, Settings) == {"port": 1}


def test_migrate_a_fresh_database(capsys: pytest.CaptureFixture[str]) -> None:
    url = create_database()
    try:
        assert main(["migrate", "--database-url", url]) == 0
        assert capsys.readouterr().out.endswith(f": revision none -> {head_revision()}\n")
        assert main(["migrate", "--database-url", url]) == 0
        assert f"revision {head_revision()} -> {head_revision()}" in capsys.readouterr().out
    finally:
        drop_database(url)


def test_download_from_a_local_cache_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    files = {"config.json": b"{}", "model.safetensors": safetensors_bytes(tmp_path)}
    snapshot = make_hub_cache(tmp_path / "cache", "org/tiny", files)
    assert main(["download", "org/tiny", "--cache-dir", str(tmp_path / "cache")]) == 0
    assert capsys.readouterr().out == f"{snapshot}\n"


def test_download_refuses_pickle_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    make_hub_cache(tmp_path, "org/old", {"config.json": b"{}", "pytorch_model.bin": b"\0" * 8})
    assert main(["download", "org/old", "--cache-dir", str(tmp_path)]) == 2
    assert "never unpickles" in capsys.readouterr().err


def _serve(cwd: Path, env: dict[str, str], *flags: str) -> subprocess.Popen[bytes]:
    inherited = ("HOSTNAME", "PORT", "REDIS_URL", "DATABASE_URL", "MODEL_ID", "MODEL_DIR")
    base = {k: v for k, v in os.environ.items() if k not in inherited}
    command = [sys.executable, "-m", "tgq.cli", "serve", *flags]
    log = open(cwd / "serve.log", "wb")  # noqa: SIM115
    full_env = {**base, "OMP_NUM_THREADS": "1", **env}
    return subprocess.Popen(command, cwd=cwd, env=full_env, stdout=log, stderr=log)


def _answers(process: subprocess.Popen[bytes], url: str, log: Path) -> None:
    """`/health` says 200 within a minute, then `/generate` answers."""
    wait_healthy(url, process, log, 60)
    body = {"inputs": "def main():", "parameters": {"max_new_tokens": 4}}
    response = httpx.post(f"{url}/generate", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert isinstance(response.json()["generated_text"], str)


def _children(pid: int) -> list[int]:
    """The live descendants of `pid`, from /proc (Linux)."""
    parent_of: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parent_of[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        kids = [child for child, parent in parent_of.items() if parent in frontier]
        found += kids
        frontier = kids
    return found


def _is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def _stops_cleanly(process: subprocess.Popen[bytes], log: Path) -> list[int]:
    """SIGTERM: `tgq serve` exits 0 and leaves no process behind; its descendants before."""
    descendants = _children(process.pid)
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0, log.read_text(errors="replace")[-3000:]
    eventually(
        lambda: not any(map(_is_alive, descendants)),
        5,
        lambda: f"its children gone: {[pid for pid in descendants if _is_alive(pid)]} alive",
        interval_s=0.1,
    )
    return descendants


def test_serve_embedded(text_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    process = _serve(tmp_path, {}, "--model-id", str(text_model_dir), "--port", str(port))
    log = tmp_path / "serve.log"
    try:
        _answers(process, f"http://127.0.0.1:{port}", log)
        assert (tmp_path / ".cache" / "tgq.db").is_file()  # SQLite, migrated at start
        _stops_cleanly(process, log)
    finally:
        process.kill()


def test_serve_with_postgres_and_redis(text_model_dir: Path, tmp_path: Path) -> None:
    url, prefix, port = create_database(), f"tgq-test-{secrets.token_hex(4)}", free_port()
    env = {"DATABASE_URL": url, "REDIS_URL": REDIS_URL, "REDIS_PREFIX": prefix}
    process = _serve(tmp_path, env, "--model-id", str(text_model_dir), "--port", str(port))
    log = tmp_path / "serve.log"
    try:
        _answers(process, f"http://127.0.0.1:{port}", log)
        assert len(_stops_cleanly(process, log)) >= 3  # api, batcher, worker (and its pool)
    finally:
        process.kill()
        drop_database(url)
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=f"{prefix}:*"))
        if keys:
            client.delete(*keys)
        client.close()
