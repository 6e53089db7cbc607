"""Greedy tokens without reading the whole lm_head: an int8 screen, then exact logits for the few
columns that could win.

A greedy row with no logprobs and no penalties needs only the argmax of its logits. On a CPU the
batch-1 decode step waits on DRAM, and the lm_head is a fifth of its weights (the medium model's
32000 x 768). `GreedyHead` keeps an int8 copy of the head (per-column scale, 1 byte per weight),
bounds how far each column's screened value can be from the logit the bf16 kernel would compute
(`kernels/csrc/greedy_head_avx512.cpp` has the argument), and computes exact logits only for the
columns whose upper bound reaches the best lower bound. The token is the one
`argmax(linear_bf16_packed(x, packed, N, out_fp32=True))` picks, ties included; a row with more
than `max_candidates` candidates (e.g. all-equal logits) is computed in full instead.

Two references, as the model computes its lm_head. With a packed head (AVX512_BF16 CPUs; the
screen needs AVX512_VNNI too, `cpu_ops.has_avx512_vnni_bf16`) the tokens are those of the packed
kernel's logits, and where the CPU has AMX-INT8 the screen can also run on tiles (the same integer
sums, so the same tokens); `choose_kernels` times both and picks per number of rows (AMX took half
the VNNI screen's time at 64 rows on an AMX Xeon, and lost at 4). Without one (every other CPU the
kernels run on) the head runs `linear_bf16`'s AVX2 kernel, whose rounding depends on how many rows
share a call: the tokens are then those of each row's logits computed alone (kernel "avx2",
`kernels/csrc/greedy_head_avx2.cpp`), so a greedy row's token does not depend on its batch.
Memory: the int8 screen
(N x K bytes) next to the packed bf16 head, and the head's [N, K] rows, which the candidates'
exact logits read (a tied head shares them with the embedding; an untied one keeps them: 2 N x K
bytes more, 49 MB for the medium model, 1 GiB for Llama 3's 128k x 4096 head).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tgq.kernels import cpu_ops
from tgq.kernels.choice import Choices, Measured, choose, kernel_for, measure

# Candidates past this many per row: the row is computed in full (measured on the medium random
# model: a few dozen per row).
MAX_CANDIDATES = 1024
# Weights past this magnitude (or non-finite) get no screen: the kernel's bound on denormal
# flushes assumes |w| <= 2^16.
MAX_WEIGHT = 2.0**16
_COLUMNS = 16  # a packed tile's output columns
_QUAD = 4  # K values per int8 lane (vpdpbusd)
_ROWS_PER_CHUNK = 4096  # weight rows quantized at a time (float64 working copies)
# Greedy rows per call the screen's kernels are timed at (kernels.choice).
SCREEN_BUCKETS = (1, 4, 16, 64, 256)


@dataclass(frozen=True, slots=True)
class GreedyScreen:
    screen: torch.Tensor  # [ceil(N/16), K/4, 16, 4] int8
    scale: torch.Tensor  # [N] fp32: w[n] ~ scale[n] * q[n]
    q_sum: torch.Tensor  # [N] int32
    bound_x: torch.Tensor  # [N] fp32: |e[n]| + gamma_K |w[n]|, rounded up
    bound_ex: torch.Tensor  # [N] fp32: |e[n]| + |w[n]|, rounded up


def screen_unsupported_reason(weight: torch.Tensor) -> str | None:
    """Why `build_screen(weight)` cannot serve this weight here (None: it can)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return "needs a 2-d bf16 CPU weight"
    if not cpu_ops.is_available():
        return "needs the CPU kernels"
    if weight.shape[1] % _QUAD != 0:
        return f"needs K a multiple of {_QUAD}, got {weight.shape[1]}"
    # Row chunks: a whole-head abs() would be a second copy of the head (1 GiB for Llama 3's).
    # A NaN makes its chunk's maximum NaN, which fails the comparison too.
    for start in range(0, weight.shape[0], _ROWS_PER_CHUNK):
        if not float(weight[start : start + _ROWS_PER_CHUNK].abs().amax()) <= MAX_WEIGHT:
            return f"needs finite weights of magnitude <= {MAX_WEIGHT:g}"
    return None


def _round_up_fp32(values: torch.Tensor) -> torch.Tensor:
    """float64 -> the smallest fp32 values >= them."""
    rounded = values.float()
    low = rounded.double() < values
    return torch.where(low, torch.nextafter(rounded, torch.tensor(math.inf)), rounded)


def build_screen(weight: torch.Tensor) -> GreedyScreen:
    """The int8 screen of an [N, K] bf16 weight and its per-column error bounds."""
    reason = screen_unsupported_reason(weight)
    if reason is not None:
        raise ValueError(f"greedy screen: {reason}")
    return _quantize(weight)


def _quantize(weight: torch.Tensor) -> GreedyScreen:
    num_rows, k = weight.shape
    # K roundings of an fp32 sum, each within one unit in the last place (not only half of
    # one: the bound holds whichever rounding the CPU's vdpbf16ps applies inside)
    ulp = 2.0**-23
    gamma = k * ulp / (1 - k * ulp) * 1.01
    quantized = torch.empty(num_rows, k, dtype=torch.int8)
    scale = torch.empty(num_rows, dtype=torch.float32)
    bound_x = torch.empty(num_rows, dtype=torch.float64)
    bound_ex = torch.empty(num_rows, dtype=torch.float64)
    for start in range(0, num_rows, _ROWS_PER_CHUNK):
        rows = slice(start, start + _ROWS_PER_CHUNK)
        w = weight[rows].double()
        s = (w.abs().amax(dim=1) / 127).float()
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = torch.round(w / s.double()[:, None]).clamp_(-127, 127)
        # exact in float64: bf16 minus an fp32 scale times an integer below 2^7
        err = (w - s.double()[:, None] * q).norm(dim=1)
        norm = w.norm(dim=1)
        quantized[rows] = q.to(torch.int8)
        scale[rows] = s
        bound_x[rows] = err + gamma * norm
        bound_ex[rows] = err + norm
    tiles = -(-num_rows // _COLUMNS)
    padded = torch.zeros(tiles * _COLUMNS, k, dtype=torch.int8)
    padded[:num_rows] = quantized
    screen = padded.view(tiles, _COLUMNS, k // _QUAD, _QUAD).permute(0, 2, 1, 3).contiguous()
    return GreedyScreen(
        screen=screen,
        scale=scale,
        q_sum=quantized.sum(dim=1, dtype=torch.int32),
        bound_x=_round_up_fp32(bound_x * (1 + 1e-6)),
        bound_ex=_round_up_fp32(bound_ex * (1 + 1e-6)),
    )


def screen_kernels(k: int, *, packed: bool = True) -> list[str]:
    """The kernels that can screen a head with K = `k` here: for a `packed` head "avx512" (VNNI;
    none without AVX512_BF16 and AVX512_VNNI), and "amx" (AMX-INT8 tiles) where the CPU has them
    and K is a multiple of 64; for an unpacked one (the AVX2 kernel's logits) "avx2"."""
    if not packed:
        return ["avx2"]
    if not cpu_ops.has_avx512_vnni_bf16():
        return []
    names = ["avx512"]
    if k % 64 == 0 and cpu_ops.has_amx_int8():
        names.append("amx")
    return names


class GreedyHead:
    """argmax over `x @ weight^T` for bf16 rows x, as the lm_head's kernel computes the logits."""

    def __init__(
        self,
        packed: torch.Tensor | None,  # pack_weight_bf16(weight), or None: the AVX2 kernel's
        weight: torch.Tensor,  # [N, K] bf16, contiguous
        screen: GreedyScreen,  # build_screen(weight)
        max_candidates: int = MAX_CANDIDATES,
    ) -> None:
        self.packed = packed
        self.weight = weight
        self.out_features = weight.shape[0]
        self.screen = screen
        self.max_candidates = max_candidates
        self.kernels = screen_kernels(weight.shape[1], packed=packed is not None)
        # [(largest rows, kernel)] (kernels.choice); set by choose_kernels where there is a
        # choice.
        self.thresholds: list[tuple[int, str]] = [(1, self.kernels[0])]
        self.choices: Choices | None = None

    @classmethod
    def build(
        cls,
        packed: torch.Tensor | None,
        weight: torch.Tensor,
        max_candidates: int = MAX_CANDIDATES,
        *,
        pick_kernels: bool = False,
    ) -> GreedyHead | None:
        """The head over `weight` and its packed copy (None: the head runs the AVX2 kernel);
        None where the screen cannot serve this weight here (`screen_unsupported_reason`, or no
        screen kernel for a packed head). With `pick_kernels`, its screen kernels are chosen by
        measurement (`choose_kernels`)."""
        if screen_unsupported_reason(weight) is not None:
            return None
        if not screen_kernels(weight.shape[1], packed=packed is not None):
            return None
        weight = weight.contiguous()
        head = cls(packed, weight, _quantize(weight), max_candidates)
        if pick_kernels:
            head.choose_kernels()
        return head

    def choose_kernels(self) -> Choices | None:
        """Runs each call on the screen kernel measured fastest for its number of rows
        (`measure_kernels` at `SCREEN_BUCKETS`; kernels.choice, cached per CPU and shape). None
        where only one kernel can run here."""
        if len(self.kernels) < 2:
            return None
        self.choices = choose(
            {"greedy_head": list(self.weight.shape)}, lambda: self.measure_kernels(SCREEN_BUCKETS)
        )
        self.thresholds = self.choices.thresholds("greedy_head")
        return self.choices

    def measure_kernels(self, rows: Sequence[int]) -> list[Measured]:
        """Times the screen's kernels (`screen_kernels`) at each row count, on random rows."""
        gen = torch.Generator().manual_seed(0)

        def candidate(kernel: str) -> Callable[[int], Callable[[], object]]:
            def make(count: int) -> Callable[[], object]:
                x = torch.randn(count, self.weight.shape[1], generator=gen).bfloat16()
                return lambda: self._screen(x, None, kernel)

            return make

        return measure("greedy_head", {name: candidate(name) for name in self.kernels}, rows)

    def _screen(self, x: torch.Tensor, masks: torch.Tensor | None, kernel: str) -> torch.Tensor:
        s = self.screen
        return cpu_ops.greedy_head_argmax(
            x, self.weight, s.screen, s.scale, s.q_sum, s.bound_x, s.bound_ex,
            self.max_candidates, masks, kernel=kernel,
        )  # fmt: skip

    def argmax(
        self,
        x: torch.Tensor,  # [M, K] bf16
        masks: torch.Tensor | None = None,  # [M, W] int32: a grammar's allowed tokens per row
    ) -> torch.Tensor:  # [M] int64
        """Each row's argmax; with `masks`, over the tokens its mask allows only (the masked
        argmax of the full logits)."""
        tokens = self._screen(x, masks, kernel_for(self.thresholds, x.shape[0]))
        full = [row for row, token in enumerate(tokens.tolist()) if token < 0]
        if full:  # too many candidates (or non-finite x): these rows in full
            logits = self.full_logits(x[full])
            if masks is not None:
                cpu_ops.apply_token_mask_(logits, masks[full], torch.arange(len(full)))
            tokens[full] = cpu_ops.argmax(logits)
        return tokens

    def full_logits(self, x: torch.Tensor) -> torch.Tensor:
        """[M, N] fp32: the logits whose argmax the screen picks (the packed kernel's, or the AVX2
        kernel's for each row alone)."""
        if self.packed is not None:
            return cpu_ops.linear_bf16_packed(x, self.packed, self.out_features, out_fp32=True)
        rows = [
            cpu_ops.linear_bf16(row[None], self.weight, None, "avx2", out_fp32=True) for row in x
        ]
        return torch.cat(rows) if rows else x.new_empty(0, self.out_features, dtype=torch.float32)
