"""`--quantize int8` / `fp8` in the tests: the formats' references, written from their
descriptions in numpy (which tgq's quantizer must equal bit for bit), and the quantized mode of the
parity and scheduling tests.

With `TGQ_TEST_QUANTIZE=int8` (or `fp8`; `make test-quantized`) the tests of
tests/gpu_worker/test_parity.py, tests/batcher/test_e2e.py and
tests/gpu_worker/test_tensor_parallel.py run every engine `--quantize`d and hold it to
transformers on the dequantized weights (q * scale by the references below): the same math, token
for token, instead of the unquantized model."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tgq.devtools.quantized_reference import dequantize_in_place


def reference_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-row int8 from its description, in numpy float32: scale = max |w| / 127
    (1 for an all-zero row), q = w / scale rounded half to even, clamped to [-127, 127]."""
    w = w.astype(np.float32)
    amax = np.abs(w).max(axis=-1)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(w / scale[..., None]), -127, 127).astype(np.int8)
    return q, scale


def e4m3_magnitudes() -> np.ndarray:
    """The 127 finite non-negative E4M3 values by code (OCP FP8: 4 exponent bits with bias 7,
    3 mantissa bits, exponent 0 subnormal, code 0x7F NaN), increasing with the code."""
    codes = np.arange(127)
    exponent, mantissa = codes >> 3, codes & 7
    normal = (1 + mantissa / 8) * 2.0 ** (exponent - 7)
    return np.where(exponent == 0, mantissa / 8 * 2.0**-6, normal).astype(np.float64)


def reference_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-row FP8 E4M3 from its description: scale = max |w| / 448 in float32 (1 for
    an all-zero row); w / scale (float32) to the nearest E4M3 value, ties to the even code; the
    E4M3 bits as uint8."""
    w = w.astype(np.float32)
    amax = np.abs(w).max(axis=-1)
    scale = np.where(amax > 0, amax / np.float32(448), np.float32(1)).astype(np.float32)
    scaled = np.clip(w / scale[..., None], -448, 448)
    table, magnitude = e4m3_magnitudes(), np.abs(scaled).astype(np.float64)
    upper = np.clip(np.searchsorted(table, magnitude), 1, 126)
    lower = upper - 1
    below, above = magnitude - table[lower], table[upper] - magnitude
    code = np.where((above < below) | ((above == below) & (upper % 2 == 0)), upper, lower)
    code = np.where(magnitude <= table[0], 0, code)
    sign = np.where(np.signbit(scaled), 0x80, 0)
    return (code | sign).astype(np.uint8), scale


REFERENCES = {"int8": reference_int8, "fp8": reference_fp8}
METHODS = tuple(REFERENCES)


def as_torch(method: str, q: np.ndarray) -> torch.Tensor:
    tensor = torch.from_numpy(q)
    return tensor.view(torch.float8_e4m3fn) if method == "fp8" else tensor


def reference_rows(method: str) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    def rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, scale = REFERENCES[method](w.numpy())
        return as_torch(method, q), torch.from_numpy(scale)

    return rows


def _mode() -> str | None:
    method = os.environ.get("TGQ_TEST_QUANTIZE") or None
    if method is not None and method not in METHODS:
        raise ValueError(f"TGQ_TEST_QUANTIZE={method!r}: choose from {', '.join(METHODS)}")
    return method


QUANTIZE = _mode()  # None: the tests' engines run the weights as stored


def as_reference(model: Any, method: str | None = QUANTIZE) -> Any:
    """A transformers fp32 model as the tests' reference: unchanged, or in the quantized mode
    with its quantized weights replaced by q * scale."""
    if method is None:
        return model
    return dequantize_in_place(model, reference_rows(method), torch.float32)
