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


requires_vnni_w8a8 = pytest.mark.skipif(
    not cpu_ops.has_vnni_w8a8_linear(),
    reason="the INT8 W8A8 kernel needs AVX512_VNNI and AVX512_BF16",
)


def use_eight_bit_kernel(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Quantized layers load onto `kernel` from now on ("torch": no kernel; "vnni": INT8 W8A8
    layers on `cpu_ops.linear_w8a8_vnni`, the others on the best 8-bit kernel here; the rest
    take W8A8 layers too)."""
    best = cpu_ops.eight_bit_kernel()
    chosen = None if kernel == "torch" else best if kernel == "vnni" else kernel
    monkeypatch.setattr(cpu_ops, "eight_bit_kernel", lambda: chosen)
    monkeypatch.setattr(cpu_ops, "has_vnni_w8a8_linear", lambda: kernel == "vnni")
