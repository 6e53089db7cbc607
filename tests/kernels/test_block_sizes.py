"""The KV block size follows the attention backend: each backend's rule (a default and the sizes
it can read) lives in the kernels registry and is resolved without torch or a GPU (the runner's
side: tests/gpu_worker/test_runner.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tgq.kernels import BlockSizeRule, block_size_rule, resolve_backend_name, resolve_block_size

HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


def test_each_backend_states_its_rule() -> None:
    assert block_size_rule("torch") == BlockSizeRule(default=16, multiple=1)
    assert block_size_rule("cpu") == block_size_rule("torch")  # the CPU fallback reads the same
    assert block_size_rule("flash") == BlockSizeRule(default=256, multiple=256)


@pytest.mark.parametrize(
    ("backend", "device", "requested", "resolved"),
    [
        ("flash", "cuda", None, 256),
        ("flash", "cuda:1", 512, 512),
        ("torch", "cuda", None, 16),
        ("torch", "cpu", 12, 12),
        ("cpu", "cpu", None, 16),
        ("auto", "cpu", None, 16),
        ("auto", "cuda", None, 256 if HAS_FLASH_ATTN else 16),
    ],
)
def test_the_block_size_resolves_per_backend(
    backend: str, device: str, requested: int | None, resolved: int
) -> None:
    assert resolve_block_size(backend, device, requested) == resolved


def test_auto_names_the_backend_a_runner_would_take() -> None:
    assert resolve_backend_name("auto", "cuda") == ("flash" if HAS_FLASH_ATTN else "torch")
    assert resolve_backend_name("auto", "cpu") == "cpu"
    assert resolve_backend_name("flash", "cpu") == "flash"


@pytest.mark.parametrize(
    ("backend", "requested", "message"),
    [
        ("flash", 16, "attention backend 'flash' needs a KV block size that is a multiple of 256"
                      " (its default: 256), got 16"),
        ("flash", 384, "attention backend 'flash' needs a KV block size that is a multiple of 256"
                       " (its default: 256), got 384"),
        ("torch", 0, "attention backend 'torch' needs a KV block size that is a multiple of 1"
                     " (its default: 16), got 0"),
        ("nope", None, "unknown attention backend 'nope'; choose one of: auto, cpu, flash, torch"),
    ],
)  # fmt: skip
def test_a_size_the_backend_cannot_read_is_refused(
    backend: str, requested: int | None, message: str
) -> None:
    with pytest.raises(ValueError) as caught:
        resolve_block_size(backend, "cuda", requested)
    assert str(caught.value) == message


def test_resolving_needs_no_torch() -> None:
    code = (
        "import sys; from tgq.kernels import resolve_block_size;"
        " print(resolve_block_size('flash', 'cuda', None), 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["256", "False"]
