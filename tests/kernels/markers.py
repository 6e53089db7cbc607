"""Skip kernel tests only on CPUs that cannot run the kernels; elsewhere they must build."""

from __future__ import annotations

import pytest

from tgq.kernels import cpu_ops

_REASON = cpu_ops.hardware_unsupported_reason()

requires_kernels = pytest.mark.skipif(
    _REASON is not None, reason=f"this CPU cannot run the AVX2 kernels: {_REASON}"
)
