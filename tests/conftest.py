"""Shared fixtures: random-weight checkpoints in Hugging Face format, built once per session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tgq.devtools.random_model import make_config, write_model

torch.set_num_threads(2)

# name -> (architecture, config overrides); together they cover GQA, tied embeddings, the rope
# scaling types that do not depend on a sequence's length (test_parity has dynamic and longrope),
# partial rotary, fused checkpoint tensors, qkv bias, q/k norm, an explicit head_dim, a sliding
# window, Gemma 2's offset norms around each sublayer, GeGLU and soft caps, Gemma 3's rope per
# layer type, and sparse mixtures of experts (Mixtral's, Qwen2-MoE's shared expert and dense
# layers, Qwen3-MoE's renormalised top-k).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3-gqa": (
        "LlamaForCausalLM",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "rope_theta": 500000.0,
        },
    ),
    "llama2-tied-linear": (
        "LlamaForCausalLM",
        {
            "num_key_value_heads": 4,
            "tie_word_embeddings": True,
            "rope_scaling": {"type": "linear", "factor": 2.0},
        },
    ),
    "mistral-window": ("MistralForCausalLM", {"sliding_window": 8}),
    "qwen2-bias": ("Qwen2ForCausalLM", {"num_key_value_heads": 1}),
    "qwen2-yarn": (
        "Qwen2ForCausalLM",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 8.0,
            }
        },
    ),
    "gemma2-capped-window": (  # soft caps low enough to change every score and logit
        "Gemma2ForCausalLM",
        {
            "sliding_window": 8,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
            "query_pre_attn_scalar": 24,
        },
    ),
    "gemma3-local-rope": (  # the sliding layers' own rope base, the global layers' scaled one
        "Gemma3ForCausalLM",
        {
            "sliding_window": 8,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "rope_local_base_freq": 100.0,
        },
    ),
    # Mixtures of experts (devtools.random_model: a router with clear margins)
    "mixtral-top2": ("MixtralForCausalLM", {}),
    "qwen2moe-shared-dense-layer": ("Qwen2MoeForCausalLM", {"mlp_only_layers": [1]}),
    "qwen3moe-top3-norm": ("Qwen3MoeForCausalLM", {}),
    "phi3-partial-window": (  # fused q/k/v and gate/up in the checkpoint; half of each head rotates
        "Phi3ForCausalLM",
        {"partial_rotary_factor": 0.5, "sliding_window": 8},
    ),
    "qwen3-qknorm": (
        "Qwen3ForCausalLM",
        {"head_dim": 32, "tie_word_embeddings": True, "attention_bias": False},
    ),
}


# The two longest files (a venv, an install and a kernel build each: ~2.5 min) go first, one to
# each worker of `-n 2 --dist loadfile` (`make test`), so that they run beside the others instead
# of after them. It takes `--no-loadscope-reorder` (in pyproject's addopts): by default xdist
# hands out the files with the most tests first, and these have the fewest.
FIRST = ("tests/install/",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not item.nodeid.startswith(FIRST))


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built() -> None:
    """Compiles the CPU kernels (once per cache, ~30 s on 2 cores) before any test starts a
    batcher: a first build inside a batcher would race the deadline its test waits with."""
    from tgq.kernels import cpu_ops

    cpu_ops.is_available()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        name: write_model(root / name, make_config(arch, **overrides), seed=index)
        for index, (name, (arch, overrides)) in enumerate(VARIANTS.items())
    }
