"""Skip kernel tests only on CPUs that cannot run the kernels; elsewhere they must build."""

from __future__ import annotations

import pytest

from tgq.kernels import cpu_ops

_REASON = cpu_ops.hardware_unsupported_reason()

requires_kernels = pytest.mark.skipif(
    _REASON is not None, reason=f"this CPU cannot run the AVX2 kernels: {_REASON}"
)

# The kernels 8-bit weights can load onto (`cpu_ops.eight_bit_kernel`), each where this CPU runs
# it, and torch's path (any CPU).
requires_avx512_8bit = pytest.mark.skipif(
    not cpu_ops.has_avx512_8bit_linear(),
    reason="the avx512 8-bit linear kernel needs AVX512_BF16 and AVX512_VBMI",
)
requires_avx512f_8bit = pytest.mark.skipif(
    not cpu_ops.has_avx512f_kernels(),
    reason="the avx512f 8-bit linear kernel needs AVX512F, AVX512BW and AVX512VL",
)
EIGHT_BIT_KERNELS = [
    pytest.param("avx512", marks=requires_avx512_8bit),
    pytest.param("avx2", marks=requires_kernels),
    "torch",
]


def use_eight_bit_kernel(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Quantized layers load onto `kernel` from now on ("torch": no kernel)."""
    monkeypatch.setattr(cpu_ops, "eight_bit_kernel", lambda: None if kernel == "torch" else kernel)
