"""Token limits from the model (torch-free): what `max_input_tokens` / `max_total_tokens` default
to when they are not given.

The rule, as TGI's launcher: `max_total_tokens` is the model's context length (config.json's
`max_position_embeddings`, or the first of the other names families use), capped by the KV
cache's capacity where the options fix it (`num_blocks` x `block_size`, or `kv_cache_memory`
over the KV bytes one token takes); `max_input_tokens` is one less. A model whose config cannot
be read (a hub id not downloaded yet) gets TGI's fallback, 4096. Explicit values always win.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from huggingface_hub import try_to_load_from_cache

from tgq.batcher.options import BatcherOptions
from tgq.gpu_worker.config import resolve_dtype

FALLBACK_CONTEXT = 4096
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def read_model_config(model_path: str, revision: str | None = None) -> dict[str, Any] | None:
    """config.json of a local directory or of a hub snapshot already in the cache; else None."""
    local = Path(model_path).expanduser() / "config.json"
    if local.is_file():
        found: str | Path = local
    else:
        try:
            cached = try_to_load_from_cache(model_path, "config.json", revision=revision)
        except ValueError:  # not a hub id either (HFValidationError): a missing directory
            return None
        if not isinstance(cached, str):
            return None
        found = cached
    try:
        config: dict[str, Any] = json.loads(Path(found).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config.get("text_config") or config


def context_length(config: dict[str, Any] | None) -> int:
    for key in CONTEXT_KEYS:
        if config is not None and isinstance(config.get(key), int):
            return int(config[key])
    return FALLBACK_CONTEXT


def kv_capacity(config: dict[str, Any] | None, kv: BatcherOptions) -> int | None:
    """Tokens the KV cache holds, where the options fix it; else None."""
    if kv.num_blocks is not None and kv.block_size is not None:
        return kv.num_blocks * kv.block_size
    if kv.kv_cache_memory is None or config is None:
        return None
    num_heads = int(config.get("num_attention_heads", 0))
    num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
    head_dim = int(config.get("head_dim") or config.get("hidden_size", 0) // max(num_heads, 1))
    config_dtype = config.get("dtype") or config.get("torch_dtype")
    dtype = resolve_dtype(kv.dtype, config_dtype, kv.device.split(":")[0])
    # K and V of every layer; tensor parallelism splits the KV heads over the ranks.
    per_token = 2 * int(config.get("num_hidden_layers", 0)) * num_kv_heads * head_dim
    per_token_per_rank = per_token * DTYPE_BYTES[dtype] // kv.num_shard
    return int(kv.kv_cache_memory) // per_token_per_rank if per_token_per_rank > 0 else None


def default_total_tokens(options: BatcherOptions) -> int:
    config = read_model_config(options.model_path, options.revision)
    context, capacity = context_length(config), kv_capacity(config, options)
    return context if capacity is None else min(context, capacity)


def served_dtype(options: BatcherOptions) -> str:
    """The weights' dtype the batcher serves with these options (as the loader picks it)."""
    config = read_model_config(options.model_path, options.revision) or {}
    config_dtype = config.get("dtype") or config.get("torch_dtype")
    return resolve_dtype(options.dtype, config_dtype, options.device.split(":")[0])
