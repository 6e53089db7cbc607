"""The batcher's options reach what they configure: the scheduler, the transport, the runner,
in the api's in-process batcher (embedded mode) and in `python -m tgq.batcher` alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from huggingface_hub import constants

from tests.gpu_worker.lora_adapters import write_adapter
from tests.gpu_worker.test_weights import make_hub_cache, safetensors_bytes
from tgq.api.settings import Settings
from tgq.batcher.__main__ import build_engine, build_runner, describe, parse_args, resolve_model
from tgq.batcher.config import SchedulerConfig
from tgq.batcher.embedded import EmbeddedBatcher
from tgq.batcher.options import BatcherOptions
from tgq.batcher.speculation import SuffixProposer
from tgq.batcher.transport.base import TransportConfig
from tgq.devtools.random_model import make_config, write_model
from tgq.gpu_worker.layers.linear import Linear
from tgq.gpu_worker.runner import ModelRunner

FLAGS: dict[str, Any] = {
    "max_batch_size": 3, "max_batch_prefill_tokens": 48, "max_batch_total_tokens": 400,
    "waiting_served_ratio": 0.7, "max_waiting_tokens": 9, "lease_s": 11.0, "max_attempts": 5,
    "heartbeat_ttl_s": 3.0, "dtype": "bfloat16", "disable_custom_kernels": True,
    "kv_cache_memory": 1 << 20, "batcher_id": "b9", "speculate": 5,
    "speculative_method": "suffix", "speculative_max_batch_tokens": 20,
}  # fmt: skip
SCHEDULER = SchedulerConfig(
    max_batch_total_tokens=400, max_batch_prefill_tokens=48, max_batch_size=3,
    waiting_served_ratio=0.7, max_waiting_tokens=9, speculate=5, speculative_method="suffix",
    speculative_max_batch_tokens=20,
)  # fmt: skip
TRANSPORT = TransportConfig(max_attempts=5, lease_s=11.0, heartbeat_ttl_s=3.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model")
    write_model(path, make_config("LlamaForCausalLM"), seed=3)
    return path


def check_runner(runner: object, model_dir: Path) -> None:
    assert isinstance(runner, ModelRunner)
    assert runner.loaded.dtype == torch.bfloat16
    assert runner.backend.name == "torch" and runner.loaded.num_cpu_kernel_modules == 0
    config = (model_dir / "config.json").read_text()
    assert '"num_hidden_layers": 2' in config  # the block count below assumes the tiny shape
    assert runner.num_blocks == (1 << 20) // runner.block_size // (2 * 2 * 2 * 16 * 2)


def test_the_embedded_batcher_takes_the_api_settings(model_dir: Path) -> None:
    embedded = EmbeddedBatcher(Settings(model_dir=str(model_dir), **FLAGS))
    assert embedded.engine.scheduler.config == SCHEDULER
    assert isinstance(embedded.engine.scheduler.speculation.proposer, SuffixProposer)  # type: ignore[union-attr]
    assert embedded.transport.config == TRANSPORT
    assert embedded.batcher.config.batcher_id == "b9"
    check_runner(embedded.engine.runner, model_dir)


def test_the_batcher_process_takes_its_flags(model_dir: Path) -> None:
    argv = ["--model-id", str(model_dir)]
    for name, value in FLAGS.items():
        flag = f"--{name.replace('_', '-')}"
        argv += [flag] if value is True else [flag, str(value)]
    options = parse_args(argv)
    assert options.transport_config() == TRANSPORT and options.batcher_id == "b9"
    runner = build_runner(options, str(model_dir))
    check_runner(runner, model_dir)
    assert build_engine(options, str(model_dir), runner).scheduler.config == SCHEDULER


def test_revision_picks_the_snapshot_for_the_batcher_and_the_limits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--revision: the batcher loads that snapshot of a hub id, and the api's token limits come
    from its config (main: a 4096-token context; v2: 2048)."""
    weights = safetensors_bytes(tmp_path)
    cache = tmp_path / "cache"
    main = make_hub_cache(cache, "org/m", {"config.json": b'{"max_position_embeddings": 4096}'})
    storage = main.parents[1]
    v2 = storage / "snapshots" / ("b" * 40)
    v2.mkdir()
    (v2 / "config.json").write_text('{"max_position_embeddings": 2048}')
    (storage / "refs" / "v2").write_text("b" * 40)
    for snapshot in (main, v2):
        (snapshot / "model.safetensors").write_bytes(weights)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    assert resolve_model(BatcherOptions(model_id="org/m")) == str(main)
    assert resolve_model(BatcherOptions(model_id="org/m", revision="v2")) == str(v2)
    assert Settings(model_id="org/m").max_total_tokens == 4096
    assert Settings(model_id="org/m", revision="v2").max_total_tokens == 2048


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantize_reaches_the_runner_and_the_start_up_line(method: str, model_dir: Path) -> None:
    options = parse_args(
        ["--model-id", str(model_dir), "--quantize", method, "--dtype", "bfloat16"]
    )
    runner = build_runner(options, str(model_dir))
    assert isinstance(runner, ModelRunner) and runner.loaded.quantize == method
    linears = {n: m for n, m in runner.loaded.model.named_modules() if isinstance(m, Linear)}
    assert linears["model.layers.0.self_attn.qkv_proj"].is_quantized
    assert linears["model.layers.1.mlp.down_proj"].is_quantized
    assert not linears["lm_head"].is_quantized
    line = describe(options, runner)
    assert f"dtype bfloat16 with {method} linears" in line and " MiB" in line


def test_quantize_refuses_what_it_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown method at the flag (several ranks quantize their slices:
    tests/gpu_worker/test_tensor_parallel.py)."""
    with pytest.raises(SystemExit):
        parse_args(["--model-id", "m", "--quantize", "int4"])
    message = "argument --quantize: invalid choice: 'int4' (choose from 'int8', 'fp8')"
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--speculate", "3", "--speculative-method", "draft"], "go together"),
        (["--speculative-model", "d"], "go together"),
        (["--speculate", "17"], "--speculate: Input should be less than or equal to 16"),
        (["--lora-adapters", "a"], "--lora-adapters: 'a' is not name=DIR"),
        (["--lora-adapters", "a=x,a=y"], "--lora-adapters: adapter 'a' is given twice"),
        (["--lora-adapters", "m=x"], "--lora-adapters: 'm' is the base model's id"),
        (["--lora-adapters", "a=x", "--num-shard", "2"], "not supported with --num-shard > 1"),
    ],
)
def test_speculation_options_that_cannot_run_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--model-id", "m", *argv])
    assert message in capsys.readouterr().err


def test_lora_adapters_reach_the_runner_and_the_engine(model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("peft")
    for name in ("a", "b"):
        write_adapter(model_dir, tmp_path / name, rank=4, alpha=8)
    adapters = f"a={tmp_path / 'a'},b={tmp_path / 'b'}"
    options = parse_args(["--model-id", str(model_dir), "--lora-adapters", adapters])
    assert options.adapter_dirs == {"a": str(tmp_path / "a"), "b": str(tmp_path / "b")}
    runner = build_runner(options, str(model_dir))
    assert isinstance(runner, ModelRunner) and runner.adapter_names == {"a", "b"}
    assert build_engine(options, str(model_dir), runner).adapter_names == {"a", "b"}


def test_a_draft_model_reaches_the_runner(model_dir: Path) -> None:
    argv = ["--model-id", str(model_dir), "--speculate", "2", "--speculative-method", "draft"]
    options = parse_args([*argv, "--speculative-model", str(model_dir), "--num-blocks", "64"])
    runner = build_runner(options, str(model_dir))
    assert isinstance(runner, ModelRunner) and runner.drafter is not None
    assert runner.drafter.runner.num_blocks == runner.num_blocks == 64
    engine = build_engine(options, str(model_dir), runner)
    assert engine.scheduler.speculation is not None
    assert engine.scheduler.speculation.uses_draft_model


def test_the_warm_up_covers_the_batch_sizes_on_the_cpu_only() -> None:
    """`--warm-up-rows` (64) capped by `--max-batch-size`; none off the cpu or with
    `--disable-custom-kernels`, where nothing is recorded."""
    assert BatcherOptions(model_id="m").num_warm_up_rows == 64
    assert BatcherOptions(model_id="m", max_batch_size=8).num_warm_up_rows == 8
    assert BatcherOptions(model_id="m", warm_up_rows=0).num_warm_up_rows == 0
    assert BatcherOptions(model_id="m", device="cuda").num_warm_up_rows == 0
    assert BatcherOptions(model_id="m", disable_custom_kernels=True).num_warm_up_rows == 0
