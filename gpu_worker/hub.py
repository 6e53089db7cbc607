"""Find a model's files: a local directory, or a hub snapshot of its safetensors weights,
config and tokenizer files only (torch-free: `tgq download` and the batcher's start-up use it).

tgq never unpickles: a checkpoint with only `.bin`/`.pt`/`.pth`/`.ckpt` weights is refused with
a message saying so.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import NoReturn

from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, HFValidationError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
HUB_ALLOW_PATTERNS = [
    *("config.json", "generation_config.json", "chat_template.json", "*.jinja"),
    *("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json"),
    *("tokenizer.model", "vocab.json", "*.txt"),
    *("*.safetensors", "*.safetensors.index.json"),
]
# Mistral repos ship a second full copy as `consolidated.safetensors`, Llama repos an `original/`
# folder; both duplicate the HF-format weights that `Checkpoint` reads.
HUB_IGNORE_PATTERNS = ["consolidated*", "original/*"]
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_TRUTHY = ("1", "true", "yes", "on")


class ModelNotFoundError(ValueError):
    """The model id names neither a local directory nor a reachable hub repo with weights."""


class PickleWeightsError(ValueError):
    """The checkpoint has only pickle weights, which tgq refuses to load."""


def is_hub_offline() -> bool:
    """HF_HUB_OFFLINE read now (huggingface_hub itself reads it only once, at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUTHY


def resolve_model_dir(
    model_id: str, *, revision: str | None = None, cache_dir: str | Path | None = None
) -> Path:
    """A directory holding the model's config, tokenizer and safetensors weights."""
    local = Path(model_id).expanduser()
    if local.is_dir():
        files = _dir_files(local)
        if not _has_safetensors(files):
            _raise_no_safetensors(str(local), files)
        return local
    offline = is_hub_offline()
    snapshot = _download(model_id, revision, cache_dir, offline)
    files = _dir_files(snapshot)
    if not _has_safetensors(files):
        if not offline:
            files = _repo_files(model_id, revision, fallback=files)
        _raise_no_safetensors(f"{snapshot} (hub repo {model_id!r})", files)
    return snapshot


def _download(
    model_id: str, revision: str | None, cache_dir: str | Path | None, offline: bool
) -> Path:
    try:
        path = snapshot_download(
            model_id,
            revision=revision,
            cache_dir=cache_dir,
            allow_patterns=HUB_ALLOW_PATTERNS,
            ignore_patterns=HUB_IGNORE_PATTERNS,
            local_files_only=offline,
        )
    except (HfHubHTTPError, EntryNotFoundError, HFValidationError) as e:
        mode = "offline (HF_HUB_OFFLINE set: local cache only)" if offline else "online"
        raise ModelNotFoundError(
            f"model {model_id!r} is not a local directory and could not be fetched from the hub "
            f"(revision={revision or 'main'}, cache_dir={cache_dir or 'default HF cache'}, "
            f"{mode}): {type(e).__name__}: {e}"
        ) from e
    return Path(str(path))


def _repo_files(model_id: str, revision: str | None, *, fallback: list[str]) -> list[str]:
    """Top-level files of the hub repo (the snapshot omits pickle files by design).

    Only used to word an error, so any failure (HTTP, connection) falls back to the snapshot.
    """
    try:
        listed = HfApi().list_repo_files(model_id, revision=revision)
    except Exception:
        return fallback
    return [name for name in listed if "/" not in name]


def _dir_files(model_dir: Path) -> list[str]:
    return sorted(p.name for p in model_dir.iterdir() if p.is_file())


def _has_safetensors(files: Iterable[str]) -> bool:
    return any(name.endswith(".safetensors") for name in files)


def _raise_no_safetensors(where: str, files: Iterable[str]) -> NoReturn:
    pickles = [name for name in files if name.endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise PickleWeightsError(
            f"{where} only has pickle weights ({', '.join(pickles)}); tgq loads safetensors only "
            "and never unpickles. Convert the checkpoint to safetensors first."
        )
    raise ModelNotFoundError(f"no *.safetensors weights in {where}")


def weight_files(model_dir: Path) -> list[Path]:
    """The index's files if sharded, else `model.safetensors`, else every `*.safetensors`."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files
