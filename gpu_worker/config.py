"""The model's shape and numerics, parsed from a Hugging Face `config.json` (torch-free).

Accepts both transformers v4 configs (top-level `rope_theta` + `rope_scaling`, `torch_dtype`) and
v5 configs (`rope_parameters`, `dtype`) and normalises them to one `ModelConfig`. Dtypes stay
strings here; the worker turns them into torch dtypes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_ROPE_THETA = 10000.0
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "dynamic", "yarn", "longrope")
# Rope types whose rotation of a token depends on its sequence's length, not only its position
# (`ModelConfig.rope_length`).
LENGTH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")
# Keys each scaled rope type must carry, and the type each is normalised to.
_ROPE_KEYS: dict[str, dict[str, type]] = {
    "llama3": {
        "factor": float,
        "low_freq_factor": float,
        "high_freq_factor": float,
        "original_max_position_embeddings": int,
    },
    "linear": {"factor": float},
    "dynamic": {"factor": float},
    "yarn": {"factor": float, "original_max_position_embeddings": int},
    "longrope": {
        "short_factor": list,
        "long_factor": list,
        "original_max_position_embeddings": int,
    },
}
# Optional keys, cast where present.
_ROPE_OPTIONAL_KEYS: dict[str, dict[str, type]] = {
    "yarn": {
        "attention_factor": float,
        "mscale": float,
        "mscale_all_dim": float,
        "beta_fast": float,
        "beta_slow": float,
        "truncate": bool,
    },
    "longrope": {"factor": float, "attention_factor": float},
}
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
# Families whose configs leave `tie_word_embeddings` out because theirs are tied.
# Gemma 3 text alone, and the text part of the multimodal checkpoints (4B and up).
GEMMA3 = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
TIED_BY_DEFAULT = ("Gemma2ForCausalLM", *GEMMA3)


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer's hyperparameters. `rope_scaling` is None for plain RoPE."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    rotary_dim: int  # the leading dimensions of each head that rotate (Phi's partial rotary)
    # Gemma 3: the sliding-window layers' own rope base (plain rope; `rope_theta` and
    # `rope_scaling` are the full-attention layers'); None: one rope for every layer.
    local_rope_theta: float | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    layer_types: tuple[str, ...]  # per layer: "full_attention" or "sliding_attention"
    hidden_act: str
    # Gemma: attention scores scaled by query_pre_attn_scalar ** -0.5 (else head_dim ** -0.5);
    # attention scores and final logits soft-capped (cap * tanh(x / cap)) where set.
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): `num_experts` 0 for a dense model;
    # `moe_layers` says per layer whether its MLP is the sparse block.
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int | None
    norm_topk_prob: bool
    moe_layers: tuple[bool, ...]
    query_pre_attn_scalar: float | None
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    dtype: str | None
    eos_token_ids: list[int]
    bos_token_id: int | None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(_read_json(Path(path) / "config.json"))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = text_config(d)
        num_heads = int(_require(d, "num_attention_heads"))
        hidden_size = int(_require(d, "hidden_size"))
        rope_theta, rope_scaling = _parse_rope(_global_rope_view(d))
        head_dim = int(d.get("head_dim") or hidden_size // num_heads)
        return cls(
            architecture=str(_require(d, "architectures")[0]),
            vocab_size=int(_require(d, "vocab_size")),
            hidden_size=hidden_size,
            intermediate_size=int(_require(d, "intermediate_size")),
            num_layers=int(_require(d, "num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rotary_dim=_parse_rotary_dim(d, head_dim),
            local_rope_theta=_parse_local_rope_theta(d),
            max_position_embeddings=int(_require(d, "max_position_embeddings")),
            tie_word_embeddings=bool(
                d.get("tie_word_embeddings", _architecture(d) in TIED_BY_DEFAULT)
            ),
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            sliding_window=_parse_sliding_window(d),
            layer_types=_parse_layer_types(d),
            hidden_act=_parse_hidden_act(d),
            **_parse_moe(d),
            query_pre_attn_scalar=_optional_float(d, "query_pre_attn_scalar"),
            attn_logit_softcapping=_optional_float(d, "attn_logit_softcapping"),
            final_logit_softcapping=_optional_float(d, "final_logit_softcapping"),
            dtype=d.get("dtype") or d.get("torch_dtype"),
            eos_token_ids=_as_id_list(d.get("eos_token_id")),
            bos_token_id=d.get("bos_token_id"),
        )

    def rope_length(self, num_prompt_tokens: int, num_tokens: int, position: int) -> int:
        """The sequence length that sets the rotation of the token at `position`, for the rope
        types that depend on it, in a sequence of `num_tokens` tokens so far (the one at
        `position` included) whose prompt has `num_prompt_tokens`. As the reference
        implementation computes them:
        - `dynamic` picks its base once per forward from the longest position in it: a prompt's
          tokens rotate for the prompt's length, each generated token for its own (`position +
          1`), and cached keys keep theirs;
        - `longrope` uses the long factors for every token of a sequence past the original
          length: a prompt past it is computed long, and a sequence that grows past it is
          computed again, every token long (`rope_restart_length`)."""
        if self.rope_scaling is not None and self.rope_scaling["rope_type"] == "longrope":
            return num_tokens
        return max(num_prompt_tokens, position + 1)

    @property
    def rope_restart_length(self) -> int | None:
        """`longrope`: a sequence whose KV was computed with the short factors is computed again
        from its first token when it reaches this many tokens (the reference drops its cache
        there); None for the other types."""
        if self.rope_scaling is not None and self.rope_scaling["rope_type"] == "longrope":
            return self.original_max_position_embeddings + 1
        return None

    def prefix_cache_salt(self, num_prompt_tokens: int, num_tokens: int) -> bytes:
        """Bytes the prefix cache's keys start from for a sequence of `num_tokens` tokens (with
        `num_prompt_tokens` of prompt): empty unless the rope type rotates a token by its
        sequence's length (`rope_length`) past the original context, where two sequences with
        one prefix store different keys for it: `longrope` the long factors, `dynamic` a base
        per prompt length."""
        scaling = self.rope_scaling
        original = self.original_max_position_embeddings
        if scaling is None or scaling["rope_type"] not in LENGTH_DEPENDENT_ROPE_TYPES:
            return b""
        if scaling["rope_type"] == "longrope":
            return b"rope:long" if num_tokens > original else b""
        return f"rope:{num_prompt_tokens}".encode() if num_prompt_tokens > original else b""

    @property
    def original_max_position_embeddings(self) -> int:
        """The context length the rope scaling extends (the model's own without scaling)."""
        scaling = self.rope_scaling or {}
        return int(scaling.get("original_max_position_embeddings", self.max_position_embeddings))


# Gemma3TextConfig's defaults, which the `text_config` of a multimodal Gemma 3 checkpoint relies
# on: gemma-3-4b-it's sets only a few fields (hidden and intermediate size, layers, window,
# rope scaling). The rope bases and the window pattern have their own defaults above.
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}
# What a multimodal config keeps at its top level that describes the text model too.
_TOP_LEVEL_TEXT_KEYS = (
    "eos_token_id",
    "bos_token_id",
    "dtype",
    "torch_dtype",
    "tie_word_embeddings",
)


def text_config(d: dict[str, Any]) -> dict[str, Any]:
    """The config of the text model a checkpoint holds: `d` itself, or for a multimodal Gemma 3
    (`Gemma3ForConditionalGeneration`, whose text tgq serves; the vision tower is not loaded)
    its `text_config` over Gemma3TextConfig's defaults, with the top level's token ids, dtype
    and tying where the text config lacks them, under the multimodal architecture's name.
    Torch-free (the api reads it)."""
    if _architecture(d) != "Gemma3ForConditionalGeneration":
        return d
    text = {**GEMMA3_TEXT_DEFAULTS, **(d.get("text_config") or {})}
    for key in _TOP_LEVEL_TEXT_KEYS:
        if text.get(key) is None and d.get(key) is not None:
            text[key] = d[key]
    return {**text, "architectures": ["Gemma3ForConditionalGeneration"]}


def _read_json(path: Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def _require(d: dict[str, Any], key: str) -> Any:
    if d.get(key) in (None, []):
        raise ValueError(f"config.json is missing {key!r}")
    return d[key]


def _parse_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """v5 `rope_parameters` wins; otherwise v4's top-level `rope_theta` and `rope_scaling`.
    `original_max_position_embeddings` may sit at the top level (Phi-3), where it wins; Phi-3's
    legacy types `su` and `yarn` both mean longrope."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", None) or d.get("rope_theta") or DEFAULT_ROPE_THETA)
    params.pop("partial_rotary_factor", None)  # `rotary_dim`
    legacy_type = params.pop("type", None)
    rope_type = params.pop("rope_type", None) or legacy_type or "default"
    if rope_type == "su" or (rope_type == "yarn" and _architecture(d) == "Phi3ForCausalLM"):
        rope_type = "longrope"
    if rope_type in ("yarn", "longrope"):
        params["original_max_position_embeddings"] = (
            d.get("original_max_position_embeddings")
            or params.get("original_max_position_embeddings")
            or d.get("max_position_embeddings")
        )
    if rope_type not in SUPPORTED_ROPE_TYPES:
        supported = ", ".join(SUPPORTED_ROPE_TYPES)
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {supported}")
    if rope_type == "default":
        return theta, None
    for key, cast in _ROPE_KEYS[rope_type].items():
        if params.get(key) is None:
            raise ValueError(f"rope type {rope_type!r} needs {key!r} in the rope parameters")
        params[key] = cast(params[key])
    for key, cast in _ROPE_OPTIONAL_KEYS.get(rope_type, {}).items():
        if params.get(key) is not None:
            params[key] = cast(params[key])
    if rope_type == "longrope":
        _check_longrope_factors(params, d)
    return theta, {"rope_type": rope_type, **params}


# Gemma 3's defaults where its config leaves them out: the global and the local rope base.
GEMMA3_ROPE_THETA = 1_000_000.0
GEMMA3_LOCAL_ROPE_THETA = 10_000.0
GEMMA3_SLIDING_WINDOW_PATTERN = 6  # every sixth layer attends fully


def _rope_per_layer_type(d: dict[str, Any]) -> dict[str, Any] | None:
    """v5's `rope_parameters` keyed by layer type (Gemma 3), or None."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and set(params) & set(LAYER_TYPES):
        return params
    return None


def _global_rope_view(d: dict[str, Any]) -> dict[str, Any]:
    """`d` as `_parse_rope` reads it: with per-layer-type rope parameters, the full-attention
    layers' (the sliding layers' own base is `local_rope_theta`)."""
    per_type = _rope_per_layer_type(d)
    if per_type is not None:
        return {**d, "rope_parameters": dict(per_type.get("full_attention") or {})}
    if _architecture(d) in GEMMA3 and d.get("rope_theta") is None:
        return {**d, "rope_theta": GEMMA3_ROPE_THETA}
    return d


def _parse_local_rope_theta(d: dict[str, Any]) -> float | None:
    """The sliding layers' rope base: v5's `rope_parameters["sliding_attention"]`, v4's
    `rope_local_base_freq` (Gemma 3); None elsewhere. Only plain rope is supported there."""
    per_type = _rope_per_layer_type(d)
    if per_type is not None:
        local = dict(per_type.get("sliding_attention") or {})
        rope_type = local.get("rope_type") or local.get("type") or "default"
        if rope_type != "default":
            raise ValueError(
                f"rope type {rope_type!r} on the sliding-window layers is not supported; they"
                " take plain rope"
            )
        return float(local.get("rope_theta") or GEMMA3_LOCAL_ROPE_THETA)
    if _architecture(d) in GEMMA3:
        return float(d.get("rope_local_base_freq") or GEMMA3_LOCAL_ROPE_THETA)
    return None


def _architecture(d: dict[str, Any]) -> str | None:
    architectures = d.get("architectures") or [None]
    return architectures[0]


def _parse_rotary_dim(d: dict[str, Any], head_dim: int) -> int:
    """`partial_rotary_factor` (top level, or v5's rope parameters) of each head rotates."""
    params = d.get("rope_parameters") or {}
    factor = float(params.get("partial_rotary_factor") or d.get("partial_rotary_factor") or 1.0)
    rotary_dim = int(head_dim * factor)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(
            f"partial_rotary_factor {factor} gives {rotary_dim} rotary dimensions of the"
            f" {head_dim} in a head; it must be an even number in [2, {head_dim}]"
        )
    return rotary_dim


def _check_longrope_factors(params: dict[str, Any], d: dict[str, Any]) -> None:
    num_heads = int(_require(d, "num_attention_heads"))
    head_dim = int(d.get("head_dim") or int(_require(d, "hidden_size")) // num_heads)
    expected = _parse_rotary_dim(d, head_dim) // 2
    for key in ("short_factor", "long_factor"):
        params[key] = [float(value) for value in params[key]]
        if len(params[key]) != expected:
            raise ValueError(
                f"rope type 'longrope' needs {expected} values in {key!r} (half the rotary"
                f" dimensions), got {len(params[key])}"
            )


def _parse_sliding_window(d: dict[str, Any]) -> int | None:
    """Mistral sets `sliding_window` alone; Qwen2/Qwen3 also set it but gate it on a flag."""
    if not d.get("use_sliding_window", True):
        return None
    window = d.get("sliding_window")
    return None if window is None else int(window)


LAYER_TYPES = ("full_attention", "sliding_attention")


def _parse_layer_types(d: dict[str, Any]) -> tuple[str, ...]:
    """Which layers use the sliding window: `layer_types` when given; else, with a window, every
    other layer from the first (Gemma 2), all but every `sliding_window_pattern`-th (Gemma 3), the
    layers from `max_window_layers` on (Qwen2/Qwen3),
    or every layer (Mistral)."""
    num_layers = int(_require(d, "num_hidden_layers"))
    explicit = d.get("layer_types")
    if explicit is not None:
        if len(explicit) != num_layers or any(t not in LAYER_TYPES for t in explicit):
            raise ValueError(
                f"layer_types must list {num_layers} of {', '.join(LAYER_TYPES)}, got {explicit}"
            )
        return tuple(explicit)
    if _parse_sliding_window(d) is None:
        return ("full_attention",) * num_layers
    if _architecture(d) == "Gemma2ForCausalLM":
        return tuple(LAYER_TYPES[i % 2 == 0] for i in range(num_layers))
    if _architecture(d) in GEMMA3:
        pattern = int(d.get("sliding_window_pattern") or GEMMA3_SLIDING_WINDOW_PATTERN)
        return tuple(LAYER_TYPES[(i + 1) % pattern != 0] for i in range(num_layers))
    first_sliding = int(d.get("max_window_layers") or 0)
    return tuple(LAYER_TYPES[i >= first_sliding] for i in range(num_layers))


# The MLP activations tgq implements (gpu_worker/layers/activation.py): SwiGLU's and GeGLU's.
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def _parse_hidden_act(d: dict[str, Any]) -> str:
    """`hidden_activation` (Gemma) wins over `hidden_act`."""
    act = str(d.get("hidden_activation") or d.get("hidden_act") or "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(
            f"hidden_act {act!r} is not supported; tgq models implement "
            + ", ".join(repr(a) for a in SUPPORTED_ACTIVATIONS)
        )
    return act


def _parse_moe(d: dict[str, Any]) -> dict[str, Any]:
    """Mixtral: `num_local_experts` experts of `intermediate_size`, top-k weights renormalised,
    every layer sparse. Qwen2/3-MoE: `num_experts` of `moe_intermediate_size`, renormalised with
    `norm_topk_prob`, sparse every `decoder_sparse_step` layers but `mlp_only_layers`, a shared
    expert (Qwen2-MoE) of `shared_expert_intermediate_size`."""
    num_layers = int(_require(d, "num_hidden_layers"))
    num_experts = int(d.get("num_local_experts") or d.get("num_experts") or 0)
    per_token = int(d.get("num_experts_per_tok") or 0)
    if num_experts and not 0 < per_token <= num_experts:
        raise ValueError(
            f"num_experts_per_tok must be in [1, {num_experts}] (the experts), got {per_token}"
        )
    is_mixtral = _architecture(d) == "MixtralForCausalLM"
    step = int(d.get("decoder_sparse_step") or 1)
    dense = set(d.get("mlp_only_layers") or ())
    shared = d.get("shared_expert_intermediate_size")
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": per_token,
        "moe_intermediate_size": int(
            d.get("moe_intermediate_size") or _require(d, "intermediate_size")
        ),
        "shared_expert_intermediate_size": None if shared is None else int(shared),
        "norm_topk_prob": is_mixtral or bool(d.get("norm_topk_prob", False)),
        "moe_layers": tuple(
            num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers)
        ),
    }


def _optional_float(d: dict[str, Any], key: str) -> float | None:
    value = d.get(key)
    return None if value is None else float(value)


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def load_generation_config(model_dir: str | Path) -> dict[str, Any]:
    """`generation_config.json` as a dict, or `{}` when the model has none."""
    path = Path(model_dir) / "generation_config.json"
    return _read_json(path) if path.is_file() else {}


def extra_eos_token_ids(model_dir: str | Path) -> list[int]:
    """The EOS ids from `generation_config.json` (chat models often list more than config.json)."""
    return _as_id_list(load_generation_config(model_dir).get("eos_token_id"))


def model_eos_token_ids(model_dir: str | Path) -> frozenset[int]:
    """Every id that ends a generation: config.json's EOS plus generation_config.json's. Torch-free,
    so the batcher reads it for its stopping rules."""
    config_ids = _as_id_list(_read_json(Path(model_dir) / "config.json").get("eos_token_id"))
    return frozenset(config_ids) | frozenset(extra_eos_token_ids(model_dir))


def resolve_dtype(requested: str | None, config_dtype: str | None, device_type: str) -> str:
    """Pick the weight dtype: the request, else ("auto"/None) the config's, else float32.

    CPU kernels are poor at float16, so a float16 result on CPU becomes bfloat16.
    """
    name = config_dtype if requested in (None, "auto") else requested
    if name is None:
        return "float32"
    if name not in SUPPORTED_DTYPES:
        allowed = ", ".join(("auto", *SUPPORTED_DTYPES))
        raise ValueError(f"dtype {name!r} is not supported; allowed: {allowed}")
    if device_type == "cpu" and name == "float16":
        return "bfloat16"
    return name
