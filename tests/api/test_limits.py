"""The token limits' defaults from the model (`api/limits.py`): its context length, capped by the
KV cache the options size, one less for the input; explicit values win."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tgq.api.settings import Settings

# A tiny Llama: K and V of 2 layers x 2 KV heads x 16 dims = 128 values per token.
SHAPE = {
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "hidden_size": 64, "dtype": "float32",
}  # fmt: skip
BYTES_PER_TOKEN = 128 * 4


def model(tmp_path: Path, **config: object) -> str:
    (tmp_path / "config.json").write_text(json.dumps({**SHAPE, **config}))
    return str(tmp_path)


def limits(settings: Settings) -> tuple[int, int]:
    return settings.max_input_tokens, settings.max_total_tokens


def test_the_context_length_is_the_default(tmp_path: Path) -> None:
    assert limits(Settings(model_dir=model(tmp_path, max_position_embeddings=4096))) == (
        4095, 4096,
    )  # fmt: skip
    nested = {"text_config": {"n_positions": 2048}}
    assert limits(Settings(model_dir=model(tmp_path, **nested))) == (2047, 2048)
    assert limits(Settings(model_dir=str(tmp_path / "absent"))) == (4095, 4096)  # TGI's


def test_the_kv_cache_caps_it(tmp_path: Path) -> None:
    path = model(tmp_path, max_position_embeddings=4096)
    by_blocks = Settings(model_dir=path, num_blocks=101, block_size=16)
    assert limits(by_blocks) == (1599, 1600)  # block 0 is reserved
    memory = BYTES_PER_TOKEN * 16 * 65  # 65 blocks of the torch backend's 16 tokens
    by_memory = Settings(model_dir=path, kv_cache_memory=memory, disable_custom_kernels=True)
    assert limits(by_memory) == (1023, 1024)
    in_bf16 = Settings(model_dir=path, kv_cache_memory=memory, dtype="bfloat16")
    assert limits(in_bf16) == (2063, 2064)  # 130 blocks of half the bytes: 129 usable


def test_max_batch_total_tokens_caps_it(tmp_path: Path) -> None:
    """The scheduler never runs a request above its pool: the limits stay within it."""
    path = model(tmp_path, max_position_embeddings=4096)
    assert limits(Settings(model_dir=path, max_batch_total_tokens=3000)) == (2999, 3000)
    both = Settings(model_dir=path, num_blocks=101, block_size=16, max_batch_total_tokens=2000)
    assert limits(both) == (1599, 1600)  # the smaller of the two


def test_explicit_values_win(tmp_path: Path) -> None:
    path = model(tmp_path, max_position_embeddings=4096)
    assert limits(Settings(model_dir=path, max_total_tokens=100)) == (99, 100)
    assert limits(Settings(model_dir=path, max_input_tokens=10)) == (10, 4096)
    with pytest.raises(ValueError, match="`max_input_tokens` must be < `max_total_tokens`"):
        Settings(model_dir=path, max_input_tokens=4096)


def test_the_embedded_cache_cuts_only_the_defaults(tmp_path: Path) -> None:
    path = model(tmp_path, max_position_embeddings=4096)
    assert limits(Settings(model_dir=path).capped_by_kv(3000)) == (2999, 3000)
    assert limits(Settings(model_dir=path).capped_by_kv(9000)) == (4095, 4096)
    assert limits(Settings(model_dir=path, max_total_tokens=3500).capped_by_kv(3000)) == (
        3499, 3500,
    )  # fmt: skip
