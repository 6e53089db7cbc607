"""Kernel choice by measurement (kernels.choice): the table's rules, its cache, the linears and the
prefill attention running their picks, and a selection run on this machine whose every pick,
timed again, is within 10% of the fastest candidate."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.kernels.markers import requires_kernels
from tgq.gpu_worker.layers.linear import TORCH, Linear, linear_candidates, measure_linears
from tgq.kernels import choice, cpu_ops
from tgq.kernels.choice import Choices, Measured, choose, cpu_key
from tgq.kernels.cpu_paged import (
    DECODE_BUCKETS,
    PREFILL_BUCKETS,
    CpuPagedAttention,
    own_prefill_kernels,
)
from tgq.kernels.greedy_head import GreedyHead, screen_kernels
from tgq.kernels.torch_paged import MultiQuery, TorchMetadata, TorchPagedAttention, attend_multi


def _choices(
    *entries: tuple[int, dict[str, float]],
    handicap: dict[str, float] | None = None,
    op: str = "linear",
) -> Choices:
    return Choices({}, [Measured(op, rows, t, handicap or {}) for rows, t in entries])


def test_a_call_runs_the_pick_of_the_smallest_bucket_that_holds_it() -> None:
    choices = _choices(
        (1, {"avx512": 1.0, "amx": 2.0}),
        (16, {"avx512": 3.0, "amx": 1.0}),
        (64, {"amx": 2.0, "torch": 3.0}),
        (256, {"amx": 9.0, "torch": 4.0}),
    )
    assert [choices.pick("linear", rows) for rows in (1, 2, 16, 17, 64, 65, 256, 9999)] == [
        "avx512", "amx", "amx", "amx", "amx", "torch", "torch", "torch",
    ]  # fmt: skip
    assert choices.thresholds("linear") == [(1, "avx512"), (64, "amx"), (256, "torch")]
    assert choices.summary("linear") == "1-1: avx512, 2-64: amx, 65-256: torch"
    with pytest.raises(KeyError, match="no kernel measured for 'attention'"):
        choices.pick("attention", 1)


def test_a_handicapped_candidate_must_win_by_its_factor() -> None:
    """torch beside the packed kernels costs a second copy of the weights: 5% faster is not
    enough at a handicap of 1.1, 20% is."""
    close = _choices((64, {"amx": 1.0, "torch": 0.95}), handicap={"torch": 1.1})
    clear = _choices((64, {"amx": 1.0, "torch": 0.8}), handicap={"torch": 1.1})
    assert close.pick("linear", 64) == "amx"
    assert clear.pick("linear", 64) == "torch"


@pytest.mark.parametrize(
    ("script", "rounds", "timings"),
    [
        # A burst of other work makes "own" look 2x slower in the first round only: the timing
        # goes on (MIN_ROUNDS), and the rounds after show it is the faster.
        ({"own": [44.5, 19.6, 19.5], "torch": [21.6, 20.2, 20.0]}, 3, {"own": 19.5, "torch": 20.0}),
        # A lead that holds after MIN_ROUNDS ends the timing.
        ({"own": [10.0, 10.0, 10.0], "torch": [30.0, 29.0, 28.0]}, 2, {"own": 10.0, "torch": 29.0}),
    ],
    ids=["noisy-first-round", "clear-lead"],
)
def test_one_noisy_round_cannot_decide_a_pick(
    monkeypatch: pytest.MonkeyPatch,
    script: dict[str, list[float]],
    rounds: int,
    timings: dict[str, float],
) -> None:
    calls: list[str] = []

    def scripted(turns: dict[str, Callable[[], object]]) -> dict[str, float]:
        names = [str(call()) for call in turns.values()]
        calls.extend(names)
        return {name: script[name][calls.count(name) - 1] for name in names}

    monkeypatch.setattr(choice, "time_in_turns", scripted)
    makers = {name: functools.partial(lambda name, rows: lambda: name, name) for name in script}
    [measured] = choice.measure("linear", makers, [16])
    assert len(calls) == 2 * rounds
    assert measured.timings_ms == timings and measured.picked == "own"


def test_candidates_are_timed_in_turns_call_by_call() -> None:
    """A, B, A, B, ...: a burst of other work slows one call of each candidate, not every call
    of one (which once made the selection pick torch over a 2x faster AMX kernel)."""
    order: list[str] = []
    calls = {name: functools.partial(order.append, name) for name in ("a", "b")}
    timings = choice.time_in_turns(calls, repeats=3)
    assert set(timings) == {"a", "b"} and all(t >= 0 for t in timings.values())
    assert order == ["a", "b"] * 4  # one warm-up call each, then three turns


def test_choices_are_measured_once_then_read_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TGQ_KERNEL_CACHE", str(tmp_path))
    runs: list[int] = []

    def run() -> list[Measured]:
        runs.append(1)
        return [Measured("linear", 16, {"avx512": 2.0, "torch": 1.0}, {"torch": 1.1})]

    first = choose({"linear": [[8, 8]]}, run)
    again = choose({"linear": [[8, 8]]}, run)
    other_shape = choose({"linear": [[16, 8]]}, run)
    assert len(runs) == 2 and again.measured == first.measured and other_shape is not None
    paths = sorted((tmp_path / "choices").glob("*.json"))
    assert len(paths) == 2
    record = json.loads(paths[0].read_text())
    assert record["key"]["cpu"] == cpu_key()["cpu"] and "shapes" in record["key"]
    # An unreadable cache file is measured again (and rewritten), never an error.
    for cached in (tmp_path / "choices").glob("*.json"):
        cached.write_text("{not json")
    choose({"linear": [[8, 8]]}, run)
    assert len(runs) == 3
    choose({"linear": [[8, 8]]}, run, cache=False)
    assert len(runs) == 4


@requires_kernels
def test_a_linear_runs_the_kernel_of_its_call_size_bit_for_bit() -> None:
    if not cpu_ops.has_avx512_bf16():
        pytest.skip("this CPU lacks AVX512_BF16 (the packed kernels)")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=gen).bfloat16()
    bias = torch.randn(48, generator=gen).bfloat16()
    packed_kernel = "amx" if cpu_ops.has_amx_bf16() else "avx512"
    linear = Linear(64, 48, bias=True).bfloat16()
    linear.weight.data.copy_(weight)
    assert linear.bias is not None
    linear.bias.data.copy_(bias)
    linear.use_kernels([(4, "avx512"), (16, packed_kernel), (64, TORCH)], out_fp32=False)
    assert linear.weight.shape == (3, 32, 16, 2) and linear.weight_rows is not None
    assert torch.equal(linear.weight_rows, weight)
    packed = cpu_ops.pack_weight_bf16(weight)
    for rows, kernel in [(1, "avx512"), (4, "avx512"), (5, packed_kernel), (16, packed_kernel)]:
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        want = cpu_ops.linear_bf16_packed(x, packed, 48, bias, kernel=kernel)
        assert torch.equal(linear(x), want), rows
    for rows in (17, 64, 300):  # the last entry serves every larger call
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        assert torch.equal(linear(x), torch.nn.functional.linear(x, weight, bias)), rows
    # Packed kernels alone: no [N, K] copy kept.
    alone = Linear(64, 48, bias=False).bfloat16()
    alone.weight.data.copy_(weight)
    alone.use_kernels([(1, "avx512")], out_fp32=True)
    assert alone.weight_rows is None
    x = torch.randn(3, 64, generator=gen).bfloat16()
    assert torch.equal(alone(x), cpu_ops.linear_bf16_packed(x, packed, 48, out_fp32=True))
    with pytest.raises(ValueError, match="unknown linear kernels \\['avx2'\\]"):
        Linear(64, 48, bias=False).use_kernels([(1, "avx2")], out_fp32=False)


def _assert_picks_within_10_percent(
    measured: list[Measured], measure_at: Callable[[int], list[Measured]]
) -> None:
    """Each bucket's candidates timed again, three times in turns (`measure_at(rows)`): the
    pick must be within 10% of the fastest of them, times weighed as the selection weighs them
    (torch's with its handicap). A pick that is not is selected once more, afresh: beside the
    other test worker one selection's timings can be disturbed enough to pick wrong (a CI run
    timed the AVX-512 linear at 31 ms, then 17 ms); a selection wrong twice is a fault."""
    for entry in measured:
        close, again = _pick_is_close(entry, measure_at)
        if not close:
            [fresh] = measure_at(entry.rows)
            close, again = _pick_is_close(fresh, measure_at)
        assert close, (entry, again)


def _pick_is_close(
    entry: Measured, measure_at: Callable[[int], list[Measured]]
) -> tuple[bool, dict[str, float]]:
    names = sorted(entry.timings_ms)
    again = {name: float("inf") for name in names}
    for _ in range(3):  # one bucket at a time: every candidate is timed
        [timed] = measure_at(entry.rows)
        for name in names:
            again[name] = min(again[name], timed.timings_ms[name])
    cost = {name: again[name] * entry.handicap.get(name, 1.0) for name in names}
    return cost[entry.picked] <= 1.10 * min(cost.values()), again


@requires_kernels
def test_every_choice_on_this_machine_is_within_10_percent_of_the_fastest() -> None:
    """The selection, run here on a decoder layer's four linears (one thread, as the other test
    worker shares the machine), picks per row count; each bucket's candidates are then timed
    again, in turns, and the pick must be within 10% of the fastest of them (times are the
    fastest of their runs over three rounds, so other work on the machine cannot make a right
    pick look wrong; torch's time counts with its handicap, as the selection weighs it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(1)
        linears = []
        for n, k in [(2304, 768), (768, 768), (4096, 768), (768, 2048)]:  # the medium model
            linear = Linear(k, n, bias=False).bfloat16()
            linear.weight.data.copy_(torch.randn(n, k, generator=gen).bfloat16())
            linears.append(linear)
        measured = measure_linears("linear", linears, [1, 16, 64, 256])
        assert {m.rows for m in measured} == {1, 16, 64, 256}
        assert set(measured[0].timings_ms) == set(linear_candidates(768)) & set(
            linear_candidates(2048)
        )
        _assert_picks_within_10_percent(
            measured, lambda rows: measure_linears("linear", linears, [rows])
        )
    finally:
        torch.set_num_threads(threads)


@requires_kernels
def test_the_greedy_heads_screen_choice_is_within_10_percent_of_the_fastest() -> None:
    """The same for the greedy head's screen kernels (VNNI, AMX-INT8) over the medium model's
    32000 x 768 packed head, one thread. Where only VNNI can screen (no AMX-INT8), nothing is
    measured and every call screens on it; without VNNI there is no screen for a packed head
    (the AVX2 kernel's head has one kernel, "avx2": nothing to choose)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(2)
        weight = (torch.randn(32000, 768, generator=gen) * 0.02).bfloat16()
        head = GreedyHead.build(cpu_ops.pack_weight_bf16(weight), weight)
        if head is None:  # no screen for a packed head here: it needs AVX512_BF16 + VNNI
            assert not cpu_ops.has_avx512_vnni_bf16()
            unpacked = GreedyHead.build(None, weight)
            assert unpacked is not None and unpacked.choose_kernels() is None
            assert unpacked.thresholds == [(1, "avx2")]
            return
        if screen_kernels(768) == ["avx512"]:
            assert head.choose_kernels() is None and head.thresholds == [(1, "avx512")]
            return
        measured = head.measure_kernels([1, 16, 64])
        assert {m.rows for m in measured} == {1, 16, 64}
        _assert_picks_within_10_percent(measured, lambda rows: head.measure_kernels([rows]))
    finally:
        torch.set_num_threads(threads)


@requires_kernels
def test_prefill_attention_runs_the_kernel_measured_for_the_chunk_length(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`choose_kernels` times the prefill kernels (AVX-512, AMX where the CPU has it, torch's
    SDPA) at each bucket and keeps the choices; a chunk then runs the pick for its length, bit
    for bit that kernel's result."""
    if not cpu_ops.avx512_attention_serves(torch.bfloat16, 64):
        pytest.skip("this CPU lacks the AVX-512 prefill kernel")
    monkeypatch.setenv("TGQ_KERNEL_CACHE", str(tmp_path))
    backend = CpuPagedAttention()
    backend.choose_kernels(4, 2, 64, torch.bfloat16)
    assert backend.prefill_choices is not None and backend.decode_choices is not None
    assert [m.rows for m in backend.prefill_choices.measured] == list(PREFILL_BUCKETS)
    own = own_prefill_kernels()
    assert set(backend.prefill_choices.measured[0].timings_ms) == {*own, "torch"}
    assert [m.rows for m in backend.decode_choices.measured] == list(DECODE_BUCKETS)
    odd = CpuPagedAttention()
    odd.choose_kernels(4, 2, 48, torch.bfloat16)  # not a multiple of 32: no AVX-512 prefill
    assert odd.prefill_choices is None and odd.decode_choices is not None
    middle = own[-1]  # AMX where the CPU has it
    backend.prefill_choices = _choices(
        (16, {"avx512": 1.0, middle: 1.5, "torch": 2.0}),
        (64, {"avx512": 2.0, middle: 1.0, "torch": 2.0}),
        (4096, {"avx512": 2.0, middle: 2.0, "torch": 1.0}),
        op="prefill_attention",
    )
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(16, 16, 2, 64, generator=gen).bfloat16()
    v_cache = torch.randn(16, 16, 2, 64, generator=gen).bfloat16()
    block_ids = torch.randperm(16, generator=gen)
    for tokens, kernel in [(10, "avx512"), (40, middle), (200, "torch")]:
        query = torch.randn(tokens, 4, 64, generator=gen).bfloat16()
        seq = MultiQuery(0, tokens, tokens, block_ids)
        got = backend._attend_multi(query, k_cache, v_cache, seq, 0.125, None)
        want = (
            attend_multi(query, k_cache, v_cache, seq, 0.125, None)
            if kernel == "torch"
            else cpu_ops.paged_prefill_attention(
                query, k_cache, v_cache, block_ids, tokens, 0.125, 0, kernel
            )
        )
        assert torch.equal(got, want), tokens


@requires_kernels
def test_decode_attention_runs_the_kernel_measured_for_the_batch_size() -> None:
    """Batches the choices give to torch run its gather + SDPA, and are not replayed (the ops'
    shapes follow the block table's width); the others run the own kernel, replayable."""
    backend = CpuPagedAttention()
    backend.decode_choices = _choices(
        (1, {"own": 1.0, "torch": 2.0}), (16, {"own": 2.0, "torch": 1.0}), op="decode_attention"
    )
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(64, 16, 2, 64, generator=gen).bfloat16()
    v_cache = torch.randn(64, 16, 2, 64, generator=gen).bfloat16()
    for batch, own in [(1, True), (8, False)]:
        meta = TorchMetadata(
            slot_mapping=torch.zeros(batch, dtype=torch.int64),
            num_single=batch,
            single_block_tables=torch.randperm(64, generator=gen)[: batch * 4].view(batch, 4),
            single_kv_lens=torch.full((batch,), 60),
            multi=[],
        )
        query = torch.randn(batch, 4, 64, generator=gen).bfloat16()
        got = backend._attend_single(query, k_cache, v_cache, meta, 0.125, None)
        base = TorchPagedAttention._attend_single(
            backend, query, k_cache, v_cache, meta, 0.125, None
        )
        tables, lens = meta.single_block_tables, meta.single_kv_lens
        own_out = cpu_ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125, 0)
        want = own_out if own else base
        assert torch.equal(got, want), batch
        assert (backend.replay_key(meta) is not None) == own
