"""The demo model's recipe, on a tiny config: corpus, training, loading, rebuilding when stale."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tgq.batcher.offline import OfflineEngine
from tgq.devtools.demo import DEMO_VERSION, VERSION_FILE, demo_model
from tgq.devtools.random_model import make_config, write_model
from tgq.devtools.tokenizer import train_tokenizer
from tgq.devtools.train_demo import TrainConfig, TrainResult, build
from tgq.gpu_worker.loader import load_model
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig

TINY = TrainConfig(
    steps=20,
    batch_size=8,
    context=32,
    lr=1e-2,
    warmup_steps=2,
    vocab_size=320,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    val_fraction=0.003,
)


def corpus_json(hash_seed: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    command = [sys.executable, "-m", "tgq.devtools.corpus"]
    return subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TrainResult]:
    out = tmp_path_factory.mktemp("demo") / "tiny"
    return out, build(out, TINY)


def test_corpus_is_the_same_whatever_the_hash_seed() -> None:
    first = corpus_json("1")
    assert first == corpus_json("2")
    texts = json.loads(first)
    assert len(texts) > 2000
    assert sum(map(len, texts)) > 1_000_000
    assert any('The "for" statement is used to iterate' in t for t in texts)  # pydoc topics
    assert any("Serialize ``obj`` to a JSON formatted ``str``" in t for t in texts)  # json


def test_short_training_lowers_the_loss(tiny_build: tuple[Path, TrainResult]) -> None:
    _, result = tiny_build
    assert result.final_loss < result.first_loss - 0.5
    assert result.val_loss < result.first_loss


def test_trained_dir_loads_in_tgq_with_a_chat_template(
    tiny_build: tuple[Path, TrainResult],
) -> None:
    out, _ = tiny_build
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (out / name).is_file()
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())
    loaded = load_model(str(out), device=torch.device("cpu"))
    assert loaded.config.vocab_size == TINY.vocab_size
    assert loaded.config.eos_token_ids == [2]
    runner = ModelRunner(RunnerConfig(str(out), num_blocks=16))
    [result] = OfflineEngine(runner).generate([[5, 9, 14]], max_new_tokens=4)
    assert len(result.token_ids) >= 1


def test_stale_demo_dir_is_rebuilt_once(tmp_path: Path) -> None:
    old = tmp_path / "demo"
    train_tokenizer(old)  # the random-weight demo of before: no version stamp
    write_model(old, make_config("LlamaForCausalLM"))
    demo_model(old, TINY)
    assert (old / VERSION_FILE).read_text() == DEMO_VERSION
    assert json.loads((old / "config.json").read_text())["hidden_size"] == TINY.hidden_size
    built_at = (old / "model.safetensors").stat().st_mtime_ns
    demo_model(old, TINY)
    assert (old / "model.safetensors").stat().st_mtime_ns == built_at
