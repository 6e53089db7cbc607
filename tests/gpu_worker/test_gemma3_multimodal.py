"""The text model of a multimodal Gemma 3 checkpoint (`Gemma3ForConditionalGeneration`, the 4B
and larger Gemma 3 releases): its `text_config` over Gemma3TextConfig's defaults, its weights
under either layout, the vision tower left on disk. Text generation equals transformers'
multimodal model given the same text, token for token (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.gpu_worker.test_parity import NUM_NEW, assert_matches, generate_greedy, prompts
from tgq.batcher.offline import OfflineEngine
from tgq.devtools.random_model import make_config
from tgq.gpu_worker.config import ModelConfig
from tgq.gpu_worker.plan import SamplingParams
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig

VISION = {
    "model_type": "siglip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 32,
    "patch_size": 8,
}


@pytest.fixture(scope="module")
def hub_layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random multimodal checkpoint as transformers saves it (and the hub stores it):
    `language_model.model.*`, `vision_tower.*`, `multi_modal_projector.*`, lm_head tied."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = make_config("Gemma3ForCausalLM", "tiny", sliding_window=8)
    del text["architectures"]
    config = Gemma3Config(text_config=text, vision_config=VISION, mm_tokens_per_image=4)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gemma3-multimodal")
    Gemma3ForConditionalGeneration(config).save_pretrained(path)
    return path


def transformers5_layout(hub: Path, out: Path) -> Path:
    """The same weights under transformers 5's own module names: `model.language_model.*`,
    `model.vision_tower.*`, `model.multi_modal_projector.*`."""
    out.mkdir()
    (out / "config.json").write_text((hub / "config.json").read_text())
    with safe_open(str(hub / "model.safetensors"), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    renamed = {
        "model." + name.replace("language_model.model.", "language_model.", 1): tensor
        for name, tensor in tensors.items()
    }
    save_file(renamed, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("layout", ["hub", "transformers5"])
def test_text_generation_equals_transformers_multimodal_model(
    hub_layout: Path, layout: str, tmp_path: Path
) -> None:
    from transformers import Gemma3ForConditionalGeneration

    model_dir = hub_layout if layout == "hub" else transformers5_layout(hub_layout, tmp_path / "v5")
    hf = Gemma3ForConditionalGeneration.from_pretrained(hub_layout, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    runner = ModelRunner(RunnerConfig(str(model_dir), num_blocks=64))
    assert runner.model_config.architecture == "Gemma3ForConditionalGeneration"
    batch = prompts(3, 512, 9, (3, 30))  # some past the window of 8
    results = OfflineEngine(runner).generate(
        batch, SamplingParams(logprobs=True), max_new_tokens=NUM_NEW
    )
    for result, prompt in zip(results, batch, strict=True):
        assert_matches(result, generate_greedy(hf, prompt, NUM_NEW))


def test_a_sparse_text_config_takes_gemma3_text_defaults() -> None:
    """gemma-3-4b-it's config.json sets only a few text fields; the rest are Gemma3TextConfig's
    defaults, the token ids and dtype come from the top level."""
    config = ModelConfig.from_dict(
        {
            "architectures": ["Gemma3ForConditionalGeneration"],
            "eos_token_id": [1, 106],
            "torch_dtype": "bfloat16",
            "text_config": {
                "hidden_size": 2560,
                "intermediate_size": 10240,
                "model_type": "gemma3_text",
                "num_hidden_layers": 34,
                "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                "sliding_window": 1024,
            },
            "vision_config": {"model_type": "siglip_vision_model"},
        }
    )
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (8, 4, 256)
    assert (config.vocab_size, config.max_position_embeddings) == (262_208, 131_072)
    assert config.hidden_act == "gelu_pytorch_tanh" and config.query_pre_attn_scalar == 256
    assert config.rope_theta == 1_000_000.0 and config.local_rope_theta == 10_000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert config.layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",)
    assert config.sliding_window == 1024 and config.tie_word_embeddings
    assert config.eos_token_ids == [1, 106] and config.dtype == "bfloat16"
