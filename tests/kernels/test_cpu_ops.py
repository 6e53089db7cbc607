"""The AVX2 CPU kernels against plain fp32 torch references."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.markers import requires_kernels
from tests.kernels.numerics import rel_err
from tgq.kernels import cpu_ops
from tgq.kernels.kv_write import write_kv_slots


@requires_kernels
def test_kernels_build_on_a_cpu_that_supports_them() -> None:
    assert cpu_ops.is_available(), cpu_ops.unavailable_reason()


@requires_kernels
def test_a_build_killed_midway_does_not_hang_the_next_start() -> None:
    """torch leaves its `lock` file behind when a build is killed, and waits for it forever;
    the next start must clear it (here: this session's build cache, given such a file; the
    tests run one at a time, so nothing else reads the cache meanwhile)."""
    assert cpu_ops.is_available(), cpu_ops.unavailable_reason()
    default = Path.home() / ".cache" / "tgq" / "kernels"
    cache = Path(os.environ.get("TGQ_KERNEL_CACHE", default))
    stale = cache / "lock"
    stale.touch()
    code = "from tgq.kernels import cpu_ops; print(cpu_ops.is_available())"
    try:
        done = subprocess.run(
            [sys.executable, "-c", code],
            check=False,
            env={**os.environ, "TGQ_KERNEL_CACHE": str(cache)},
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        stale.unlink(missing_ok=True)  # a failure here must not hang the later tests
    assert done.stdout.strip() == "True", done.stderr[-2000:]


@requires_kernels
def test_the_build_precompiles_the_torch_headers_only_when_it_compiles_enough(
    tmp_path: Path,
) -> None:
    """A new cache compiles every file, a built one none (this session's); the header flags
    are the same either way (a change would make ninja rebuild everything) and the .gch is made
    only when asked. Made with the flags torch wrote for this session's build (its
    build.ninja), a precompiled header is valid: GCC uses it (`-H` names it) and says nothing
    under `-Winvalid-pch`. (A small header stands in for the torch headers: the flags are what
    is checked, and the torch headers take ~10 s to precompile.)"""
    assert cpu_ops._compiles(tmp_path) == len(cpu_ops._SOURCES)
    assert cpu_ops.is_available(), cpu_ops.unavailable_reason()
    default = Path.home() / ".cache" / "tgq" / "kernels"
    cache = Path(os.environ.get("TGQ_KERNEL_CACHE", default))
    assert cpu_ops._compiles(cache) == 0
    small = tmp_path / "small.h"
    small.write_text("#pragma once\n#include <c10/util/BFloat16.h>\n")
    folder = tmp_path / "pch"
    header = folder / "tgq_pch.h"
    text_only = cpu_ops._precompiled_header(folder, compiles=False, headers=small)
    assert text_only == ["-include", str(header)] and not header.with_suffix(".h.gch").exists()
    assert cpu_ops._precompiled_header(folder, compiles=True, headers=small) == text_only
    assert header.with_suffix(".h.gch").is_file()
    # The session build's own compile flags, its -include pointed at the small header.
    cflags = next(
        line.partition("=")[2].split()
        for line in (cache / "build.ninja").read_text().splitlines()
        if line.startswith("cflags =")
    )
    at = cflags.index("-include")
    assert cflags[at + 1] == str(cache / "pch" / "tgq_pch.h"), cflags
    cflags[at + 1] = str(header)
    source = tmp_path / "uses_it.cpp"
    source.write_text(f'#include "{small}"\nint main() {{ return 0; }}\n')
    command = ["c++", *cflags, "-Winvalid-pch", "-H", "-fsyntax-only", str(source)]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "invalid" not in done.stderr and f"! {header}.gch" in done.stderr, done.stderr[:2000]


# Every path of linear_bf16 that this CPU can run. "avx512" and "native" need AVX512_BF16 (and
# bf16 x); elsewhere they are skipped with that reason, and "auto" means "avx2".
_FAST_BF16 = pytest.mark.skipif(
    not cpu_ops.has_avx512_bf16(), reason="this CPU lacks AVX512_BF16 (avx512 and native paths)"
)
LINEAR_PATHS = [
    "auto",
    "avx2",
    pytest.param("avx512", marks=_FAST_BF16),
    pytest.param("native", marks=_FAST_BF16),
]


def _check_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, path: str
) -> None:
    ref = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    out = cpu_ops.linear_bf16(x, weight, bias, path)
    assert out.dtype == x.dtype
    assert out.shape == ref.shape
    assert rel_err(out, ref) < (1e-2 if x.dtype == torch.bfloat16 else 1e-4)


@requires_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("n", [2304, 37])
@pytest.mark.parametrize("k", [768, 100])
@pytest.mark.parametrize("m", [1, 3, 8, 17, 64, 300])
def test_linear_matches_fp32_reference(
    m: int, k: int, n: int, has_bias: bool, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(m * 7919 + k * 31 + n)
    x = torch.randn(m, k, generator=gen).to(dtype)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16() if has_bias else None
    _check_linear(x, weight, bias, "auto")


@requires_kernels
@pytest.mark.parametrize("path", LINEAR_PATHS)
@pytest.mark.parametrize("k", [1, 8, 24, 31, 32, 40, 72, 200, 2048])
def test_linear_every_path_every_small_batch_and_k_remainder(k: int, path: str) -> None:
    """M = 1..48 crosses every tile shape of the AVX-512 kernel; K crosses its 32-value steps."""
    gen = torch.Generator().manual_seed(k)
    weight = torch.randn(53, k, generator=gen).bfloat16()
    bias = torch.randn(53, generator=gen).bfloat16()
    for m in [*range(1, 18), 24, 33, 48]:
        x = torch.randn(m, k, generator=gen).bfloat16()
        _check_linear(x, weight, bias if m % 2 else None, path)


@requires_kernels
@pytest.mark.parametrize("path", LINEAR_PATHS)
@pytest.mark.parametrize("m", [1, 5, 16, 100])
def test_linear_fp32_output_is_the_rounded_result_widened(m: int, path: str) -> None:
    """out_fp32 (used for logits) returns exactly `linear_bf16(...).float()`."""
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 72, generator=gen).bfloat16()
    weight = torch.randn(301, 72, generator=gen).bfloat16()
    out = cpu_ops.linear_bf16(x, weight, None, path, out_fp32=True)
    assert out.dtype == torch.float32
    assert torch.equal(out, cpu_ops.linear_bf16(x, weight, None, path).float())


@requires_kernels
@pytest.mark.parametrize("k", [1, 8, 24, 40, 72, 200])
def test_linear_fp32_x_small_batch_k_remainders(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    weight = torch.randn(29, k, generator=gen).bfloat16()
    for m in range(1, 8):
        x = torch.randn(m, k, generator=gen)
        assert rel_err(cpu_ops.linear_bf16(x, weight), x @ weight.float().T) < 1e-4


@requires_kernels
@_FAST_BF16
@pytest.mark.parametrize(
    ("path", "message"),
    [("avx512", "path 'avx512' needs bf16 x"), ("native", "path 'native' needs bf16 x")],
)
def test_linear_fast_paths_refuse_fp32_x(path: str, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        cpu_ops.linear_bf16(torch.randn(2, 8), torch.randn(4, 8).bfloat16(), None, path)


@requires_kernels
def test_linear_rejects_unknown_path() -> None:
    with pytest.raises(RuntimeError, match="unknown path 'gpu'"):
        cpu_ops.linear_bf16(torch.randn(2, 8), torch.randn(4, 8).bfloat16(), None, "gpu")


@requires_kernels
def test_linear_long_prefill_spans_several_passes() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1100, 72, generator=gen).bfloat16()
    weight = torch.randn(61, 72, generator=gen).bfloat16()
    bias = torch.randn(61, generator=gen)
    ref = F.linear(x.float(), weight.float(), bias)
    assert rel_err(cpu_ops.linear_bf16(x, weight, bias), ref) < 1e-2


@requires_kernels
def test_linear_accepts_fp32_bias_and_empty_batch() -> None:
    x = torch.randn(0, 64)
    weight = torch.randn(5, 64).bfloat16()
    assert cpu_ops.linear_bf16(x, weight, torch.zeros(5)).shape == (0, 5)


@requires_kernels
@pytest.mark.parametrize(
    ("x", "weight", "message"),
    [
        (torch.randn(2, 8), torch.randn(4, 8), "weight must be bf16"),
        (torch.randn(2, 8), torch.randn(4, 9).bfloat16(), "K mismatch"),
        (torch.randn(2, 8).half(), torch.randn(4, 8).bfloat16(), "x must be bf16 or fp32"),
        (torch.randn(2, 8), torch.randn(8, 4).bfloat16().t(), "weight must be contiguous"),
    ],
)
def test_linear_rejects_bad_inputs(x: torch.Tensor, weight: torch.Tensor, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        cpu_ops.linear_bf16(x, weight)


_PACKED = pytest.mark.skipif(
    not cpu_ops.has_avx512_bf16(), reason="this CPU lacks AVX512_BF16 (the packed kernel)"
)


@requires_kernels
@_PACKED
def test_packed_layout_puts_each_weight_where_the_header_says() -> None:
    n, k = 37, 5
    weight = (torch.arange(n * k).reshape(n, k) % 251).bfloat16()
    packed = cpu_ops.pack_weight_bf16(weight)
    assert packed.shape == (3, 3, 16, 2)
    flat = packed.flatten()
    for row in range(n):
        for col in range(k):
            at = ((row // 16 * 3 + col // 2) * 16 + row % 16) * 2 + col % 2
            assert flat[at] == weight[row, col]
    padding = torch.ones_like(flat, dtype=torch.bool)
    for row in range(n):
        for col in range(k):
            padding[((row // 16 * 3 + col // 2) * 16 + row % 16) * 2 + col % 2] = False
    assert not flat[padding].any()  # zeros past N and K


@requires_kernels
@_PACKED
@pytest.mark.parametrize("k", [1, 3, 32, 33, 768, 2048])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 301])
def test_packed_linear_every_row_form_and_tail(n: int, k: int) -> None:
    """M crosses both register forms (<= 8 rows; groups of 16, a last group of 9-15 padded, a
    remainder of up to 8 rows) and, at 1100 rows, the passes over x; N and K cross the tails."""
    gen = torch.Generator().manual_seed(n * 31 + k)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    packed = cpu_ops.pack_weight_bf16(weight)
    for m in [*range(1, 18), 23, 24, 25, 40, 64, 1100 if n == 17 else 300]:
        x = torch.randn(m, k, generator=gen).bfloat16()
        ref = F.linear(x.float(), weight.float(), bias.float())
        out = cpu_ops.linear_bf16_packed(x, packed, n, bias)
        assert out.dtype == torch.bfloat16 and out.shape == (m, n)
        assert rel_err(out, ref) < 1e-2
        wide = cpu_ops.linear_bf16_packed(x, packed, n, bias, out_fp32=True)
        assert torch.equal(wide, out.float())


@requires_kernels
@_PACKED
def test_packed_linear_rounds_as_torch_and_keeps_nan() -> None:
    """Each output is its fp32 sum rounded to nearest even: with sums exact in fp32 (small
    integers) the result equals torch's; a NaN in x stays a NaN in its row only."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(-4, 5, (16, 64), generator=gen).bfloat16()
    weight = torch.randint(-4, 5, (40, 64), generator=gen).bfloat16()
    packed = cpu_ops.pack_weight_bf16(weight)
    assert torch.equal(cpu_ops.linear_bf16_packed(x, packed, 40), F.linear(x, weight))
    x[3, 7] = float("nan")
    out = cpu_ops.linear_bf16_packed(x, packed, 40)
    assert out[3].isnan().all() and not out[torch.arange(16) != 3].isnan().any()
    assert cpu_ops.linear_bf16_packed(x[:0], packed, 40).shape == (0, 40)


@requires_kernels
@_PACKED
def test_packed_linear_rows_do_not_depend_on_the_batch() -> None:
    """Each row's outputs are bit-identical alone and in batches of every size (both register
    forms sum in the same order), so a request's tokens do not depend on its neighbours."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(40, 768, generator=gen).bfloat16()
    weight = torch.randn(100, 768, generator=gen).bfloat16()
    packed = cpu_ops.pack_weight_bf16(weight)
    alone = torch.cat([cpu_ops.linear_bf16_packed(x[i : i + 1], packed, 100) for i in range(40)])
    for m in [2, 7, 8, 9, 15, 16, 17, 24, 25, 40]:
        assert torch.equal(cpu_ops.linear_bf16_packed(x[:m], packed, 100), alone[:m]), m


_AMX = pytest.mark.skipif(
    not cpu_ops.has_amx_bf16(), reason="this CPU lacks AMX-BF16 (or Linux refuses it)"
)


@requires_kernels
@_AMX
@pytest.mark.parametrize("k", [32, 768, 2080])
@pytest.mark.parametrize("n", [1, 16, 17, 48, 301])
def test_amx_linear_matches_the_reference_at_every_row_tail(n: int, k: int) -> None:
    """The AMX kernel over the same packed weights: rows past a multiple of 16 and 32 (padded),
    one or two tiles per column block, K over several chunks (2080 = 8 chunks + 8 pairs); the
    fp32 output is the bf16 one widened."""
    gen = torch.Generator().manual_seed(n * 7 + k)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    packed = cpu_ops.pack_weight_bf16(weight)
    for m in [1, 15, 16, 17, 31, 32, 33, 100, 600]:
        x = torch.randn(m, k, generator=gen).bfloat16()
        ref = F.linear(x.float(), weight.float(), bias.float())
        out = cpu_ops.linear_bf16_packed(x, packed, n, bias, kernel="amx")
        assert out.dtype == torch.bfloat16 and out.shape == (m, n)
        assert rel_err(out, ref) < 1e-2, m
        wide = cpu_ops.linear_bf16_packed(x, packed, n, bias, out_fp32=True, kernel="amx")
        assert torch.equal(wide, out.float())


@requires_kernels
@_AMX
def test_amx_linear_rounds_as_torch_and_rows_do_not_depend_on_the_batch() -> None:
    """Exact small-integer sums equal torch's; each row's outputs are the same alone and in
    batches of every size (its sums run in K order whatever the other rows)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(-4, 5, (40, 64), generator=gen).bfloat16()
    weight = torch.randint(-4, 5, (40, 64), generator=gen).bfloat16()
    packed = cpu_ops.pack_weight_bf16(weight)
    assert torch.equal(cpu_ops.linear_bf16_packed(x, packed, 40, kernel="amx"), F.linear(x, weight))
    x = torch.randn(70, 768, generator=gen).bfloat16()
    packed = cpu_ops.pack_weight_bf16(torch.randn(100, 768, generator=gen).bfloat16())
    alone = torch.cat(
        [cpu_ops.linear_bf16_packed(x[i : i + 1], packed, 100, kernel="amx") for i in range(70)]
    )
    for m in [2, 16, 17, 32, 33, 70]:
        assert torch.equal(cpu_ops.linear_bf16_packed(x[:m], packed, 100, kernel="amx"), alone[:m])


@requires_kernels
@_PACKED
def test_packed_linear_refuses_an_unknown_kernel_and_amx_where_it_cannot_run() -> None:
    packed = cpu_ops.pack_weight_bf16(torch.randn(4, 40).bfloat16())
    x = torch.randn(2, 40).bfloat16()
    with pytest.raises(RuntimeError, match="unknown kernel 'avx2' \\(avx512, amx\\)"):
        cpu_ops.linear_bf16_packed(x, packed, 4, kernel="avx2")
    message = "needs K % 32 == 0, got 40" if cpu_ops.has_amx_bf16() else "needs a CPU with AMX"
    with pytest.raises(RuntimeError, match=message):
        cpu_ops.linear_bf16_packed(x, packed, 4, kernel="amx")


@requires_kernels
@_PACKED
@pytest.mark.parametrize(
    ("x", "n", "bias", "message"),
    [
        (torch.randn(2, 8), 4, None, "x must be bf16"),
        (torch.randn(2, 9).bfloat16(), 4, None, "is not \\[1, 5, 16, 2\\] for N = 4, K = 9"),
        (torch.randn(2, 8).bfloat16(), 17, None, "is not \\[2, 4, 16, 2\\]"),
        (torch.randn(2, 8).bfloat16(), 4, torch.zeros(5), "bias must be \\[4\\]"),
    ],
)
def test_packed_linear_rejects_bad_inputs(
    x: torch.Tensor, n: int, bias: torch.Tensor | None, message: str
) -> None:
    packed = cpu_ops.pack_weight_bf16(torch.randn(4, 8).bfloat16())
    with pytest.raises(RuntimeError, match=message):
        cpu_ops.linear_bf16_packed(x, packed, n, bias)


def _experts_one_by_one(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: list[torch.Tensor],
    down: list[torch.Tensor],
) -> torch.Tensor:
    """The experts as transformers' Mixtral and Qwen-MoE run them, on the packed linear and
    `silu_mul`: expert by expert, each on its tokens, scaled, rounded and `index_add_`-ed into
    the bf16 result."""
    inter = down[0].shape[1]
    out = torch.zeros_like(x)
    for index in range(len(gate_up)):
        tokens, rank = torch.nonzero(experts == index, as_tuple=True)
        packed_gate_up = cpu_ops.pack_weight_bf16(gate_up[index])
        hidden = cpu_ops.silu_mul(cpu_ops.linear_bf16_packed(x[tokens], packed_gate_up, 2 * inter))
        y = cpu_ops.linear_bf16_packed(hidden, cpu_ops.pack_weight_bf16(down[index]), x.shape[1])
        out.index_add_(0, tokens, (y * weights[tokens, rank, None]).to(x.dtype))
    return out


def _stacked(weights: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([cpu_ops.pack_weight_bf16(w) for w in weights])


@requires_kernels
@_PACKED
@pytest.mark.parametrize(
    ("tokens", "num_experts", "top_k", "hidden", "inter"),
    [(1, 8, 2, 96, 48), (13, 8, 2, 96, 48), (16, 32, 4, 130, 64), (40, 5, 1, 768, 16)],
)
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_moe_experts_in_one_call_equal_the_experts_one_by_one(
    tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, weight_dtype: torch.dtype
) -> None:
    """Bit for bit, with experts no token picked, one row and many per expert (past the 8 rows
    of one register form), a hidden size past the 16-column tiles, Mixtral's fp32 and
    Qwen-MoE's bf16 routing weights."""
    gen = torch.Generator().manual_seed(tokens * 7 + top_k)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    gate_up = [torch.randn(2 * inter, hidden, generator=gen).bfloat16() for _ in range(num_experts)]
    down = [torch.randn(hidden, inter, generator=gen).bfloat16() for _ in range(num_experts)]
    experts = torch.stack(
        [torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)]
    )
    weights = torch.rand(tokens, top_k, generator=gen).to(weight_dtype)
    out = cpu_ops.moe_experts_bf16(x, experts, weights, _stacked(gate_up), _stacked(down), inter)
    assert torch.equal(out, _experts_one_by_one(x, experts, weights, gate_up, down))
    empty = cpu_ops.moe_experts_bf16(
        x[:0], experts[:0], weights[:0], _stacked(gate_up), _stacked(down), inter
    )
    assert empty.shape == (0, hidden)


@requires_kernels
@_PACKED
@pytest.mark.parametrize(
    ("experts", "inter", "message"),
    [
        (torch.tensor([[0, 4]]), 16, "expert id 4 not in \\[0, 4\\)"),
        (torch.tensor([[0, -1]]), 16, "expert id -1 not in \\[0, 4\\)"),
        (torch.tensor([[0, 1]]), 24, "multiple of 16, got 24"),
        (torch.tensor([[0, 1], [2, 3]]), 16, "experts must be \\[T, k\\] int64"),
    ],
)
def test_moe_experts_refuse_bad_inputs(experts: torch.Tensor, inter: int, message: str) -> None:
    gate_up = _stacked([torch.randn(32, 8).bfloat16() for _ in range(4)])
    down = _stacked([torch.randn(8, 16).bfloat16() for _ in range(4)])
    x, weights = torch.randn(1, 8).bfloat16(), torch.ones(experts.shape)
    with pytest.raises(RuntimeError, match=message):
        cpu_ops.moe_experts_bf16(x, experts, weights, gate_up, down, inter)


@requires_kernels
@pytest.mark.parametrize("tokens", [1, 16, 700])  # 700: spread over both threads
def test_write_kv_matches_the_torch_op_from_qkv_views(tokens: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    k_cache = torch.randn(60, 16, 4, 64, generator=gen).bfloat16()
    v_cache = torch.randn(60, 16, 4, 64, generator=gen).bfloat16()
    qkv = torch.randn(tokens, (12 + 2 * 4) * 64, generator=gen).bfloat16()
    key = qkv[:, 12 * 64 : 16 * 64].reshape(tokens, 4, 64)
    value = qkv[:, 16 * 64 :].reshape(tokens, 4, 64)
    slots = torch.randperm(60 * 16, generator=gen)[:tokens]
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv_slots(expected_k, expected_v, key, value, slots)
    cpu_ops.write_kv_(k_cache, v_cache, key, value, slots)
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


@requires_kernels
@pytest.mark.parametrize(
    ("slots", "key_shape", "message"),
    [
        ([0, 960], (2, 4, 64), r"slot_mapping\[1\] = 960 is outside the cache's 960 slots"),
        ([-1], (1, 4, 64), r"slot_mapping\[0\] = -1 is outside"),
        ([0], (2, 4, 64), r"slot_mapping must be \[2\] int64"),
        ([0], (1, 2, 64), r"key and value must both be \[T, 4, 64\]"),
    ],
)
def test_write_kv_refuses_bad_inputs_and_writes_nothing(
    slots: list[int], key_shape: tuple[int, ...], message: str
) -> None:
    k_cache = torch.zeros(60, 16, 4, 64, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    key = torch.ones(key_shape, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=message):
        cpu_ops.write_kv_(k_cache, v_cache, key, key, torch.tensor(slots))
    assert not k_cache.any() and not v_cache.any()


def test_wrappers_raise_the_reason_when_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_ops, "hardware_unsupported_reason", lambda: "CPU lacks avx2")
    monkeypatch.setattr(cpu_ops, "_library", cpu_ops._Library())
    assert not cpu_ops.is_available()
    assert cpu_ops.unavailable_reason() == "CPU lacks avx2"
    with pytest.raises(RuntimeError, match="unavailable: CPU lacks avx2"):
        cpu_ops.linear_bf16(torch.randn(1, 8), torch.randn(4, 8).bfloat16())


@requires_kernels
@pytest.mark.parametrize(("rows", "vocab"), [(1, 32000), (16, 32000), (3, 13), (5, 1)])
def test_argmax_matches_torch(rows: int, vocab: int) -> None:
    torch.manual_seed(rows * vocab)
    x = torch.randn(rows, vocab)
    assert torch.equal(cpu_ops.argmax(x), x.argmax(-1))


@requires_kernels
def test_argmax_ties_infinities_and_nans_as_torch() -> None:
    """Equal maxima: the first wins (in the vector body and in the scalar tail); a NaN counts as
    the largest value, so the first NaN wins; an all -inf row picks index 0."""
    x = torch.zeros(6, 21)
    x[0, [3, 17]] = 5.0
    x[1, [19, 20]] = 5.0
    x[2, [4, 9]] = float("nan")
    x[2, 2] = float("inf")
    x[3] = float("-inf")
    x[4, 20] = float("nan")
    x[5, 10] = float("inf")
    assert torch.equal(cpu_ops.argmax(x), x.argmax(-1))
    assert cpu_ops.argmax(x).tolist() == [3, 19, 4, 0, 20, 10]


@requires_kernels
def test_argmax_refuses_what_it_does_not_handle() -> None:
    with pytest.raises(RuntimeError, match="argmax_rows: x must be a 2-d fp32 CPU tensor"):
        cpu_ops.argmax(torch.randn(2, 8).bfloat16())
    with pytest.raises(RuntimeError, match="argmax_rows: rows must not be empty"):
        cpu_ops.argmax(torch.randn(2, 0))


@requires_kernels
@pytest.mark.parametrize(("vocab", "num_words"), [(128, 4), (100, 4), (140, 4), (37, 1)])
def test_token_mask_matches_the_unpacked_bits(vocab: int, num_words: int) -> None:
    """All-ones, all-zeros and mixed words; a mask shorter than the vocabulary masks the rest;
    rows not named stay as they were."""
    torch.manual_seed(vocab)
    logits = torch.randn(4, vocab)
    words = torch.randint(-(2**31), 2**31 - 1, (2, num_words), dtype=torch.int32)
    words[0, 0], words[1, -1] = -1, 0
    rows = torch.tensor([3, 1])
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = torch.zeros(2, vocab, dtype=torch.bool)
    width = min(vocab, 32 * num_words)
    allowed[:, :width] = bits.view(2, -1)[:, :width].bool()
    expected = logits.clone()
    expected[rows] = expected[rows].masked_fill(~allowed, float("-inf"))
    cpu_ops.apply_token_mask_(logits, words, rows)
    assert torch.equal(logits, expected)


@requires_kernels
def test_token_mask_refuses_what_it_does_not_handle() -> None:
    words, rows = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0])
    with pytest.raises(RuntimeError, match="logits must be a contiguous 2-d fp32 CPU tensor"):
        cpu_ops.apply_token_mask_(torch.zeros(2, 8).bfloat16(), words, rows)
    with pytest.raises(RuntimeError, match="row out of range"):
        cpu_ops.apply_token_mask_(torch.zeros(1, 8), words, torch.tensor([1]))
