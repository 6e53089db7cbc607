"""Model registry: `config.json` `architectures[0]` -> implementation, imported lazily."""

from __future__ import annotations

import importlib

from tgq.gpu_worker.config import ModelConfig
from tgq.gpu_worker.models.decoder import DecoderForCausalLM

# architecture name -> module under gpu_worker.models that defines a class of that name
_ARCHITECTURES = {
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "Phi3ForCausalLM": "phi3",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def model_class(config: ModelConfig) -> type[DecoderForCausalLM]:
    module_name = _ARCHITECTURES.get(config.architecture)
    if module_name is None:
        raise ValueError(
            f"unsupported architecture {config.architecture!r}; tgq supports: "
            + ", ".join(supported_architectures())
        )
    module = importlib.import_module(f"tgq.gpu_worker.models.{module_name}")
    cls: type[DecoderForCausalLM] = getattr(module, config.architecture)
    return cls
