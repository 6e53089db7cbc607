"""Linear layer whose matmul goes to the kernel measured fastest for its call size, over bf16
weights, 8-bit ones (`--quantize int8|fp8`, compressed-tensors checkpoints) or integer weights in
groups (GPTQ, AWQ and compressed-tensors int4 checkpoints, `gpu_worker.grouped`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tgq.gpu_worker.layers.activation_quant import ActivationQuant
from tgq.kernels import cpu_ops
from tgq.kernels.choice import Measured, kernel_for, measure

MatmulFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

# What a CPU bf16 linear can run on: the own kernels over the packed weights
# (`cpu_ops.linear_bf16_packed`), or torch's F.linear (oneDNN) over the [N, K] weights.
PACKED_KERNELS = ("avx512", "amx")
TORCH = "torch"
# torch's F.linear must be this much faster than the packed kernels to be picked beside them.
TORCH_HANDICAP = 1.1


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, *, bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # [N, K]
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.matmul: MatmulFn = F.linear
        self.weight_rows: torch.Tensor | None  # [N, K] kept beside packed weights
        self.register_buffer("weight_rows", None, persistent=False)
        # fp32 scales: [N] of 8-bit weights (`quantize`), [N, G] of grouped ones (`hold_grouped`)
        self.weight_scale: torch.Tensor | None
        self.register_buffer("weight_scale", None, persistent=False)
        self.input_quant: ActivationQuant | None = None  # W8A8 checkpoints' input rounding
        # Grouped integer weights (`hold_grouped`): zero points [N, G] fp32, each input column's
        # group [K], and on the 4-bit kernel the input columns in group order (None: K's order).
        # Buffers, so that a recorded decode step (kernels.replay) takes them as constants.
        self.weight_zero: torch.Tensor | None
        self.register_buffer("weight_zero", None, persistent=False)
        self.weight_g_idx: torch.Tensor | None
        self.register_buffer("weight_g_idx", None, persistent=False)
        self.weight_perm: torch.Tensor | None
        self.register_buffer("weight_perm", None, persistent=False)
        # INT8 W8A8 on the VNNI kernel (`use_vnni_kernel`): 128 * each column's sum of w [N]
        self.weight_offset: torch.Tensor | None
        self.register_buffer("weight_offset", None, persistent=False)
        # LoRA adapters' low-rank terms (`gpu_worker.lora.LoraTerm`): (x, out) -> out, each row
        # plus its adapter's term, added to what the matmul above returns.
        self.lora: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        out = self.matmul(x, self.weight, self.bias)
        return out if self.lora is None else self.lora(x, out)

    @property
    def is_quantized(self) -> bool:
        """Whether `weight` holds 8-bit values (`quantize`) or grouped integers (`hold_grouped`),
        packed or not."""
        return self.weight_scale is not None

    def quantize(self, method: str, amax: torch.Tensor | None = None) -> None:
        """The weights as 8-bit values, int8 or FP8 E4M3 by `method`, with one scale per output
        row (`quantize_rows`; `amax`: the rows' largest magnitudes where this layer holds only
        part of each row); the layer's output is then `(x @ w^T) * scale + bias`, summed in fp32,
        on torch until `use_8bit_kernel`."""
        self.hold_quantized(*quantize_rows(self.weight.detach(), method, amax))

    def hold_quantized(
        self, q: torch.Tensor, scale: torch.Tensor, input_quant: ActivationQuant | None = None
    ) -> None:
        """8-bit weights `q` [N, K] (int8 or float8_e4m3fn) and their scales [N] fp32, as
        quantized at load or stored by a checkpoint; `input_quant`: each input quantized and
        dequantized first (a W8A8 checkpoint's activations). On torch until `use_8bit_kernel`."""
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = scale
        self.input_quant = input_quant
        self.matmul = _QuantizedMatmul(self, packed=False)

    def hold_grouped(
        self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, g_idx: torch.Tensor
    ) -> None:
        """Integer weights in groups of input columns (`gpu_worker.grouped`): q [N, K] uint8,
        scale and zero [N, G] fp32, column k in group g_idx[k]; w = (q - zero) * scale. On
        torch until `use_quantized_kernel`."""
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = scale
        self.weight_zero = zero
        self.weight_g_idx = g_idx
        self.matmul = _GroupedMatmul(self)

    def use_quantized_kernel(self) -> bool:
        """A quantized layer onto its CPU kernel where this CPU has it and the weights fit it
        (8-bit: `use_8bit_kernel`, or `use_vnni_kernel` for INT8 W8A8 where `runs_on_vnni`;
        grouped 4-bit: `cpu_ops.linear_int4_packed`, the columns
        permuted once so that each group is a contiguous run); whether it moved."""
        if self.weight_zero is None or self.weight_g_idx is None:
            kernel = cpu_ops.eight_bit_kernel()
            if kernel is None:
                return False
            if self.runs_on_vnni:
                self.use_vnni_kernel()
            else:
                self.use_8bit_kernel(kernel)
            return True
        q = self.weight.detach()
        layout = contiguous_groups(q, self.weight_g_idx, self.weight_zero.shape[1])
        if layout is None or not cpu_ops.has_int4_linear():
            return False
        perm, group_size = layout
        q = q if perm is None else q[:, perm]
        packed = cpu_ops.pack_weight_int4(q.contiguous(), group_size)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.weight_perm = perm
        self.matmul = _GroupedMatmul(self, group_size=group_size)
        return True

    @property
    def runs_on_vnni(self) -> bool:
        """Whether this layer is an INT8 W8A8 one (int8 weights, inputs quantized to int8) that
        this CPU runs as integers (`use_vnni_kernel`: AVX512_VNNI and AVX512_BF16)."""
        quant = self.input_quant
        return (
            quant is not None
            and quant.dtype == torch.int8
            and self.weight.dtype == torch.int8
            and self.weight.dim() == 2
            and self.in_features <= cpu_ops.VNNI_MAX_K
            and cpu_ops.has_vnni_w8a8_linear()
        )

    @property
    def on_vnni_kernel(self) -> bool:
        """Whether this layer runs on the VNNI kernel (`use_vnni_kernel`)."""
        return isinstance(self.matmul, _VnniMatmul)

    def use_vnni_kernel(self) -> None:
        """An INT8 W8A8 layer on `cpu_ops.linear_w8a8_vnni`: the inputs' int8 codes times the
        weights summed exactly in int32, times both scales (vLLM's int8 scaled matmul; the torch
        path multiplies the codes back by their scale in x's dtype first)."""
        q = self.weight.detach()
        self.weight_offset = cpu_ops.vnni_offset(q)
        self.weight = nn.Parameter(cpu_ops.pack_weight_vnni(q), requires_grad=False)
        self.matmul = _VnniMatmul(self)

    @property
    def is_grouped(self) -> bool:
        """Whether `weight` holds grouped integer weights (`hold_grouped`), packed or not."""
        return self.weight_zero is not None

    @property
    def on_int4_kernel(self) -> bool:
        """Whether grouped weights run on the 4-bit kernel (`use_quantized_kernel`)."""
        return isinstance(self.matmul, _GroupedMatmul) and self.matmul.group_size > 0

    def use_8bit_kernel(self, kernel: str = "avx512") -> None:
        """A quantized layer on `cpu_ops.linear_8bit_packed`, its weights packed once for
        `kernel` ("avx512": AVX512_BF16 and VBMI, the same sums as the bf16 kernel over w as bf16;
        "avx2": any CPU the kernels run on), times the scales."""
        if not isinstance(self.matmul, _QuantizedMatmul) or self.matmul.packed:
            raise ValueError("use_8bit_kernel: the layer is not quantized on torch (quantize)")
        packed = cpu_ops.pack_weight_8bit(self.weight.detach(), kernel)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.matmul = _QuantizedMatmul(self, packed=True)

    @property
    def is_packed(self) -> bool:
        """Whether `weight` holds the packed layout (`use_kernels` with a packed kernel)."""
        return isinstance(self.matmul, _ChosenMatmul)

    def use_kernels(self, thresholds: Sequence[tuple[int, str]], *, out_fp32: bool) -> None:
        """Runs a call of M rows on the kernel of the first `(largest rows, kernel)` entry with
        M <= largest rows (the last entry past them all; `kernels.choice.Choices.thresholds`).
        Where a packed kernel is among them, `weight` becomes the packed layout
        (`cpu_ops.pack_weight_bf16`); where torch is too, the [N, K] tensor stays as the buffer
        `weight_rows` (both layouts in memory: the price of a choice that measured faster). The
        [N, K] parameter is otherwise released unless something else holds it (tied embeddings,
        the greedy head). `out_fp32`: fp32 results (logits)."""
        kernels = {kernel for _, kernel in thresholds}
        if kernels - {TORCH, *PACKED_KERNELS}:
            raise ValueError(f"unknown linear kernels {sorted(kernels)}")
        rows = self.weight.detach()
        if kernels == {TORCH}:
            self.matmul = _torch_fp32 if out_fp32 else F.linear
            return
        self.weight = nn.Parameter(cpu_ops.pack_weight_bf16(rows), requires_grad=False)
        if TORCH in kernels:
            self.weight_rows = rows
        self.matmul = _ChosenMatmul(self, list(thresholds), out_fp32=out_fp32)


class _ChosenMatmul:
    """`Linear.matmul` over packed weights: the kernel for the call's row count."""

    def __init__(
        self, linear: Linear, thresholds: list[tuple[int, str]], *, out_fp32: bool
    ) -> None:
        self.linear = linear
        self.thresholds = thresholds
        self.out_fp32 = out_fp32

    def __call__(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        kernel = kernel_for(self.thresholds, x.shape[0])
        if kernel == TORCH:
            assert self.linear.weight_rows is not None
            out = F.linear(x, self.linear.weight_rows, bias)
            return out.float() if self.out_fp32 else out
        return cpu_ops.linear_bf16_packed(
            x, packed, self.linear.out_features, bias, out_fp32=self.out_fp32, kernel=kernel
        )


class _QuantizedMatmul:
    """`Linear.matmul` over 8-bit weights: the AVX-512 or AVX2 kernel over its packed layout, or
    torch (any CPU or GPU: the sums in fp32 over the weights' values, times the scales, rounded
    once to x's dtype, as the kernels round them)."""

    def __init__(self, linear: Linear, *, packed: bool) -> None:
        self.linear = linear
        self.packed = packed

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        scale = self.linear.weight_scale
        assert scale is not None
        if self.linear.input_quant is not None:
            x = self.linear.input_quant(x)
        if self.packed:
            return cpu_ops.linear_8bit_packed(x, weight, scale, self.linear.out_features, bias)
        out = F.linear(x.float(), weight.float()) * scale
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype)


class _VnniMatmul:
    """`Linear.matmul` of an INT8 W8A8 layer on the VNNI kernel (`Linear.use_vnni_kernel`)."""

    def __init__(self, linear: Linear) -> None:
        self.linear = linear

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        linear, quant = self.linear, self.linear.input_quant
        assert linear.weight_scale is not None and linear.weight_offset is not None and quant
        return cpu_ops.linear_w8a8_vnni(
            x, weight, linear.weight_offset, linear.weight_scale, linear.out_features, bias,
            per_token=quant.per_token, static_scale=quant.static_scale,
        )  # fmt: skip


INT4_LARGEST = 15


def contiguous_groups(
    q: torch.Tensor, g_idx: torch.Tensor, groups: int
) -> tuple[torch.Tensor | None, int] | None:
    """For 4-bit values q [N, K] with column k in group g_idx[k] of `groups`: (the column order
    that makes every group a run of one size, the last maybe shorter, None where K's order does;
    that size, a multiple of 8 or K), or None where there is none (8-bit values, or groups of
    uneven sizes)."""
    if q.numel() and int(q.max()) > INT4_LARGEST:
        return None
    columns = g_idx.shape[0]
    perm = torch.argsort(g_idx, stable=True)
    in_order = g_idx[perm]
    size = int((in_order == 0).sum())
    if size == 0 or (size % 8 and size != columns):
        return None
    if not torch.equal(in_order, torch.arange(columns) // size) or int(in_order[-1]) + 1 != groups:
        return None
    return (None if torch.equal(perm, torch.arange(columns)) else perm), size


class _GroupedMatmul:
    """`Linear.matmul` over grouped integer weights: the AVX-512 4-bit kernel over the packed
    layout (`perm`: the input columns in group order), or torch (any CPU or GPU: the weights
    dequantized exactly to fp32, w = (q - zero) * scale, the sums in fp32, rounded once to x's
    dtype)."""

    def __init__(self, linear: Linear, *, group_size: int = 0) -> None:
        self.linear = linear
        self.group_size = group_size  # 0: on torch

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        linear = self.linear
        scale, zero, g = linear.weight_scale, linear.weight_zero, linear.weight_g_idx
        assert scale is not None and zero is not None and g is not None
        if self.group_size:
            if linear.weight_perm is not None:
                x = x.index_select(1, linear.weight_perm)
            return cpu_ops.linear_int4_packed(
                x, weight, scale, zero, self.group_size, linear.out_features, bias
            )
        w = (weight.float() - zero[:, g]) * scale[:, g]
        out = F.linear(x.float(), w, None if bias is None else bias.float())
        return out.to(x.dtype)


# `--quantize` methods: the dtype their weights are held in and its largest finite value.
QUANTIZED_DTYPES = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}


def quantize_rows(
    weight: torch.Tensor, method: str, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q [N, K], scale [N] fp32), symmetric per output row with scale =
    max |w| / (the format's largest value) in fp32 (1 for an all-zero row): `int8` rounds w /
    scale half to even into [-127, 127]; `fp8` converts w / scale to FP8 E4M3 (nearest, ties
    to even; |w / scale| <= 448 by construction). Dequantized, q * scale. `amax` [N] fp32: the
    rows' max |w| when `weight` holds part of each row (a row-parallel rank's slice), so that the
    slices quantize as the whole rows would."""
    dtype, largest = QUANTIZED_DTYPES[method]
    w = weight.float()
    if amax is None:
        amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / largest, torch.ones_like(amax))
    scaled = (w / scale[:, None]).clamp_(-largest, largest)
    if dtype == torch.int8:
        scaled = torch.round(scaled)
    return scaled.to(dtype), scale


def _torch_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias).float()


def linear_candidates(in_features: int) -> list[str]:
    """The kernels a bf16 linear with K = `in_features` can run on this CPU."""
    names = [TORCH]
    if cpu_ops.has_avx512_bf16():
        names.append("avx512")
        if cpu_ops.has_amx_bf16() and in_features % 32 == 0:
            names.append("amx")
    return names


def measure_linears(
    op: str,
    linears: Sequence[Linear],
    rows: Sequence[int],
    *,
    out_fp32: bool = False,
    prune: float = 5.0,
) -> list[Measured]:
    """Times `linears` ([N, K] bf16 weights, before `use_kernels`) called one after another, as
    a layer runs them, on each candidate kernel they all can run, at each row count. A
    candidate over 5x slower than the fastest at one row count is not timed at larger ones.
    Where the packed kernels are candidates, torch is picked only where it is more than 10%
    faster than them (it needs a second copy of the weights beside the packed one)."""
    names = set.intersection(*(set(linear_candidates(m.in_features)) for m in linears))
    weights = [m.weight.detach() for m in linears]
    packed = [cpu_ops.pack_weight_bf16(w) for w in weights] if names != {TORCH} else []
    gen = torch.Generator().manual_seed(0)

    def inputs(count: int) -> list[torch.Tensor]:
        return [torch.randn(count, w.shape[1], generator=gen).bfloat16() for w in weights]

    def torch_call(count: int) -> Callable[[], object]:
        xs = inputs(count)
        return lambda: [
            F.linear(x, w).float() if out_fp32 else F.linear(x, w)
            for x, w in zip(xs, weights, strict=True)
        ]

    def packed_call(kernel: str) -> Callable[[int], Callable[[], object]]:
        def make(count: int) -> Callable[[], object]:
            xs = inputs(count)
            return lambda: [
                cpu_ops.linear_bf16_packed(x, p, w.shape[0], out_fp32=out_fp32, kernel=kernel)
                for x, p, w in zip(xs, packed, weights, strict=True)
            ]

        return make

    makers = {name: torch_call if name == TORCH else packed_call(name) for name in sorted(names)}
    return measure(op, makers, rows, {TORCH: TORCH_HANDICAP} if packed else None, prune=prune)
