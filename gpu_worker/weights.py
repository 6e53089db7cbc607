"""Copy a model's safetensors weights into live parameters (`gpu_worker.hub` finds them).

tgq never unpickles: nothing here calls torch's pickle-based loader. The model allocates its
parameters once, in the target dtype and on the target device; `Checkpoint.copy_into` reads (a
slice of) each memory-mapped tensor straight into them, so no second copy of the model is
materialised and a tensor-parallel rank reads only its shard.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tgq.gpu_worker.hub import weight_files


class Checkpoint:
    """Memory-mapped safetensors files of one model; each file is opened once and kept open.
    Tensors go by the model's names for them (`rename` at `open`), each read under the name it
    is stored by."""

    def __init__(self, handle_by_name: dict[str, tuple[Any, str]], handles: list[Any]) -> None:
        self._handle_by_name = handle_by_name  # our name -> (file handle, stored name)
        self._handles = handles

    @classmethod
    def open(cls, model_dir: str | Path, rename: Callable[[str], str | None] = str) -> Checkpoint:
        """`rename`: a stored tensor name -> ours, or None for a tensor the model does not use
        (a multimodal checkpoint's vision tower)."""
        paths = weight_files(Path(model_dir))
        handles: list[Any] = [safe_open(str(path), framework="pt") for path in paths]
        handle_by_name: dict[str, tuple[Any, str]] = {}
        for handle in handles:
            for stored in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                name = rename(stored)
                if name is None:
                    continue
                if name in handle_by_name:
                    raise ValueError(f"tensor {name!r} is stored in more than one file")
                handle_by_name[name] = (handle, stored)
        return cls(handle_by_name, handles)

    def names(self) -> list[str]:
        return sorted(self._handle_by_name)

    def has(self, name: str) -> bool:
        return name in self._handle_by_name

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """A whole tensor, read into fresh memory: for small tensors only."""
        handle, stored = self._handle(name)
        tensor: torch.Tensor = handle.get_tensor(stored)
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

    def _handle(self, name: str) -> tuple[Any, str]:
        if name not in self._handle_by_name:
            raise KeyError(f"tensor {name!r} is not in the checkpoint")
        return self._handle_by_name[name]

    def _slice(self, name: str) -> Any:
        handle, stored = self._handle(name)
        return handle.get_slice(stored)


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
