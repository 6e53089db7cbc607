"""Attention and KV-write ops behind one small interface, chosen by name from a registry.

Each backend is one row of the registry: how to build it (a lazy import, so asking for "flash"
on a machine without flash-attn fails with a clear message) and the KV block sizes it can read.
"auto" picks the fastest backend that works here. Importing this package imports neither torch
nor anything from the rest of tgq: configuration code resolves block sizes without them.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tgq.kernels.interface import (
    AttentionBackend,
    AttentionMetadata,
    AttentionStep,
    BlockSizeRule,
    SeqSpan,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionStep",
    "BlockSizeRule",
    "SeqSpan",
    "available_backends",
    "block_size_rule",
    "get_backend",
    "resolve_backend_name",
    "resolve_block_size",
]


def _torch_backend() -> AttentionBackend[Any]:
    from tgq.kernels.torch_paged import TorchPagedAttention

    return TorchPagedAttention()


def _cpu_backend() -> AttentionBackend[Any]:
    from tgq.kernels.cpu_paged import CpuPagedAttention

    return CpuPagedAttention()


def _flash_backend() -> AttentionBackend[Any]:
    from tgq.kernels.flash import FlashAttention

    return FlashAttention()


@dataclass(frozen=True, slots=True)
class _Backend:
    build: Callable[[], AttentionBackend[Any]]
    block_sizes: BlockSizeRule


_REGISTRY: dict[str, _Backend] = {
    "torch": _Backend(_torch_backend, BlockSizeRule(default=16)),
    "cpu": _Backend(_cpu_backend, BlockSizeRule(default=16)),
    # flash-attn's paged mode reads K/V through its block table in pages of 256 tokens.
    "flash": _Backend(_flash_backend, BlockSizeRule(default=256, multiple=256)),
}


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def get_backend(name: str, device: torch.device) -> AttentionBackend[Any]:
    """`name` is a registry key or "auto": flash-attn on CUDA when importable, the AVX2 kernels
    on a CPU that has them, else torch."""
    if name == "auto":
        name = _auto_backend(device)
    return _entry(name).build()


def block_size_rule(name: str) -> BlockSizeRule:
    """The KV block sizes backend `name` (a registry key) can read."""
    return _entry(name).block_sizes


def resolve_backend_name(name: str, device: str) -> str:
    """The backend `name` stands for on `device` ("cpu", "cuda", "cuda:1"), without torch or a
    GPU: "auto" on CUDA is flash when flash-attn is installed (as `get_backend` would find it),
    else torch; on CPU it is "cpu", whose fallback ("torch") reads the same block sizes."""
    if name != "auto":
        _entry(name)
        return name
    device_type = device.partition(":")[0]
    if device_type == "cuda":
        return "flash" if importlib.util.find_spec("flash_attn") is not None else "torch"
    return "cpu" if device_type == "cpu" else "torch"


def resolve_block_size(backend: str, device: str, block_size: int | None) -> int:
    """The KV block size a runner with attention backend `backend` (a name or "auto") on
    `device` uses: `block_size` when the backend can read it (else a ValueError naming the
    backend's rule), the backend's default when None. Needs neither torch nor a GPU."""
    name = resolve_backend_name(backend, device)
    rule = block_size_rule(name)
    return rule.default if block_size is None else rule.check(name, block_size)


def _entry(name: str) -> _Backend:
    entry = _REGISTRY.get(name)
    if entry is None:
        choices = ", ".join(["auto", *available_backends()])
        raise ValueError(f"unknown attention backend {name!r}; choose one of: {choices}")
    return entry


def _auto_backend(device: torch.device) -> str:
    if device.type == "cuda":
        from tgq.kernels.flash import is_flash_available

        return "flash" if is_flash_available() else "torch"
    if device.type == "cpu":
        from tgq.kernels import cpu_ops

        return "cpu" if cpu_ops.is_available() else "torch"
    return "torch"
