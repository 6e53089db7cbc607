"""Loading through the registry: hub-style cache offline, pickle refused, dtypes, shards."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tgq.batcher.offline import OfflineEngine
from tgq.devtools.random_model import make_config, write_model
from tgq.gpu_worker.hub import PickleWeightsError
from tgq.gpu_worker.loader import load_model
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig

CPU = torch.device("cpu")
COMMIT = "0123456789abcdef0123456789abcdef01234567"
PROMPT = [5, 9, 14, 3, 77, 31, 8]


def hub_cache(root: Path, repo: str, source: Path) -> Path:
    """Lay `source`'s files out as huggingface_hub's cache does for `repo` at COMMIT."""
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(COMMIT)
    shutil.copytree(source, repo_dir / "snapshots" / COMMIT)
    return root


def greedy(model_id: str, cache_dir: str | None = None, revision: str | None = None) -> list[int]:
    config = RunnerConfig(model_id, revision=revision, cache_dir=cache_dir, num_blocks=16)
    runner = ModelRunner(config)
    [result] = OfflineEngine(runner).generate([PROMPT], max_new_tokens=6)
    return result.token_ids


def test_hub_id_loads_offline_from_a_local_cache(
    tmp_path: Path, model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = hub_cache(tmp_path / "hub", "tgq-test/tiny-llama", model_dirs["llama3-gqa"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from_hub = greedy("tgq-test/tiny-llama", cache_dir=str(cache), revision=COMMIT)
    assert from_hub == greedy(str(model_dirs["llama3-gqa"]))


def test_pickle_only_repository_is_refused(tmp_path: Path, model_dirs: dict[str, Path]) -> None:
    repo = tmp_path / "pickled"
    repo.mkdir()
    shutil.copy(model_dirs["llama3-gqa"] / "config.json", repo)
    (repo / "pytorch_model.bin").write_bytes(os.urandom(64))  # never opened
    with pytest.raises(PickleWeightsError, match="only has pickle weights"):
        load_model(str(repo), device=CPU)


def test_unsupported_architecture_lists_the_supported_ones(tmp_path: Path) -> None:
    model_dir = write_model(tmp_path / "gpt2", make_config("LlamaForCausalLM"))
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    expected = (
        "unsupported architecture 'GPT2LMHeadModel'; tgq supports: Gemma2ForCausalLM, "
        "Gemma3ForCausalLM, Gemma3ForConditionalGeneration, LlamaForCausalLM, "
        "MistralForCausalLM, MixtralForCausalLM, "
        "Phi3ForCausalLM, Qwen2ForCausalLM, Qwen2MoeForCausalLM, Qwen3ForCausalLM, "
        "Qwen3MoeForCausalLM"
    )
    with pytest.raises(ValueError, match=expected):
        load_model(str(model_dir), device=CPU)


def test_float16_checkpoint_loads_as_bfloat16_on_cpu(tmp_path: Path) -> None:
    config = make_config("LlamaForCausalLM", dtype="float16")
    model_dir = write_model(tmp_path / "fp16", config, dtype=torch.float16)
    loaded = load_model(str(model_dir), device=CPU)
    assert loaded.dtype == torch.bfloat16
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert load_model(str(model_dir), device=CPU, dtype="float32").dtype == torch.float32


def test_sharded_checkpoint_equals_single_file(tmp_path: Path) -> None:
    config = make_config("Qwen2ForCausalLM")
    single = write_model(tmp_path / "single", config, seed=3)
    sharded = write_model(tmp_path / "sharded", config, seed=3, num_shards=3)
    assert (sharded / "model.safetensors.index.json").is_file()
    a = load_model(str(single), device=CPU).model.state_dict()
    b = load_model(str(sharded), device=CPU).model.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model_dir = write_model(tmp_path / "broken", make_config("LlamaForCausalLM"))
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ValueError, match=r"no tensor 'model.layers.1.self_attn.k_proj.weight'"):
        load_model(str(model_dir), device=CPU)


def _anon_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_loading_holds_one_copy_of_the_weights(tmp_path: Path) -> None:
    config = make_config("LlamaForCausalLM", hidden_size=512, intermediate_size=2048)
    model_dir = write_model(tmp_path / "big", config, dtype=torch.bfloat16)  # ~16 MB of weights
    warm_up = write_model(tmp_path / "small", make_config("LlamaForCausalLM"), dtype=torch.bfloat16)
    load_model(str(warm_up), device=CPU, dtype="float32")  # one-time lazy initialisation
    before = _anon_rss_bytes()
    loaded = load_model(str(model_dir), device=CPU, dtype="float32")
    grown = _anon_rss_bytes() - before
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    assert grown < 1.25 * weight_bytes + (8 << 20), (grown, weight_bytes)
