"""Attention and KV-write ops behind one small interface, chosen by name from a registry.

Backends import lazily: asking for "flash" on a machine without flash-attn fails with a clear
message, and "auto" picks the fastest one that works here. This package imports nothing from the
rest of tgq.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tgq.kernels.interface import AttentionBackend, AttentionMetadata, AttentionStep, SeqSpan

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionStep",
    "SeqSpan",
    "available_backends",
    "get_backend",
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


_REGISTRY: dict[str, Callable[[], AttentionBackend[Any]]] = {
    "torch": _torch_backend,
    "cpu": _cpu_backend,
    "flash": _flash_backend,
}


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def get_backend(name: str, device: torch.device) -> AttentionBackend[Any]:
    """`name` is a registry key or "auto": flash-attn on CUDA when importable, the AVX2 kernels
    on a CPU that has them, else torch."""
    if name == "auto":
        name = _auto_backend(device)
    factory = _REGISTRY.get(name)
    if factory is None:
        choices = ", ".join(["auto", *available_backends()])
        raise ValueError(f"unknown attention backend {name!r}; choose one of: {choices}")
    return factory()


def _auto_backend(device: torch.device) -> str:
    if device.type == "cuda":
        from tgq.kernels.flash import is_flash_available

        return "flash" if is_flash_available() else "torch"
    if device.type == "cpu":
        from tgq.kernels import cpu_ops

        return "cpu" if cpu_ops.is_available() else "torch"
    return "torch"
