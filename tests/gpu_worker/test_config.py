"""ModelConfig parsing (transformers v4 and v5 layouts), EOS ids and dtype resolution."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tgq.gpu_worker.config import ModelConfig, extra_eos_token_ids, resolve_dtype

LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def llama_base() -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "hidden_act": "silu",
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
    }


def llama31_v4() -> dict[str, Any]:
    return {
        **llama_base(),
        "rope_theta": 500000.0,
        "rope_scaling": {**LLAMA3_SCALING, "rope_type": "llama3"},
        "torch_dtype": "bfloat16",
    }


def llama31_v5() -> dict[str, Any]:
    return {
        **llama_base(),
        "rope_parameters": {**LLAMA3_SCALING, "rope_type": "llama3", "rope_theta": 500000},
        "dtype": "bfloat16",
        "head_dim": None,
    }


def test_llama31_v4_and_v5_configs_parse_to_the_same_config() -> None:
    v4 = ModelConfig.from_dict(llama31_v4())
    assert v4 == ModelConfig.from_dict(llama31_v5())
    assert v4.architecture == "LlamaForCausalLM"
    assert (v4.num_layers, v4.num_heads, v4.num_kv_heads, v4.head_dim) == (32, 32, 8, 128)
    assert v4.rope_theta == 500000.0
    assert v4.rope_scaling == {"rope_type": "llama3", **LLAMA3_SCALING}
    assert v4.dtype == "bfloat16"
    assert v4.eos_token_ids == [128001, 128008, 128009]
    assert v4.bos_token_id == 128000
    assert not (v4.tie_word_embeddings or v4.attention_bias or v4.mlp_bias)
    assert v4.sliding_window is None


def test_defaults_for_a_minimal_config() -> None:
    d = llama_base()
    del d["num_key_value_heads"], d["hidden_act"], d["eos_token_id"]
    config = ModelConfig.from_dict(d)
    assert config.num_kv_heads == 32
    assert config.rope_theta == 10000.0
    assert config.rope_scaling is None
    assert config.dtype is None
    assert config.eos_token_ids == []


def test_explicit_head_dim_wins_and_single_eos_id_becomes_a_list() -> None:
    config = ModelConfig.from_dict({**llama_base(), "head_dim": 64, "eos_token_id": 2})
    assert config.head_dim == 64
    assert config.eos_token_ids == [2]


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_scaling": {"type": "linear", "factor": 2}},
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    ],
)
def test_legacy_type_key_and_v5_params_normalise_alike(rope: dict[str, Any]) -> None:
    config = ModelConfig.from_dict({**llama_base(), **rope})
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.rope_theta == 10000.0


def test_default_rope_type_means_no_scaling() -> None:
    d = {**llama_base(), "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    config = ModelConfig.from_dict(d)
    assert (config.rope_theta, config.rope_scaling) == (1e6, None)


def test_unsupported_rope_type_names_the_supported_ones() -> None:
    d = {**llama_base(), "rope_scaling": {"rope_type": "mrope", "factor": 4.0}}
    supported = "default, llama3, linear, dynamic, yarn, longrope"
    with pytest.raises(ValueError, match=f"'mrope' is not supported; supported: {supported}"):
        ModelConfig.from_dict(d)


def test_yarn_takes_its_original_length_from_the_model_where_unset() -> None:
    d = {
        **llama_base(),
        "rope_scaling": {"rope_type": "yarn", "factor": 4, "mscale": 1, "truncate": False},
    }
    config = ModelConfig.from_dict(d)
    assert config.rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "mscale": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 131072,
    }
    assert config.rotary_dim == config.head_dim == 128
    assert config.prefix_cache_salt(140000, 140100) == b""  # a static rope: nothing to keep apart


def phi3(**overrides: Any) -> dict[str, Any]:
    return {
        **llama_base(),
        "architectures": ["Phi3ForCausalLM"],
        "hidden_size": 3072,
        "num_attention_heads": 24,  # head_dim 128
        "original_max_position_embeddings": 4096,
        "max_position_embeddings": 131072,
        **overrides,
    }


@pytest.mark.parametrize("legacy_type", ["su", "yarn", "longrope"])
def test_phi3_legacy_rope_types_mean_longrope(legacy_type: str) -> None:
    factors = {"short_factor": [1] * 48, "long_factor": [2] * 48}
    d = phi3(rope_scaling={"type": legacy_type, **factors}, partial_rotary_factor=0.75)
    config = ModelConfig.from_dict(d)
    assert config.rotary_dim == 96  # Phi-4-mini's 3/4 of a 128-wide head
    assert config.rope_scaling == {
        "rope_type": "longrope",
        "short_factor": [1.0] * 48,
        "long_factor": [2.0] * 48,
        "original_max_position_embeddings": 4096,
    }
    assert config.rope_restart_length == 4097
    # The prompt's tokens rotate by the sequence's length, generated ones by their own.
    assert config.rope_length(100, 5000, 7) == 5000
    assert config.prefix_cache_salt(100, 4096) == b""
    assert config.prefix_cache_salt(100, 4097) == b"rope:long"


def test_longrope_factors_must_cover_half_the_rotary_dimensions() -> None:
    d = phi3(rope_scaling={"type": "longrope", "short_factor": [1] * 64, "long_factor": [1] * 63})
    with pytest.raises(ValueError, match=r"needs 64 values in 'long_factor'.* got 63"):
        ModelConfig.from_dict(d)


def test_dynamic_rope_rotates_a_prompt_by_its_length() -> None:
    d = {
        **llama_base(),
        "max_position_embeddings": 8192,
        "rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
    }
    config = ModelConfig.from_dict(d)
    assert config.rope_restart_length is None
    assert config.rope_length(9000, 9005, 10) == 9000
    assert config.rope_length(9000, 9005, 9004) == 9005
    assert config.prefix_cache_salt(8192, 9000) == b""
    assert config.prefix_cache_salt(8193, 9000) == b"rope:8193"


@pytest.mark.parametrize("factor", [0.001, 1.5, 0.3046875])
def test_partial_rotary_must_leave_an_even_number_of_dimensions(factor: float) -> None:
    with pytest.raises(ValueError, match="must be an even number in"):
        ModelConfig.from_dict({**llama_base(), "partial_rotary_factor": factor})


def test_llama3_rope_without_its_factors_is_rejected() -> None:
    d = {**llama_base(), "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    with pytest.raises(ValueError, match="needs 'low_freq_factor'"):
        ModelConfig.from_dict(d)


def test_an_activation_tgq_does_not_implement_is_rejected() -> None:
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        ModelConfig.from_dict({**llama_base(), "hidden_act": "gelu"})


def test_missing_required_key_is_named() -> None:
    d = llama_base()
    del d["hidden_size"]
    with pytest.raises(ValueError, match=r"config\.json is missing 'hidden_size'"):
        ModelConfig.from_dict(d)


def test_qwen2_sliding_window_is_off_unless_enabled() -> None:
    qwen2 = {**llama_base(), "use_sliding_window": False, "sliding_window": 131072}
    assert ModelConfig.from_dict(qwen2).sliding_window is None
    qwen2["use_sliding_window"] = True
    assert ModelConfig.from_dict(qwen2).sliding_window == 131072


def test_layer_types_say_which_layers_slide() -> None:
    base = {**llama_base(), "num_hidden_layers": 4, "sliding_window": 16}
    full, sliding = "full_attention", "sliding_attention"
    assert ModelConfig.from_dict(base).layer_types == (sliding,) * 4  # Mistral: every layer
    qwen = {**base, "use_sliding_window": True, "max_window_layers": 3}
    assert ModelConfig.from_dict(qwen).layer_types == (full, full, full, sliding)
    off = {**qwen, "use_sliding_window": False}
    assert ModelConfig.from_dict(off).layer_types == (full,) * 4
    explicit = {**base, "layer_types": [sliding, full, sliding, full]}
    assert ModelConfig.from_dict(explicit).layer_types == (sliding, full, sliding, full)
    with pytest.raises(ValueError, match="layer_types must list 4 of"):
        ModelConfig.from_dict({**base, "layer_types": [full]})


def test_mistral_sliding_window() -> None:
    mistral = {**llama_base(), "sliding_window": 4096}
    assert ModelConfig.from_dict(mistral).sliding_window == 4096
    assert ModelConfig.from_dict({**mistral, "sliding_window": None}).sliding_window is None


def test_biases_and_tied_embeddings_are_parsed() -> None:
    d = {**llama_base(), "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}
    config = ModelConfig.from_dict(d)
    assert config.attention_bias and config.mlp_bias and config.tie_word_embeddings


def test_from_dir_and_generation_config_eos_ids(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(llama31_v4()))
    assert ModelConfig.from_dir(tmp_path) == ModelConfig.from_dict(llama31_v4())
    assert extra_eos_token_ids(tmp_path) == []
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106]}))
    assert extra_eos_token_ids(tmp_path) == [1, 106]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert extra_eos_token_ids(tmp_path) == [7]


@pytest.mark.parametrize(
    ("requested", "config_dtype", "device_type", "expected"),
    [
        (None, None, "cuda", "float32"),
        ("auto", None, "cuda", "float32"),
        (None, "bfloat16", "cuda", "bfloat16"),
        ("auto", "float16", "cuda", "float16"),
        ("auto", "float16", "cpu", "bfloat16"),
        ("float16", "bfloat16", "cpu", "bfloat16"),
        ("float32", "bfloat16", "cuda", "float32"),
        ("float16", None, "cuda", "float16"),
        ("bfloat16", "float32", "cpu", "bfloat16"),
    ],
)
def test_resolve_dtype(
    requested: str | None, config_dtype: str | None, device_type: str, expected: str
) -> None:
    assert resolve_dtype(requested, config_dtype, device_type) == expected


@pytest.mark.parametrize(("requested", "config_dtype"), [("fp8", None), (None, "int8")])
def test_resolve_dtype_rejects_unknown_names(requested: str | None, config_dtype: str) -> None:
    with pytest.raises(ValueError, match="allowed: auto, float32, bfloat16, float16"):
        resolve_dtype(requested, config_dtype, "cuda")


def test_gemma2_config_fields_and_defaults() -> None:
    """Gemma 2's `hidden_activation`, score scalar and soft caps; its configs leave out tied
    embeddings and `layer_types`, which default to tied and every other layer sliding."""
    d = {
        **llama_base(),
        "architectures": ["Gemma2ForCausalLM"],
        "num_hidden_layers": 4,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 224,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30,
        "sliding_window": 4096,
    }
    del d["hidden_act"]
    config = ModelConfig.from_dict(d)
    assert config.hidden_act == "gelu_pytorch_tanh"
    assert (config.query_pre_attn_scalar, config.attn_logit_softcapping) == (224.0, 50.0)
    assert config.final_logit_softcapping == 30.0
    assert config.tie_word_embeddings
    sliding, full = "sliding_attention", "full_attention"
    assert config.layer_types == (sliding, full, sliding, full)
    llama = ModelConfig.from_dict(llama_base())
    assert llama.query_pre_attn_scalar is None and llama.final_logit_softcapping is None


def gemma3(**overrides: Any) -> dict[str, Any]:
    d = {**llama_base(), "architectures": ["Gemma3ForCausalLM"], "sliding_window": 512}
    d.pop("rope_theta", None)
    return {**d, "num_hidden_layers": 12, **overrides}


def test_gemma3_v4_and_v5_rope_per_layer_type_normalise_alike() -> None:
    """v4: `rope_theta` + `rope_scaling` for the global layers, `rope_local_base_freq` for the
    sliding ones; v5: `rope_parameters` keyed by layer type. Five sliding layers to one global."""
    v4 = gemma3(rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_local_base_freq=10000)
    v5 = gemma3(
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        }
    )
    a, b = ModelConfig.from_dict(v4), ModelConfig.from_dict(v5)
    assert a == b
    assert (a.rope_theta, a.rope_scaling, a.local_rope_theta) == (
        1e6,
        {"rope_type": "linear", "factor": 8.0},
        10000.0,
    )
    sliding, full = "sliding_attention", "full_attention"
    assert a.layer_types == ((sliding,) * 5 + (full,)) * 2
    assert a.tie_word_embeddings


def test_scaled_rope_on_the_sliding_layers_is_refused() -> None:
    d = gemma3(
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
        }
    )
    with pytest.raises(ValueError, match="rope type 'linear' on the sliding-window layers"):
        ModelConfig.from_dict(d)


def test_moe_fields_per_family() -> None:
    """Mixtral: every layer sparse, experts of `intermediate_size`, top-k always renormalised;
    Qwen-MoE: `moe_intermediate_size`, sparse every `decoder_sparse_step` layers but
    `mlp_only_layers`, `norm_topk_prob` as given, a shared expert where sized."""
    mixtral = ModelConfig.from_dict(
        {
            **llama_base(),
            "architectures": ["MixtralForCausalLM"],
            "num_hidden_layers": 2,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
        }
    )
    assert (mixtral.num_experts, mixtral.num_experts_per_tok) == (8, 2)
    assert mixtral.moe_intermediate_size == 14336 and mixtral.norm_topk_prob
    assert mixtral.moe_layers == (True, True) and mixtral.shared_expert_intermediate_size is None
    qwen = ModelConfig.from_dict(
        {
            **llama_base(),
            "architectures": ["Qwen2MoeForCausalLM"],
            "num_hidden_layers": 6,
            "num_experts": 60,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 1408,
            "shared_expert_intermediate_size": 5632,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [3],
        }
    )
    assert qwen.moe_layers == (False, True, False, False, False, True)
    assert (qwen.moe_intermediate_size, qwen.shared_expert_intermediate_size) == (1408, 5632)
    assert not qwen.norm_topk_prob
    dense = ModelConfig.from_dict(llama_base())
    assert dense.num_experts == 0 and not any(dense.moe_layers)


def test_moe_top_k_beyond_the_experts_is_refused() -> None:
    d = {**llama_base(), "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4}
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in \[1, 4\].*got 5"):
        ModelConfig.from_dict({**d, "num_experts_per_tok": 5})
