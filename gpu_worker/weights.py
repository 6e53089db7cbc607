"""Find a model's safetensors weights (local dir or hub id) and copy them into live parameters.

tgq never unpickles: a checkpoint with only `.bin`/`.pt`/`.pth`/`.ckpt` weights is refused, and
nothing here calls `torch.load`. The model allocates its parameters once, in the target dtype and
on the target device; `Checkpoint.copy_into` reads (a slice of) each memory-mapped tensor straight
into them, so no second copy of the model is materialised and a tensor-parallel rank reads only
its shard.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NoReturn

import torch
from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, HFValidationError
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
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


class Checkpoint:
    """Memory-mapped safetensors files of one model; each file is opened once and kept open."""

    def __init__(self, handle_by_name: dict[str, Any], handles: list[Any]) -> None:
        self._handle_by_name = handle_by_name
        self._handles = handles

    @classmethod
    def open(cls, model_dir: str | Path) -> Checkpoint:
        paths = _weight_files(Path(model_dir))
        handles: list[Any] = [safe_open(str(path), framework="pt") for path in paths]
        handle_by_name: dict[str, Any] = {}
        for handle in handles:
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                if name in handle_by_name:
                    raise ValueError(f"tensor {name!r} is stored in more than one file")
                handle_by_name[name] = handle
        return cls(handle_by_name, handles)

    def names(self) -> list[str]:
        return sorted(self._handle_by_name)

    def has(self, name: str) -> bool:
        return name in self._handle_by_name

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """A whole tensor, read into fresh memory: for small tensors only."""
        tensor: torch.Tensor = self._handle(name).get_tensor(name)
        return tensor.to(dtype)

    def copy_into(
        self, name: str, out: torch.Tensor, *, dim: int = 0, start: int = 0, stop: int | None = None
    ) -> None:
        """Copy `stored[start:stop]` along `dim` into `out`, converting to `out`'s dtype.

        Only the slice is read from disk. `out` may be a parameter on any device.
        """
        stored = self._slice(name)
        shape = tuple(stored.get_shape())
        index, expected = _slice_plan(name, shape, dim, start, stop)
        if tuple(out.shape) != expected:
            raise ValueError(
                f"tensor {name!r}: the checkpoint slice has shape {expected} (stored {shape}), "
                f"the destination has shape {tuple(out.shape)}"
            )
        with torch.no_grad():
            out.copy_(stored[index])

    def close(self) -> None:
        for handle in self._handles:
            handle.__exit__(None, None, None)
        self._handles = []
        self._handle_by_name = {}

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _handle(self, name: str) -> Any:
        if name not in self._handle_by_name:
            raise KeyError(f"tensor {name!r} is not in the checkpoint")
        return self._handle_by_name[name]

    def _slice(self, name: str) -> Any:
        return self._handle(name).get_slice(name)


def _weight_files(model_dir: Path) -> list[Path]:
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


def _slice_plan(
    name: str, shape: tuple[int, ...], dim: int, start: int, stop: int | None
) -> tuple[tuple[slice, ...], tuple[int, ...]]:
    """The index selecting `[start:stop]` along `dim`, and the shape it yields."""
    if not shape and start == 0 and stop is None:
        return (), ()
    if not -len(shape) <= dim < len(shape):
        raise ValueError(f"tensor {name!r} of shape {shape} has no dim {dim}")
    dim %= len(shape)
    stop = shape[dim] if stop is None else stop
    if not 0 <= start <= stop <= shape[dim]:
        raise ValueError(
            f"tensor {name!r}: [{start}:{stop}] is out of range in dim {dim} of {shape}"
        )
    index = (*(slice(None),) * dim, slice(start, stop))
    return index, (*shape[:dim], stop - start, *shape[dim + 1 :])
