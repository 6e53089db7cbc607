"""Random LoRA adapters for a checkpoint, written by peft itself (PEFT's format: adapter_config.json
and adapter_model.safetensors), and transformers with one merged as the reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
LORA_STD = 0.05  # random A and B: terms as large as the random base weights' (std 0.02)


def write_adapter(
    base: Path,
    path: Path,
    *,
    rank: int,
    alpha: int,
    targets: tuple[str, ...] = ATTENTION + MLP,
    use_rslora: bool = False,
    seed: int = 0,
) -> Path:
    """A PEFT LoRA adapter for `base` at `path`, every A and B random (peft starts B at 0)."""
    import peft
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, use_rslora=use_rslora, target_modules=list(targets)
    )
    wrapped = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * LORA_STD)
    wrapped.save_pretrained(str(path))
    return path


def merged_model(base: Path, adapter: Path | None, as_reference: Any = None) -> Any:
    """transformers fp32 with `adapter` merged (`merge_and_unload`; None: the base model);
    `as_reference`: applied to the base model first (the quantized mode's weights)."""
    import peft
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if as_reference is not None:
        model = as_reference(model)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.generation_config.eos_token_id = None  # generate exactly the tokens asked for
    return model.eval()
