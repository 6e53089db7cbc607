"""AVX2/FMA CPU kernels (bf16-weight linear, paged decode attention), JIT-built on first use.

torch's CPU bf16 matmul is very slow without avx512_bf16/AMX; these kernels widen bf16 to fp32 in
registers and accumulate in fp32. The extension is compiled once into a cache directory
($TGQ_KERNEL_CACHE, else ~/.cache/tgq/kernels) by `torch.utils.cpp_extension.load`, which needs
ninja. `is_available()` never raises: on a CPU without avx2/fma, or when the build fails, it
returns False and the reason is logged once and kept in `unavailable_reason()`.
"""

from __future__ import annotations

import fcntl
import logging
import os
import platform
import re
import shlex
import subprocess
import sysconfig
import threading
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "add_rms_norm",
    "apply_token_mask_",
    "argmax",
    "avx512_attention_serves",
    "eight_bit_kernel",
    "fp8_kv_attention_serves",
    "fp8_kv_decode_path",
    "gelu_tanh_mul",
    "greedy_head_argmax",
    "hardware_unsupported_reason",
    "has_amx_bf16",
    "has_amx_int8",
    "has_avx512_8bit_linear",
    "has_avx512_bf16",
    "has_avx512_int4_linear",
    "has_avx512_vnni_bf16",
    "has_avx512f_kernels",
    "has_int4_linear",
    "has_vnni_w8a8_linear",
    "int8_codes",
    "is_available",
    "linear_8bit_packed",
    "linear_bf16",
    "linear_bf16_packed",
    "linear_int4_packed",
    "linear_w8a8_vnni",
    "moe_experts_bf16",
    "offset_rms_norm",
    "op_program",
    "pack_weight_8bit",
    "pack_weight_bf16",
    "pack_weight_int4",
    "pack_weight_vnni",
    "paged_decode_attention",
    "paged_prefill_attention",
    "quantize_inputs",
    "rms_norm",
    "rotary_qk_",
    "silu_mul",
    "unavailable_reason",
    "vnni_offset",
]

logger = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "linear_bf16.cpp",
        "linear_avx512_bf16.cpp",
        "linear_8bit.cpp",
        "linear_8bit_avx512.cpp",
        "linear_8bit_avx2.cpp",
        "linear_8bit_avx512f.cpp",
        "linear_int4.cpp",
        "linear_int4_avx512.cpp",
        "linear_int4_avx2.cpp",
        "linear_int4_avx512f.cpp",
        "input_quant.cpp",
        "linear_w8a8_vnni.cpp",
        "paged_attention.cpp",
        "attention_avx512.cpp",
        "kv_fp8_avx512.cpp",
        "prefill_avx512.cpp",
        "kv_write.cpp",
        "cpu_fused.cpp",
        "fused_avx512.cpp",
        "argmax.cpp",
        "greedy_head.cpp",
        "greedy_head_avx512.cpp",
        "greedy_head_avx2.cpp",
        "op_program.cpp",
        "token_mask.cpp",
    )
]
_REQUIRED_FLAGS = frozenset({"avx2", "fma"})
# This torch's at::parallel_for is an inline `#pragma omp parallel`: without -fopenmp the kernels
# would silently run on one thread.
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]
# The torch headers every file includes, precompiled once per cache (`_precompiled_header`).
_TORCH_HEADERS = Path(__file__).parent / "csrc" / "torch_headers.h"
_EXTENSION_NAME = "tgq_cpu_ops"
# Precompiling the headers takes ~6 s and saves ~4.5 s a file (on 2 cores): worth it for a build
# of this many files or more.
_PCH_FROM = 4


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def hardware_unsupported_reason() -> str | None:
    """Why this CPU cannot run the kernels at all (None: it can, so a failed build is a bug)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"needs an x86-64 CPU, this is {platform.machine()}"
    missing = _REQUIRED_FLAGS - _cpu_flags()
    if missing:
        return f"CPU lacks {', '.join(sorted(missing))}"
    return None


def _build() -> Any:
    """Compiles (or reuses) the library and loads it; its ops register as torch.ops.tgq_cpu_ops."""
    from torch.utils.cpp_extension import load

    cache = Path(os.environ.get("TGQ_KERNEL_CACHE", Path.home() / ".cache" / "tgq" / "kernels"))
    cache.mkdir(parents=True, exist_ok=True)
    # torch marks a build in progress with a `lock` file and waits, forever, while it exists:
    # a process killed mid-build (kill -9, OOM) would hang every later start on this cache.
    # An flock is released by the kernel when its holder dies; whoever holds it is the only
    # builder, so a `lock` file found then is stale.
    with (cache / "tgq-build.flock").open("w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (cache / "lock").unlink(missing_ok=True)
        pch = cache / "pch"
        try:
            load(
                name=_EXTENSION_NAME,
                sources=[str(source) for source in _SOURCES],
                extra_cflags=_CFLAGS + _precompiled_header(pch, _compiles(cache) >= _PCH_FROM),
                extra_ldflags=["-fopenmp"],
                build_directory=str(cache),
                is_python_module=False,
                verbose=False,
            )
        finally:  # ~300 MB, and only a build reads it
            (pch / "tgq_pch.h.gch").unlink(missing_ok=True)
    return torch.ops.tgq_cpu_ops


def _compiles(cache: Path) -> int:
    """How many files building in `cache` will compile: all where nothing was built there yet,
    else what ninja's dry run finds to do (its steps but the link)."""
    if not (cache / "build.ninja").is_file():
        return len(_SOURCES)
    try:
        done = subprocess.run(
            ["ninja", "-n", "-C", str(cache)], capture_output=True, text=True, check=False
        )
    except OSError:
        return len(_SOURCES)
    steps = re.search(r"\[\d+/(\d+)\]", done.stdout)
    if done.returncode != 0:
        return len(_SOURCES)
    return 0 if steps is None else max(0, int(steps.group(1)) - 1)


def _precompiled_header(folder: Path, compiles: bool, headers: Path = _TORCH_HEADERS) -> list[str]:
    """The flags that start every file from `headers` (`-include` of a header in `folder`),
    precompiled there when the build `compiles` (GCC's .gch, with the flags torch's build gives
    the files; the caller deletes it after the build); [] where it cannot be built (each file
    then parses the headers itself). GCC checks a .gch against each file's flags and, should
    they differ, reads the header's text instead."""
    from torch.utils.cpp_extension import include_paths

    compiler = os.environ.get("CXX", "c++")
    python_include = sysconfig.get_path("include", scheme="posix_prefix")
    system = [*include_paths("cpu"), *([python_include] if python_include else [])]
    flags = [
        f"-DTORCH_EXTENSION_NAME={_EXTENSION_NAME}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        *(arg for path in system for arg in ("-isystem", path)),
        "-fPIC",
        "-std=c++20",
        *_CFLAGS,
    ]
    header = folder / "tgq_pch.h"
    folder.mkdir(parents=True, exist_ok=True)
    text = f'#include "{headers}"\n'
    if not header.is_file() or header.read_text() != text:  # as written: nothing at each start
        header.write_text(text)
    if not compiles:  # the same flags, so that ninja sees an unchanged build
        return ["-include", shlex.quote(str(header))]
    command = [compiler, *flags, "-x", "c++-header", str(header), "-o", f"{header}.gch"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        logger.warning("precompiled header not built (%s): each file parses it", exc)
        return []
    if done.returncode != 0:
        logger.warning("precompiled header not built: %s", done.stderr[-2000:])
        return []
    return ["-include", shlex.quote(str(header))]


class _Library:
    """The compiled ops, built on first use; `failure` says why they are unavailable."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._checked = False
        self._ops: Any = None  # torch.ops.tgq_cpu_ops once loaded
        self.failure: str | None = None

    def ops(self) -> Any:
        if self._checked:  # set once, after _ops and failure (every op call takes this path)
            return self._ops
        with self._lock:
            if not self._checked:
                self.failure = hardware_unsupported_reason()
                if self.failure is None:
                    try:
                        self._ops = _build()
                    except Exception as exc:  # any build or load error means "unavailable"
                        self.failure = f"build failed: {exc}"
                if self.failure is not None:
                    logger.warning("tgq CPU kernels unavailable: %s", self.failure)
                self._checked = True
            return self._ops


_library = _Library()


def is_available() -> bool:
    """Builds the kernels on first call; False (never an exception) when they cannot run here."""
    return _library.ops() is not None


def unavailable_reason() -> str | None:
    """Why `is_available()` is False (None when available, or not yet checked)."""
    return _library.failure


def _ops() -> Any:
    ops = _library.ops()
    if ops is None:
        raise RuntimeError(f"tgq CPU kernels are unavailable: {_library.failure}")
    return ops


LINEAR_PATHS = ("auto", "avx2", "avx512", "native")


def linear_bf16(
    x: torch.Tensor,  # [M, K] bf16 or fp32
    weight: torch.Tensor,  # [N, K] bf16, contiguous
    bias: torch.Tensor | None = None,  # [N]
    path: str = "auto",
    *,
    out_fp32: bool = False,
) -> torch.Tensor:  # [M, N] in x's dtype, or fp32 with out_fp32
    """`x @ weight.T + bias` accumulated in fp32, rounded to x's dtype; `out_fp32` returns that
    widened to fp32, i.e. `linear_bf16(...).float()` in one pass where the kernel allows (logits).

    `path` picks the kernel; "auto" takes the fastest for this CPU and M (see linear_bf16.cpp):
    "native" (at::linear, oneDNN; bf16 x on AVX512_BF16 CPUs) or "avx2" (any AVX2/FMA CPU);
    "avx512" (AVX512_BF16, bf16 x) packs `weight` for this call and runs `linear_bf16_packed`.
    Tests name paths to check each one.
    """
    out: torch.Tensor = _ops().linear_bf16(x, weight, bias, path, out_fp32)
    return out


def pack_weight_bf16(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 -> the layout `linear_bf16_packed` reads, [ceil(N/16), ceil(K/2), 16, 2]: tiles
    of 16 output columns, each pair of K values of the 16 columns side by side (zeros past N, K)."""
    packed: torch.Tensor = _ops().pack_weight_bf16(weight)
    return packed


def linear_bf16_packed(
    x: torch.Tensor,  # [M, K] bf16
    packed: torch.Tensor,  # pack_weight_bf16(weight [N, K])
    out_features: int,  # N
    bias: torch.Tensor | None = None,
    *,
    out_fp32: bool = False,
    kernel: str = "avx512",
) -> torch.Tensor:  # [M, N] bf16, or fp32 with out_fp32
    """`linear_bf16(x, weight, bias, "avx512", out_fp32=...)` over weights packed once, for any
    M: `kernel` "avx512" (needs AVX512_BF16) or "amx" (AMX tiles over the same packed weights;
    needs `has_amx_bf16()` and K % 32 == 0)."""
    out: torch.Tensor = _ops().linear_bf16_packed(x, packed, out_features, bias, out_fp32, kernel)
    return out


def moe_experts_bf16(
    x: torch.Tensor,  # [T, K] bf16
    experts: torch.Tensor,  # [T, k] int64: each token's chosen experts
    weights: torch.Tensor,  # [T, k] fp32 or bf16: their weights
    gate_up: torch.Tensor,  # [E, ...]: each expert's pack_weight_bf16([2I, K]), stacked
    down: torch.Tensor,  # [E, ...]: each expert's pack_weight_bf16([K, I]), stacked
    intermediate: int,  # I, a multiple of 16
) -> torch.Tensor:  # [T, K] bf16
    """A sparse MoE block's SiLU experts in one call (needs AVX512_BF16; K even): for each token
    the sum, in expert order, of `bf16(down(silu_mul(gate_up(x))) * weight)` over its choices,
    each partial sum rounded to bf16, as `index_add_` over the experts' outputs adds them. The
    same values as the experts run one by one on `linear_bf16_packed` (kernel "avx512") and
    `silu_mul`; each chosen expert's weights are read once."""
    out: torch.Tensor = _ops().moe_experts_bf16(x, experts, weights, gate_up, down, intermediate)
    return out


def eight_bit_kernel() -> str | None:
    """The kernel `linear_8bit_packed` runs 8-bit weights on here: "avx512" (AVX512_BF16 and
    AVX512_VBMI), else "avx2" (any CPU the kernels run on); None where the kernels are
    unavailable. Builds the kernels."""
    if not is_available():
        return None
    return "avx512" if has_avx512_8bit_linear() else "avx2"


def pack_weight_8bit(weight: torch.Tensor, kernel: str = "avx512") -> torch.Tensor:
    """[N, K] int8 or float8_e4m3fn -> the layout `linear_8bit_packed` reads on `kernel`:
    "avx512", [ceil(N/16), ceil(K/4), 64], the tiles and pairs of `pack_weight_bf16`, two pairs a
    64-byte block, each byte sign and magnitude, of the weight's dtype or uint8 for int8 weights
    that contain -128 (which decode at a little more cost); "avx2", [ceil(N/16), ceil(K/4), 4,
    16], each K value's 16 column bytes side by side, of the weight's dtype (linear_kernels.h)."""
    packed: torch.Tensor = _ops().pack_weight_8bit(weight, kernel)
    return packed


def linear_8bit_packed(
    x: torch.Tensor,  # [M, K] bf16
    packed: torch.Tensor,  # pack_weight_8bit(w [N, K])
    scale: torch.Tensor,  # [N] fp32
    out_features: int,  # N
    bias: torch.Tensor | None = None,
    *,
    out_fp32: bool = False,
    kernel: str = "auto",
) -> torch.Tensor:  # [M, N] bf16, or fp32 with out_fp32
    """bf16((x @ w^T) * scale + bias) with fp32 sums of exact products, w int8 or FP8 E4M3 as
    `packed`'s dtype says, on a kernel that reads its layout (`pack_weight_8bit`): the "avx512"
    layout on the "avx512" kernel (needs `has_avx512_8bit_linear()`), the sums
    `linear_bf16_packed` makes over w as bf16 weights; the "avx2" layout on the "avx2" kernel or
    its 16-lane twin "avx512f" (AVX512F/BW/VL, no AVX512_BF16 needed; "auto" takes it where the
    CPU has it), each column summed in K order, the same sums bit for bit. Each column's sums
    times its scale, plus the bias (one FMA), rounded once."""
    out: torch.Tensor = _ops().linear_8bit_packed(
        x, packed, scale, out_features, bias, out_fp32, kernel
    )
    return out


VNNI_MAX_K = 65536  # `linear_w8a8_vnni`'s int32 sums hold K products of 255 x 128


def has_vnni_w8a8_linear() -> bool:
    """Whether INT8 W8A8 layers run as integers here (`linear_w8a8_vnni`: AVX512_VNNI and
    AVX512_BF16)."""
    return has_avx512_vnni_bf16()


def pack_weight_vnni(w: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 weights (K up to 65,536) -> the layout `linear_w8a8_vnni` reads, [ceil(N/16),
    ceil(K/4), 16, 4] int8: each column's four consecutive K values side by side, zeros past N
    and K. Needs `has_avx512_vnni_bf16()`."""
    packed: torch.Tensor = _ops().pack_weight_vnni(w)
    return packed


def vnni_offset(w: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 -> [N] int32: 128 * each column's sum of w, what `linear_w8a8_vnni`'s unsigned
    input codes (q + 128) add to its sums."""
    return (w.to(torch.int32).sum(dim=1) * 128).to(torch.int32)


def linear_w8a8_vnni(
    x: torch.Tensor,  # [M, K] bf16 or fp32
    packed: torch.Tensor,  # pack_weight_vnni(w [N, K])
    offset: torch.Tensor,  # vnni_offset(w)
    w_scale: torch.Tensor,  # [N] fp32
    out_features: int,  # N
    bias: torch.Tensor | None = None,
    *,
    per_token: bool = True,
    static_scale: torch.Tensor | None = None,  # [1] fp32: inputs over a stored scale
) -> torch.Tensor:  # [M, N] in x's dtype
    """An INT8 W8A8 linear as integers: x's rows quantized to int8 codes q with scales s
    (`int8_codes`: the codes `quantize_inputs` rounds), then `(float(sum_k q w) * w_scale) * s
    (+ bias)` per output, the sum exact in int32 (vpdpbusd), rounded once to x's dtype."""
    out: torch.Tensor = _ops().linear_w8a8_vnni(
        x, packed, offset, w_scale, out_features, bias, per_token, static_scale
    )
    return out


def int8_codes(
    x: torch.Tensor, per_token: bool = True, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 codes [M, K] and the scales [M] fp32 `linear_w8a8_vnni` multiplies: with them,
    `quantize_inputs(x, fp8=False, ...)` is `(codes * scale)` rounded to x's dtype."""
    codes, scales = _ops().int8_codes(x, per_token, static_scale)
    return codes, scales


def pack_weight_int4(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K] uint8 of 4-bit values 0..15 -> the layout `linear_int4_packed` reads, [ceil(N/16),
    ceil(K/8), 64] uint8: the tiles and pairs of `pack_weight_bf16`, eight K values (four pairs)
    a 64-byte block, each 16-bit word the four pairs' nibbles of one column and K parity
    (linear_kernels.h). `group_size` (a multiple of 8, or K) is checked, not stored."""
    packed: torch.Tensor = _ops().pack_weight_int4(q, group_size)
    return packed


def linear_int4_packed(
    x: torch.Tensor,  # [M, K] bf16
    packed: torch.Tensor,  # pack_weight_int4(q [N, K], group_size)
    scale: torch.Tensor,  # [N, G] fp32, G = ceil(K / group_size)
    zero: torch.Tensor,  # [N, G] fp32
    group_size: int,
    out_features: int,  # N
    bias: torch.Tensor | None = None,
    *,
    out_fp32: bool = False,
    kernel: str = "auto",
) -> torch.Tensor:  # [M, N] bf16, or fp32 with out_fp32
    """`x @ w^T + bias` over grouped 4-bit weights, w[n, k] = (q[n, k] - zero[n, g]) * scale[n, g]
    with g = k // group_size (needs `has_int4_linear()`): fp32 sums of exact products, each
    group's folded in with its scale and zero, rounded once to bf16 (with `out_fp32`, the fp32
    sums themselves). Each row's result is the same whatever else is in the call. `kernel`:
    "auto" takes "avx512" (AVX512_BF16, `has_avx512_int4_linear()`) where it can, else
    "avx512f" (AVX512F/BW/VL, `has_avx512f_kernels()`: the "avx2" kernel's sums at 16 lanes,
    bit for bit), else "avx2" (any CPU the kernels run on); all read the same packed weights.
    Tests name kernels to check each one."""
    out: torch.Tensor = _ops().linear_int4_packed(
        x, packed, scale, zero, group_size, out_features, bias, out_fp32, kernel
    )
    return out


def quantize_inputs(
    x: torch.Tensor,  # [M, K] fp32 or bf16
    *,
    fp8: bool,
    per_token: bool,
    static_scale: torch.Tensor | None = None,  # [1] fp32
) -> torch.Tensor:  # [M, K], x's dtype
    """A W8A8 linear's input quantized to int8 (or FP8 E4M3 with `fp8`) and dequantized, in
    one pass: scale = max |x| (per row with `per_token`, else over x) / 127.5 (448), or the
    static scale; the values of gpu_worker/layers/activation_quant.py's torch ops, bit for bit
    (any CPU)."""
    out: torch.Tensor = _ops().quantize_inputs(x, fp8, per_token, static_scale)
    return out


def has_avx512_8bit_linear() -> bool:
    """Whether `linear_8bit_packed` runs here: AVX512_BF16 and AVX512_VBMI."""
    return has_avx512_bf16() and "avx512vbmi" in _cpu_flags()


def has_avx512f_kernels() -> bool:
    """Whether the 16-lane kernels (`kernel="avx512f"` of `linear_8bit_packed` and
    `linear_int4_packed`) run here: AVX512F, BW and VL (and F16C), with or without AVX512_BF16."""
    return {"avx512f", "avx512bw", "avx512vl", "f16c"} <= _cpu_flags()


def has_int4_linear() -> bool:
    """Whether `linear_int4_packed` runs here, i.e. grouped 4-bit weights can stay packed: on
    every CPU the kernels run on (its AVX2 kernel needs only AVX2 and FMA). Builds the kernels;
    False where they are unavailable."""
    return is_available()


def has_avx512_int4_linear() -> bool:
    """Whether `linear_int4_packed(..., kernel="avx512")` runs here: AVX512_BF16 (the 4-bit
    values decode with AVX512BW shifts and logic alone)."""
    return has_avx512_bf16()


def has_avx512_bf16() -> bool:
    """Whether this CPU has AVX512_BF16, i.e. the "avx512" and "native" linear paths are fast."""
    return {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= _cpu_flags()


def has_amx_bf16() -> bool:
    """Whether `linear_bf16_packed(..., kernel="amx")` runs here: AVX512_BF16, AMX-TILE and
    AMX-BF16, and Linux lets this process use the tile registers (asked once). Builds the
    kernels; False where they are unavailable."""
    return is_available() and bool(_ops().has_amx_bf16())


def has_amx_int8() -> bool:
    """Whether `greedy_head_argmax(..., kernel="amx")` runs here: AVX512_BF16 and VNNI,
    AMX-TILE and AMX-INT8, and Linux lets this process use the tile registers. Builds the
    kernels; False where they are unavailable."""
    return has_avx512_vnni_bf16() and is_available() and bool(_ops().has_amx_int8())


def has_avx512_vnni_bf16() -> bool:
    """Whether `greedy_head_argmax` runs here (AVX512_BF16 and AVX512_VNNI)."""
    return has_avx512_bf16() and "avx512_vnni" in _cpu_flags()


def greedy_head_argmax(
    x: torch.Tensor,  # [M, K] bf16, the final norm's output
    weight: torch.Tensor,  # [N, K] bf16, contiguous
    screen: torch.Tensor,  # [ceil(N/16), K/4, 16, 4] int8 (kernels.greedy_head)
    scale: torch.Tensor,  # [N] fp32
    q_sum: torch.Tensor,  # [N] int32
    bound_x: torch.Tensor,  # [N] fp32
    bound_ex: torch.Tensor,  # [N] fp32
    max_candidates: int,
    masks: torch.Tensor | None = None,  # [M, W] int32: row m may take column n when bit n % 32
    # of word n // 32 is set (structured output)
    *,
    kernel: str = "avx512",
) -> torch.Tensor:  # [M] int64: the argmax, or -1 where the row must be computed in full
    """argmax(linear_bf16_packed(x, pack_weight_bf16(weight), N, out_fp32=True), -1) per row
    (over the allowed columns only, with `masks`), reading the int8 screen and then only the
    rows of `weight` that could win; build its inputs with `kernels.greedy_head`. `kernel`
    screens with "avx512" (VNNI) or "amx" (AMX-INT8 tiles, `has_amx_int8()`, K % 64 == 0): the
    same integer sums, so the same tokens. "avx2" (any CPU the kernels run on) picks instead what
    the CPUs without AVX512_BF16 compute: argmax(linear_bf16(x[m : m + 1], weight, path="avx2",
    out_fp32=True)) for each row m alone."""
    out: torch.Tensor = _ops().greedy_head_argmax(
        x, weight, screen, scale, q_sum, bound_x, bound_ex, max_candidates, masks, kernel
    )
    return out


def avx512_attention_serves(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the AVX-512 attention kernels (decode "avx512" path, paged_prefill_attention) take
    this dtype and head size on this CPU: bf16, AVX512_BF16, a multiple of 32 up to 256. The rule
    lives in the C++ (avx512_attention_serves); this asks it once per (dtype, head size)."""
    served: bool = _ops().attention_avx512_serves(dtype, head_dim)
    return served


def fp8_kv_attention_serves(head_dim: int) -> bool:
    """Whether the AVX-512 kernels take float8_e4m3fn caches beside a bf16 query of this head
    size on this CPU: `paged_prefill_attention` (which has no other kernel) and
    `paged_decode_attention`'s "avx512" path. AVX512_BF16 and AVX512_VBMI (the 8-bit linear's
    decoding), a multiple of 32 up to 256. Where not, prefill refuses fp8 caches (the caller
    converts, `cache.to(bf16) * scale`) and decode takes them on its "avx2" path."""
    served: bool = _ops().fp8_kv_attention_serves(head_dim)
    return served


def fp8_kv_decode_path(head_dim: int) -> str:
    """The path `paged_decode_attention(..., path="auto")` takes for float8_e4m3fn caches beside
    a bf16 query of this head size: "avx512" where `fp8_kv_attention_serves(head_dim)`, else
    "avx2" (any head size, any CPU the kernels run on)."""
    return "avx512" if fp8_kv_attention_serves(head_dim) else "avx2"


def paged_decode_attention(
    query: torch.Tensor,  # [B, H, D], one token per sequence; each row's heads contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32 or int64
    kv_lens: torch.Tensor,  # [B] int64, >= 1; the query sits at position kv_len - 1
    scale: float,
    sliding_window: int = 0,  # > 0: attend only to the last `sliding_window` positions
    path: str = "auto",
    *,
    softcap: float = 0.0,  # > 0: scores become softcap * tanh(score / softcap) (Gemma 2)
    k_scale: float = 1.0,  # float8_e4m3fn caches: a byte stands for its value times its scale
    v_scale: float = 1.0,
) -> torch.Tensor:  # [B, H, D] in query's dtype
    """Softmax attention of each query over its sequence's cached K/V, read through the table.

    Query head h uses kv head h // (H // Hkv). All of query, k_cache, v_cache are bf16 or all fp32;
    products are exact and sums fp32. `path` picks the kernel: "auto" takes "avx512" (bf16 on an
    AVX512_BF16 CPU, head size a multiple of 32 up to 256) where it can, else "avx2" (any case).
    Tests name paths to check each one.

    fp8 caches (float8_e4m3fn or float8_e5m2) with a bf16 query: both paths ("auto" takes
    `fp8_kv_decode_path(D)`).
    They decode the bytes as they read them (AVX-512: to bf16; AVX2: each block's rows to fp32
    once per task) and apply the scales in fp32 outside the sums: scores use
    `fp32(scale) * fp32(k_scale)` as their scale, the output is `acc * (v_scale / sum)`. With both
    scales 1 (or powers of two) each path's output is bit-identical to the same path's on the bf16
    caches `cache.to(bf16) * scale`.
    """
    out: torch.Tensor = _ops().paged_decode_attention(
        query,
        k_cache,
        v_cache,
        block_tables,
        kv_lens,
        scale,
        sliding_window,
        softcap,
        path,
        k_scale,
        v_scale,
    )
    return out


def paged_prefill_attention(
    query: torch.Tensor,  # [Q, H, D] bf16: one sequence's new tokens; heads contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] bf16, holding the new tokens too
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,  # [>= ceil(kv_len / block_size)] int64: the sequence's blocks
    kv_len: int,  # the queries sit at positions kv_len - Q .. kv_len - 1
    scale: float,
    sliding_window: int = 0,  # > 0: each query attends only its last `sliding_window` positions
    kernel: str = "avx512",
    *,
    k_scale: float = 1.0,  # float8_e4m3fn caches: a byte stands for its value times its scale
    v_scale: float = 1.0,
) -> torch.Tensor:  # [Q, H, D] bf16
    """Causal softmax attention of a prefill chunk over its sequence's cached K/V (any cached
    prefix included), read through the block table. AVX512_BF16 CPUs, head sizes a multiple of 32
    up to 256; products exact, sums fp32, p rounded to bf16 before p @ v (as torch's flash
    kernel does). `kernel` "amx": both products on AMX tiles (needs `has_amx_bf16()`).

    fp8 caches, E4M3 or E5M2 (where `fp8_kv_attention_serves(D)`, either kernel): the sequence's
    blocks are decoded to bf16 once per call, the scales applied as `paged_decode_attention`
    applies them; bit-identical to the bf16 caches `cache.to(bf16)` with unit scales."""
    out: torch.Tensor = _ops().paged_prefill_attention(
        query, k_cache, v_cache, block_ids, kv_len, scale, sliding_window, kernel, k_scale, v_scale
    )
    return out


def write_kv_(
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    key: torch.Tensor,  # [T, Hkv, D]; any token stride (a view of qkv), heads contiguous
    value: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, slot = block_id * block_size + offset
    k_scale: float = 1.0,  # float8_e4m3fn caches only: the stored byte is e4m3(x / scale)
    v_scale: float = 1.0,
) -> None:
    """`kernels.kv_write.write_kv_slots` in one op: no copy of strided key/value first, and every
    slot is checked against the cache before anything is written.

    Caches of key's dtype take the rows as they are. fp8 caches take bf16 or fp32 rows, each value
    stored as torch's `(x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)` (E5M2:
    `.clamp(-57344, 57344).to(torch.float8_e5m2)`)
    (round to nearest even, saturating: no NaN but from a NaN)."""
    _ops().write_kv_(k_cache, v_cache, key, value, slot_mapping, k_scale, v_scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """bf16 RMSNorm of each row of x [T, hidden], bit-identical to the reference torch ops."""
    out: torch.Tensor = _ops().rms_norm(x, weight, eps)
    return out


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's bf16 RMSNorm of each row of x [T, hidden]: scaled by `1 + weight` in fp32,
    rounded once (gpu_worker.layers.norm.OffsetRMSNorm)."""
    out: torch.Tensor = _ops().offset_rms_norm(x, weight, eps)
    return out


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`x += delta` in place (the residual), then returns `rms_norm(x)`; bf16."""
    out: torch.Tensor = _ops().add_rms_norm(x, delta, weight, eps)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 * I] bf16 -> [T, I]
    """`F.silu(gate) * up` for `gate, up = gate_up.split(I, -1)`, in one pass; bf16."""
    out: torch.Tensor = _ops().silu_mul(gate_up)
    return out


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 * I] bf16 -> [T, I]
    """`F.gelu(gate, approximate="tanh") * up` (GeGLU) for `gate, up = gate_up.split(I, -1)`, in
    one pass; bf16. The GELU as `gate * sigmoid(2y)` (= 0.5 gate (1 + tanh(y))), agreeing with
    torch's to fp32 rounding: the bf16 results match it but for rare 1-ulp differences."""
    out: torch.Tensor = _ops().gelu_tanh_mul(gate_up)
    return out


def rotary_qk_(
    qkv: torch.Tensor,  # [T, (H + 2 * Hkv) * D] bf16, rows contiguous
    cos: torch.Tensor,  # [T, D] bf16
    sin: torch.Tensor,  # [T, D] bf16
    num_heads: int,  # q heads + k heads: the leading heads of each row to rotate
    head_dim: int,
) -> None:
    """Rotary embedding in place on the q and k heads of a fused qkv activation."""
    _ops().rotary_qk_(qkv, cos, sin, num_heads, head_dim)


def op_program(num_inputs: int) -> Any:
    """An empty OpProgram (op_program.cpp) over `num_inputs` input tensors; kernels/replay.py
    fills it from recorded op calls and runs it."""
    _ops()  # builds and loads the library, which registers the class
    return torch.classes.tgq_cpu_ops.OpProgram(num_inputs)


def apply_token_mask_(
    logits: torch.Tensor,  # [N, V] fp32, contiguous: changed in place
    words: torch.Tensor,  # [n, W] int32: row rows[i]'s allowed tokens, bit t % 32 of word t // 32
    rows: torch.Tensor,  # [n] int64
) -> None:
    """Sets to -inf every logit of row `rows[i]` whose token is not allowed by `words[i]`
    (columns past `32 * W` included)."""
    _ops().apply_token_mask_(logits, words, rows)


def argmax(x: torch.Tensor) -> torch.Tensor:  # [N, V] fp32 -> [N] int64
    """`x.argmax(-1)` (the first of equal maxima; the first NaN, if any), vectorised: torch's
    CPU argmax is scalar and slow over logits."""
    out: torch.Tensor = _ops().argmax_rows(x)
    return out
