"""The screened greedy head picks exactly what argmax over the lm_head's logits picks: the packed
kernel's ("avx512" screen, AVX512_BF16 + VNNI CPUs) or the AVX2 kernel's for each row alone ("avx2"
screen, any CPU the kernels run on)."""

from __future__ import annotations

import pytest
import torch

from tgq.kernels import cpu_ops
from tgq.kernels.greedy_head import (
    GreedyHead,
    build_screen,
    screen_kernels,
    screen_unsupported_reason,
)

requires_vnni_bf16 = pytest.mark.skipif(
    not cpu_ops.has_avx512_vnni_bf16(), reason="this CPU lacks AVX512_BF16 + AVX512_VNNI"
)
pytestmark = pytest.mark.skipif(not cpu_ops.is_available(), reason="no CPU kernels here")
KERNELS = [pytest.param("avx512", marks=requires_vnni_bf16), "avx2"]
BF16 = torch.bfloat16


@pytest.fixture(params=KERNELS)
def kernel(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


def full_logits(x: torch.Tensor, weight: torch.Tensor, kernel: str) -> torch.Tensor:
    """The logits the screen is held to: the packed kernel's, or the AVX2 kernel's row by row."""
    if kernel == "avx512":
        return cpu_ops.linear_bf16(x, weight, None, "avx512", out_fp32=True)
    rows = [cpu_ops.linear_bf16(row[None], weight, None, "avx2", out_fp32=True) for row in x]
    return torch.cat(rows)


def full_argmax(x: torch.Tensor, weight: torch.Tensor, kernel: str) -> torch.Tensor:
    return cpu_ops.argmax(full_logits(x, weight, kernel))


def head_of(weight: torch.Tensor, kernel: str, max_candidates: int = 1024) -> GreedyHead:
    packed = cpu_ops.pack_weight_bf16(weight) if kernel == "avx512" else None
    head = GreedyHead(packed, weight, build_screen(weight), max_candidates)
    assert head.thresholds == [(1, kernel)]
    return head


def raw_argmax(head: GreedyHead, x: torch.Tensor, max_candidates: int) -> torch.Tensor:
    s = head.screen
    return cpu_ops.greedy_head_argmax(
        x, head.weight, s.screen, s.scale, s.q_sum, s.bound_x, s.bound_ex, max_candidates,
        kernel=head.kernels[0],
    )  # fmt: skip


@pytest.mark.parametrize("num_columns,k", [(1000, 64), (4099, 256), (517, 768)])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 17])
def test_the_screen_picks_the_full_argmax(num_columns: int, k: int, rows: int, kernel: str) -> None:
    gen = torch.Generator().manual_seed(num_columns * 31 + rows)
    weight = (torch.randn(num_columns, k, generator=gen) * 0.05).to(BF16)
    head = head_of(weight, kernel)
    for scale in (1e-3, 1.0, 30.0):
        x = (torch.randn(rows, k, generator=gen) * scale).to(BF16)
        assert torch.equal(head.argmax(x), full_argmax(x, weight, kernel))


def test_it_reads_only_a_few_columns_of_a_model_sized_head(kernel: str) -> None:
    """Over a 32000 x 768 random head, no row needs more than 256 exact columns on the VNNI
    screen (measured: a few dozen), 512 on the AVX2 one, whose 7-bit rows double |ex| (measured:
    12 to 307, median ~70); with a cap of 1 every row falls back (the cap is honoured)."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(32000, 768, generator=gen) * 0.02).to(BF16)
    head = head_of(weight, kernel)
    x = torch.randn(16, 768, generator=gen).to(BF16)
    screened = raw_argmax(head, x, 256 if kernel == "avx512" else 512)
    assert (screened >= 0).all()
    assert torch.equal(screened, full_argmax(x, weight, kernel))
    assert (raw_argmax(head, x, 1) == -1).all()


def test_equal_logits_go_to_the_first_column(kernel: str) -> None:
    """Columns 5, 9 and 40 are the same vector, the best one for x: a tie, which argmax gives to
    the first; a copy one bf16 step smaller (column 2) must lose."""
    gen = torch.Generator().manual_seed(1)
    k = 128
    weight = (torch.randn(300, k, generator=gen) * 0.01).to(BF16)
    x = torch.randn(1, k, generator=gen).to(BF16)
    best = (x[0].float() / x[0].float().norm()).to(BF16)
    for column in (5, 9, 40):
        weight[column] = best
    smaller = best.clone()
    smaller[0] = torch.nextafter(best[0].float(), torch.tensor(0.0)).to(BF16)
    weight[2] = smaller
    head = head_of(weight, kernel)
    expected = full_argmax(x, weight, kernel)
    assert int(expected) == 5 or int(expected) == 2  # whichever is larger after rounding
    assert torch.equal(head.argmax(x), expected)


def test_near_ties_one_bf16_step_apart(kernel: str) -> None:
    """Many columns within a bf16 step of the best: the exact stage decides among them."""
    gen = torch.Generator().manual_seed(2)
    k = 256
    base = torch.randn(k, generator=gen)
    noise = torch.randn(2000, k, generator=gen) * 1e-3
    weight = (base + noise).to(BF16)
    head = head_of(weight, kernel, max_candidates=4096)
    for _ in range(5):
        x = (base + 0.1 * torch.randn(k, generator=gen)).to(BF16)[None]
        assert torch.equal(head.argmax(x), full_argmax(x, weight, kernel))


@pytest.mark.parametrize("fill", [float("nan"), float("inf"), 2.0**40], ids=["nan", "inf", "huge"])
def test_rows_the_screen_cannot_bound_are_computed_in_full(fill: float, kernel: str) -> None:
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(700, 64, generator=gen) * 0.05).to(BF16)
    head = head_of(weight, kernel)
    x = torch.randn(3, 64, generator=gen).to(BF16)
    x[1, 7] = fill
    assert raw_argmax(head, x, 1024).tolist()[1] == -1
    assert torch.equal(head.argmax(x), full_argmax(x, weight, kernel))


def test_a_zero_row_ties_everywhere_and_gets_column_0(kernel: str) -> None:
    """Every logit is 0: every column is a candidate, more than a cap of 100 (computed in full),
    fewer than 1024 (computed exactly)."""
    weight = torch.randn(700, 64).to(BF16)
    head = head_of(weight, kernel)
    x = torch.zeros(1, 64, dtype=BF16)
    assert raw_argmax(head, x, 100).tolist() == [-1]
    assert raw_argmax(head, x, 1024).tolist() == [0]
    assert head.argmax(x).tolist() == [0]


@pytest.mark.parametrize(
    "weight,reason",
    [
        (torch.zeros(32, 64), "needs a 2-d bf16 CPU weight"),
        (torch.zeros(32, 66, dtype=BF16), "needs K a multiple of 4, got 66"),
        (torch.full((32, 64), float("inf"), dtype=BF16), "needs finite weights of magnitude"),
        (torch.full((32, 64), float("nan"), dtype=BF16), "needs finite weights of magnitude"),
        (torch.full((32, 64), 2.0**17, dtype=BF16), "needs finite weights of magnitude"),
    ],
)
def test_weights_the_screen_cannot_serve_are_refused(weight: torch.Tensor, reason: str) -> None:
    found = screen_unsupported_reason(weight)
    assert found is not None and found.startswith(reason)
    with pytest.raises(ValueError, match="greedy screen: " + reason):
        build_screen(weight)
    for packed in (torch.empty(0), None):  # the model then has no greedy head
        assert GreedyHead.build(packed, weight) is None


def test_bad_inputs_are_refused_with_exact_messages(kernel: str) -> None:
    weight = torch.randn(40, 64).to(BF16)
    head = head_of(weight, kernel)
    s = head.screen
    x = torch.randn(2, 64).to(BF16)

    def call(**changes: object) -> None:
        args = {
            "x": x,
            "weight": head.weight,
            "screen": s.screen,
            "scale": s.scale,
            "q_sum": s.q_sum,
            "bound_x": s.bound_x,
            "bound_ex": s.bound_ex,
            "max_candidates": 8,
            "kernel": kernel,
        }
        args.update(changes)
        cpu_ops.greedy_head_argmax(**args)  # type: ignore[arg-type]

    with pytest.raises(RuntimeError, match=r"x must be a \[M, K\] bf16 CPU tensor, got Float"):
        call(x=x.float())
    with pytest.raises(RuntimeError, match="K must be a positive multiple of 4 up to 65536"):
        call(x=torch.zeros(2, 62, dtype=BF16))
    with pytest.raises(RuntimeError, match="max_candidates must be positive"):
        call(max_candidates=0)
    with pytest.raises(RuntimeError, match=r"q_sum must be a contiguous \[40\] Int"):
        call(q_sum=s.q_sum[:39])
    with pytest.raises(RuntimeError, match=r"weight must be a contiguous \[40, 64\] bf16"):
        call(weight=weight.t())
    with pytest.raises(RuntimeError, match="screen must be a contiguous int8"):
        call(screen=s.screen.float())


def _bitmasks(allowed: list[torch.Tensor], num_columns: int) -> torch.Tensor:
    bits = torch.zeros(len(allowed), -(-num_columns // 32) * 32, dtype=torch.bool)
    for row, columns in enumerate(allowed):
        bits[row, columns] = True
    weights = 1 << torch.arange(32, dtype=torch.int64)
    words = (bits.view(len(allowed), -1, 32).long() * weights).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize("num_columns,k", [(1000, 64), (517, 768), (4099, 256)])
def test_under_a_mask_it_picks_the_masked_full_argmax(
    num_columns: int, k: int, kernel: str
) -> None:
    """Structured output: each row's allowed columns (one, a tie between columns 7 and 300, a
    few, every third, all but the favourite) give the argmax of the full logits with the others
    at -inf; with a cap of 1 candidate the rows computed in full are masked too."""
    gen = torch.Generator().manual_seed(num_columns + k)
    weight = (torch.randn(num_columns, k, generator=gen) * 0.05).to(BF16)
    weight[300] = weight[7]
    x = torch.randn(5, k, generator=gen).to(BF16)
    head = head_of(weight, kernel)
    logits = full_logits(x, weight, kernel)
    favourite = int(logits[4].argmax())
    allowed = [
        torch.tensor([num_columns - 1]),
        torch.tensor([7, 300]),
        torch.randperm(num_columns, generator=gen)[:50],
        torch.arange(0, num_columns, 3),
        torch.tensor([c for c in range(num_columns) if c != favourite]),
    ]
    masked = torch.full_like(logits, float("-inf"))
    for row, columns in enumerate(allowed):
        masked[row, columns] = logits[row, columns]
    masks = _bitmasks(allowed, num_columns)
    assert torch.equal(head.argmax(x, masks), masked.argmax(-1))
    capped = head_of(weight, kernel, max_candidates=1)
    assert torch.equal(capped.argmax(x, masks), masked.argmax(-1))


requires_amx_int8 = pytest.mark.skipif(
    not cpu_ops.has_amx_int8(), reason="this CPU lacks AMX-INT8 (or Linux refuses its tiles)"
)


@requires_amx_int8
@pytest.mark.parametrize("num_columns,k", [(1000, 64), (517, 768), (4099, 256)])
def test_the_amx_screen_picks_what_the_vnni_screen_picks(num_columns: int, k: int) -> None:
    """AMX-INT8 tiles compute the same integer sums as vpdpbusd, so every row gets the same
    token, masked or not, at row counts around the tiles' 16 and 32 rows, and the rows the
    screen cannot bound are flagged alike."""
    gen = torch.Generator().manual_seed(num_columns * 7 + k)
    weight = (torch.randn(num_columns, k, generator=gen) * 0.05).to(BF16)
    head = head_of(weight, "avx512")
    s = head.screen
    for rows in (1, 3, 16, 17, 32, 33, 64):
        x = (torch.randn(rows, k, generator=gen) * 3).to(BF16)
        x[rows // 2] = float("inf")  # unusable: both flag it
        allowed = [torch.randperm(num_columns, generator=gen)[: 1 + row * 5] for row in range(rows)]
        for masks in (None, _bitmasks(allowed, num_columns)):
            got = {
                kernel: cpu_ops.greedy_head_argmax(
                    x, weight, s.screen, s.scale, s.q_sum, s.bound_x, s.bound_ex, 1024, masks,
                    kernel=kernel,
                )
                for kernel in ("avx512", "amx")
            }  # fmt: skip
            assert torch.equal(got["amx"], got["avx512"]), (rows, masks is None)
            assert int(got["amx"][rows // 2]) == -1


@requires_amx_int8
def test_the_head_screens_each_call_on_its_chosen_kernel() -> None:
    """With thresholds (as `choose_kernels` sets them), every call size gets the full argmax;
    a head over K not a multiple of 64 offers no AMX candidate; bad kernels are refused."""
    gen = torch.Generator().manual_seed(5)
    weight = (torch.randn(700, 128, generator=gen) * 0.05).to(BF16)
    head = head_of(weight, "avx512")
    head.thresholds = [(4, "avx512"), (16, "amx")]
    for rows in (1, 4, 5, 16, 40):
        x = torch.randn(rows, 128, generator=gen).to(BF16)
        assert torch.equal(head.argmax(x), full_argmax(x, weight, "avx512")), rows
    assert screen_kernels(128) == ["avx512", "amx"] and screen_kernels(96) == ["avx512"]
    s = head.screen
    args = (s.screen, s.scale, s.q_sum, s.bound_x, s.bound_ex, 8)
    x = torch.randn(2, 128, generator=gen).to(BF16)
    with pytest.raises(RuntimeError, match="unknown kernel 'avx' \\(avx512, amx, avx2\\)"):
        cpu_ops.greedy_head_argmax(x, weight, *args, kernel="avx")
    narrow = (torch.randn(40, 96, generator=gen) * 0.05).to(BF16)
    n = head_of(narrow, "avx512").screen
    with pytest.raises(RuntimeError, match="kernel 'amx' needs K % 64 == 0, got 96"):
        cpu_ops.greedy_head_argmax(
            torch.randn(2, 96, generator=gen).to(BF16), narrow,
            n.screen, n.scale, n.q_sum, n.bound_x, n.bound_ex, 8, kernel="amx",
        )  # fmt: skip


def test_a_rows_token_does_not_depend_on_its_batch() -> None:
    """The AVX2 screen holds every row to its logits computed alone: the same tokens whether a
    row comes alone, first or last among 1 to 9 rows (the AVX2 kernel's own sums for a row differ
    with the number of rows in its call; the screen's answer does not)."""
    gen = torch.Generator().manual_seed(6)
    weight = (torch.randn(3001, 128, generator=gen) * 0.05).to(BF16)
    head = head_of(weight, "avx2")
    x = torch.randn(9, 128, generator=gen).to(BF16)
    alone = torch.cat([head.argmax(row[None]) for row in x])
    for rows in range(1, 10):
        assert torch.equal(head.argmax(x[:rows]), alone[:rows])
        assert torch.equal(head.argmax(x[-rows:]), alone[-rows:])


def test_screen_kernels_follow_the_heads_kernel() -> None:
    """An unpacked head (the AVX2 kernel's) is screened by "avx2" on any CPU; a packed one by the
    VNNI screen, and only where the CPU has AVX512_BF16 + VNNI (elsewhere: no greedy head)."""
    weight = (torch.randn(64, 128) * 0.05).to(BF16)
    assert screen_kernels(128, packed=False) == ["avx2"]
    head = GreedyHead.build(None, weight)
    assert head is not None and head.kernels == ["avx2"] and head.thresholds == [(1, "avx2")]
    if cpu_ops.has_avx512_vnni_bf16():
        assert screen_kernels(128)[0] == "avx512"
        return
    assert screen_kernels(128) == []
    assert GreedyHead.build(torch.empty(0), weight) is None
    s = build_screen(weight)
    args = (s.screen, s.scale, s.q_sum, s.bound_x, s.bound_ex, 8)
    with pytest.raises(RuntimeError, match="kernel 'avx512' needs a CPU with AVX512_BF16 and"):
        cpu_ops.greedy_head_argmax(torch.zeros(1, 128, dtype=BF16), weight, *args, kernel="avx512")
