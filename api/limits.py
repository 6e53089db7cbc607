"""Facts the api takes from the model's config.json (torch-free): the token limits'
defaults, and the dtype the batcher serves.

The limits' rule, as TGI's launcher: `max_total_tokens` is the model's context length
(`max_position_embeddings`, or the first of the other names families use), capped by the KV
cache's capacity where the options fix it (`num_blocks`, or the blocks `kv_cache_memory` holds,
less the reserved block 0, times the block size) and by `max_batch_total_tokens` (TGI's launcher
refuses a `max_total_tokens` above it); `max_input_tokens` is one less. A model whose
config cannot be read (a hub id not downloaded yet) gets TGI's fallback, 4096. Explicit values
always win.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from huggingface_hub import try_to_load_from_cache

from tgq.batcher.options import BatcherOptions
from tgq.gpu_worker.config import resolve_dtype, text_config
from tgq.kernels import resolve_block_size

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
    view = text_config(config)  # a multimodal Gemma 3's text model, with its defaults
    text: dict[str, Any] = view.get("text_config") or view
    return text


def context_length(config: dict[str, Any] | None) -> int:
    for key in CONTEXT_KEYS:
        if config is not None and isinstance(config.get(key), int):
            return int(config[key])
    return FALLBACK_CONTEXT


def kv_capacity(config: dict[str, Any] | None, options: BatcherOptions) -> int | None:
    """Tokens the KV cache holds where the options fix its size, as the runner sizes it:
    (blocks - 1) x block size, block 0 being reserved; at most `max_batch_total_tokens`, the
    scheduler's pool (a request above it is never scheduled); else None."""
    backend = "torch" if options.disable_custom_kernels else "auto"
    block_size = resolve_block_size(backend, options.device, options.block_size)
    num_blocks = options.num_blocks
    per_token = 0 if config is None else kv_bytes_per_token(config, options)
    if num_blocks is None and options.kv_cache_memory is not None and per_token:
        num_blocks = int(options.kv_cache_memory) // (block_size * per_token)
    capacity = None if num_blocks is None else max(num_blocks - 1, 0) * block_size
    caps = [cap for cap in (capacity, options.max_batch_total_tokens) if cap is not None]
    return min(caps) if caps else None


def kv_bytes_per_token(config: dict[str, Any], options: BatcherOptions) -> int:
    """K and V of every layer, on one rank (tensor parallelism splits the KV heads). A config
    without the shape is not one the runner loads: the KV options then say nothing here."""
    if not all(key in config for key in ("num_attention_heads", "num_hidden_layers")):
        return 0
    num_heads = int(config["num_attention_heads"])
    num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // num_heads)
    local_kv_heads = max(num_kv_heads // options.num_shard, 1)
    per_token = 2 * int(config["num_hidden_layers"]) * local_kv_heads * head_dim
    return per_token * DTYPE_BYTES[served_dtype_of(config, options)]


def default_total_tokens(options: BatcherOptions) -> int:
    config = read_model_config(options.model_path, options.revision)
    context, capacity = context_length(config), kv_capacity(config, options)
    return context if capacity is None else min(context, capacity)


def served_dtype(options: BatcherOptions) -> str:
    """The weights' dtype the batcher serves with these options (as the loader picks it)."""
    return served_dtype_of(read_model_config(options.model_path, options.revision), options)


def served_dtype_of(config: dict[str, Any] | None, options: BatcherOptions) -> str:
    config_dtype = None if config is None else config.get("dtype") or config.get("torch_dtype")
    return resolve_dtype(options.dtype, config_dtype, options.device.split(":")[0])
