"""Write a random-weight checkpoint in Hugging Face format (config.json + safetensors).

The tensors carry the checkpoint names transformers expects, so the same directory loads in tgq
and in `transformers.AutoModelForCausalLM.from_pretrained` for parity tests.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tgq.gpu_worker.config import ModelConfig

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "medium": {
        "vocab_size": 32000,
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
    },
}

OFFSET_NORMS = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


def make_config(architecture: str, shape: str = "tiny", **overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": _MODEL_TYPES.get(architecture, "unknown"),
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "float32",
        **SHAPES[shape],
    }
    if architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    # Experts: half the dense intermediate size each, as many as shape allows two by two.
    expert_size = config["intermediate_size"] // 2
    if architecture == "MixtralForCausalLM":
        config.update(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    if architecture == "Qwen2MoeForCausalLM":
        config.update(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=expert_size,
            shared_expert_intermediate_size=config["intermediate_size"],
            norm_topk_prob=False,
            use_sliding_window=False,
        )
    if architecture == "Qwen3MoeForCausalLM":
        config.update(
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=expert_size,
            norm_topk_prob=True,
            use_sliding_window=False,
        )
    if architecture == "Phi3ForCausalLM":
        config["pad_token_id"] = 0  # transformers' default (32000) lies past a small vocabulary
    if architecture in OFFSET_NORMS:  # Gemma 2 and 3
        head_dim = config["hidden_size"] // config["num_attention_heads"]
        del config["hidden_act"]  # Gemma names it `hidden_activation`
        config.update(
            pad_token_id=0,
            hidden_activation="gelu_pytorch_tanh",
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            sliding_window=4096,
            tie_word_embeddings=True,
        )
    if architecture == "Gemma2ForCausalLM":
        config.update(attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    if architecture == "Gemma3ForCausalLM":
        config.update(
            sliding_window_pattern=2,  # both kinds of layer in a two-layer model
            rope_theta=1_000_000.0,
            rope_local_base_freq=10_000.0,
        )
    config.update(overrides)
    return config


def random_tensors(config: dict[str, Any], seed: int = 0, std: float = 0.02) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    arch = config["architectures"][0]
    qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
    qkv_bias = qwen2 or config.get("attention_bias", False)
    o_bias = not qwen2 and config.get("attention_bias", False)
    moe_layers = ModelConfig.from_dict(config).moe_layers

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm(size: int) -> torch.Tensor:
        # Gemma stores its norm weights as offsets from 1 (it scales by 1 + weight)
        offset = 0.0 if arch in OFFSET_NORMS else 1.0
        return offset + 0.1 * torch.randn(size, generator=gen)

    tensors = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj": (heads * head_dim, hidden),
            "self_attn.k_proj": (kv_heads * head_dim, hidden),
            "self_attn.v_proj": (kv_heads * head_dim, hidden),
            "self_attn.o_proj": (hidden, heads * head_dim),
            "mlp.gate_proj": (inter, hidden),
            "mlp.up_proj": (inter, hidden),
            "mlp.down_proj": (hidden, inter),
        }
        if moe_layers[i]:
            shapes = {k: v for k, v in shapes.items() if not k.startswith("mlp.")}
            tensors.update(_experts(config, p, normal))
        for name, dims in shapes.items():
            tensors[f"{p}{name}.weight"] = normal(*dims)
        if qkv_bias:
            for name in ("q_proj", "k_proj", "v_proj"):
                tensors[f"{p}self_attn.{name}.bias"] = normal(shapes[f"self_attn.{name}"][0])
        if o_bias:
            tensors[f"{p}self_attn.o_proj.bias"] = normal(hidden)
        if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"):
            tensors[f"{p}self_attn.q_norm.weight"] = norm(head_dim)
            tensors[f"{p}self_attn.k_norm.weight"] = norm(head_dim)
        if arch == "Phi3ForCausalLM":  # q/k/v and gate/up stored fused, in that order
            for fused, parts in (
                (
                    "self_attn.qkv_proj",
                    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                ),
                ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
            ):
                weights = [tensors.pop(f"{p}{part}.weight") for part in parts]
                tensors[f"{p}{fused}.weight"] = torch.cat(weights)
        tensors[f"{p}input_layernorm.weight"] = norm(hidden)
        tensors[f"{p}post_attention_layernorm.weight"] = norm(hidden)
        if arch in OFFSET_NORMS:  # a norm after the attention and around the MLP too
            tensors[f"{p}pre_feedforward_layernorm.weight"] = norm(hidden)
            tensors[f"{p}post_feedforward_layernorm.weight"] = norm(hidden)
    tensors["model.norm.weight"] = norm(hidden)
    if not config.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = normal(config["vocab_size"], hidden)
    return tensors


# Router weights this many times the others' spread: the random router's top-k choices then win
# by clear margins, so that rounding between two implementations never flips one.
ROUTER_SCALE = 25.0


def _experts(
    config: dict[str, Any], prefix: str, normal: Callable[..., torch.Tensor]
) -> dict[str, torch.Tensor]:
    """One layer's mixture-of-experts tensors under the hub's names: the router, each expert's
    gate/up/down (Mixtral: `block_sparse_moe`, `w1`/`w3`/`w2`), the shared expert and its gate."""
    hidden = config["hidden_size"]
    mixtral = config["architectures"][0] == "MixtralForCausalLM"
    num_experts = config.get("num_local_experts") or config["num_experts"]
    inter = config["intermediate_size"] if mixtral else config["moe_intermediate_size"]
    block = f"{prefix}{'block_sparse_moe' if mixtral else 'mlp'}"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    tensors = {f"{block}.gate.weight": normal(num_experts, hidden) * ROUTER_SCALE}

    def mlp(at: str, size: int) -> None:
        gate, up, down = names
        tensors[f"{at}.{gate}.weight"] = normal(size, hidden)
        tensors[f"{at}.{up}.weight"] = normal(size, hidden)
        tensors[f"{at}.{down}.weight"] = normal(hidden, size)

    for expert in range(num_experts):
        mlp(f"{block}.experts.{expert}", inter)
    if shared := config.get("shared_expert_intermediate_size"):
        mlp(f"{block}.shared_expert", shared)
        tensors[f"{block}.shared_expert_gate.weight"] = normal(1, hidden) * ROUTER_SCALE
    return tensors


def write_model(
    path: str | Path,
    config: dict[str, Any],
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    num_shards: int = 1,
) -> Path:
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    tensors = {k: v.to(dtype).contiguous() for k, v in random_tensors(config, seed).items()}
    if num_shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out
    names = list(tensors)
    weight_map = {}
    for shard in range(num_shards):
        file_name = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[shard::num_shards]}
        save_file(part, str(out / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file_name))
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index), encoding="utf-8")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--architecture", default="LlamaForCausalLM")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = make_config(args.architecture, args.shape, dtype=args.dtype)
    write_model(args.out, config, seed=args.seed, dtype=getattr(torch, args.dtype))
    print(f"wrote {args.architecture} ({args.shape}) to {args.out}")


if __name__ == "__main__":
    main()
