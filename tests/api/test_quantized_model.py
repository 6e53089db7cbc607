"""The api refuses to start on a quantized checkpoint it cannot run, with the message the batcher
gives (tests/gpu_worker/test_quantized.py), before it serves anything; `--quantize int8` serves a
float checkpoint with int8 or fp8 linears, in both modes; a compressed-tensors FP8 checkpoint (the
real library's, tests/gpu_worker/test_compressed.py) serves as stored."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from tests.api.stack import REDIS_URL, Stack, running
from tests.polling import eventually


def test_the_api_does_not_start_on_a_quantized_checkpoint(
    text_model_dir: Path, pg_url: str, tmp_path: Path
) -> None:
    model_dir = tmp_path / "awq-gemv"
    shutil.copytree(text_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    section = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}
    (model_dir / "config.json").write_text(json.dumps({**config, "quantization_config": section}))
    stack = Stack(model_dir, pg_url, tmp_path)
    try:
        with pytest.raises(RuntimeError, match="the api exited") as caught:
            stack.start_api()
    finally:
        stack.stop()
    assert (
        "awq checkpoints are supported with 4-bit weights (gptq: 4 or 8 bits) in groups, gptq in"
        " its gptq or gptq_v2 format, awq in its gemm layout with zero points: this one has"
        " version 'gemv'"
    ) in str(caught.value)


@pytest.mark.parametrize(("mode", "method"), [("embedded", "int8"), ("services", "fp8")])
def test_quantize_serves_and_says_so(
    mode: str, method: str, text_model_dir: Path, pg_url: str, tmp_path: Path
) -> None:
    """`--quantize` (QUANTIZE for the api): /info names it, the batcher's start-up line gives
    the weights' size, and generation runs on the quantized linears."""
    stack = Stack(
        text_model_dir,
        pg_url,
        tmp_path,
        api_env={"QUANTIZE": method},
        batcher_options=("--quantize", method),
        redis_url=None if mode == "embedded" else REDIS_URL,
    )
    with running(stack, batcher=mode == "services"):
        info = reported_info(stack.url)
        assert info["quantize"] == method
        body = {"inputs": "hello", "parameters": {"max_new_tokens": 5, "details": True}}
        answer = httpx.post(f"{stack.url}/generate", json=body, timeout=60)
        assert answer.status_code == 200 and answer.json()["details"]["generated_tokens"] == 5
        log = stack.api_log() if mode == "embedded" else (tmp_path / "batcher-b0.log").read_text()
    assert f"with {method} linears" in log
    assert_memory_matches_the_log(info, log)


def reported_info(url: str) -> dict[str, object]:
    """/info once a batcher's heartbeat has told the api what it holds."""

    def info() -> dict[str, object]:
        body: dict[str, object] = httpx.get(f"{url}/info", timeout=10).json()
        return body if body["weight_bytes"] is not None else {}

    return eventually(info, 30, "/info with the batcher's weight_bytes")


def assert_memory_matches_the_log(info: dict[str, object], log: str) -> None:
    """/info's weight bytes and KV blocks are the start-up line's ("weights 12.3 MiB; KV 500
    blocks of 16 tokens")."""
    mib = float(log.split("weights ", 1)[1].split(" MiB", 1)[0])
    blocks = int(log.split(" KV ", 1)[1].split(" blocks", 1)[0])
    assert isinstance(info["weight_bytes"], int)
    assert abs(info["weight_bytes"] / 2**20 - mib) <= 0.05
    assert info["kv_cache_blocks"] == blocks - 1  # block 0 is reserved
    assert info["kv_block_size"] == int(log.split(" blocks of ", 1)[1].split(" tokens", 1)[0])


@pytest.mark.parametrize(
    ("mode", "fmt", "method"),
    [("embedded", "FP8_DYNAMIC", "compressed-tensors"), ("services", "gptq", "gptq")],
)
def test_a_quantized_checkpoint_serves_and_says_so(
    mode: str, fmt: str, method: str, text_model_dir: Path, pg_url: str, tmp_path: Path
) -> None:
    """A compressed-tensors (8-bit) and a GPTQ (4-bit, groups of 32) checkpoint: /info names the
    method, and the weights' size is the start-up line's."""
    from tgq.devtools.compressed_checkpoint import write_compressed
    from tgq.devtools.grouped_checkpoint import write_grouped

    if fmt == "gptq":
        model_dir = write_grouped(text_model_dir, tmp_path / fmt, fmt, 32)
    else:
        model_dir = write_compressed(text_model_dir, tmp_path / fmt, fmt)
    stack = Stack(model_dir, pg_url, tmp_path, redis_url=None if mode == "embedded" else REDIS_URL)
    with running(stack, batcher=mode == "services"):
        info = reported_info(stack.url)
        assert info["quantize"] == method
        body = {"inputs": "hello", "parameters": {"max_new_tokens": 5, "details": True}}
        answer = httpx.post(f"{stack.url}/generate", json=body, timeout=60)
        assert answer.status_code == 200 and answer.json()["details"]["generated_tokens"] == 5
        log = stack.api_log() if mode == "embedded" else (tmp_path / "batcher-b0.log").read_text()
    assert f"with {method} linears" in log
    assert_memory_matches_the_log(info, log)
