"""A random LoRA adapter for a Llama-family checkpoint, in PEFT's format (adapter_config.json and
adapter_model.safetensors), written from the format's layout without peft (the benchmarks' and
the demo's adapters; the parity tests write theirs with peft itself). A is [r, in], B [out, r],
under `base_model.model.<the checkpoint's module name>`.

    python -m tgq.devtools.random_lora MODEL_DIR OUT_DIR --rank 16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projection_shapes(config: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Each target projection's (in, out) features."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def write_random_adapter(
    model_dir: Path,
    out: Path,
    *,
    rank: int = 16,
    alpha: int = 32,
    targets: tuple[str, ...] = TARGETS,
    std: float = 0.02,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    config = json.loads((model_dir / "config.json").read_text())
    shapes = projection_shapes(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for target in targets:
            in_features, out_features = shapes[target]
            group = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            name = f"base_model.model.model.layers.{layer}.{group}.{target}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) * std
            tensors[f"{name}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * std
    out.mkdir(parents=True, exist_ok=True)
    adapter_config = {
        "peft_type": "LORA",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    save_file(
        {k: v.to(dtype).contiguous() for k, v in tensors.items()},
        str(out / "adapter_model.safetensors"),
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write_random_adapter(args.model_dir, args.out, rank=args.rank, seed=args.seed)


if __name__ == "__main__":
    main()
