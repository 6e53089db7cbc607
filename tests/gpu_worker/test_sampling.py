"""Sampler parity with transformers' logits processors, seeded reproducibility, distributions."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close
from transformers.generation.logits_process import (
    LogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from tgq.gpu_worker.plan import SamplingParams
from tgq.gpu_worker.sampling import (
    Sampler,
    SamplingInputs,
    apply_frequency_presence,
    apply_min_p,
    apply_min_tokens,
    apply_repetition_penalty,
    apply_temperature,
    apply_token_masks,
    apply_top_k,
    apply_top_p,
    apply_typical_p,
    token_counts,
)

VOCAB_SIZE = 1000
CPU = torch.device("cpu")


def _logits(num_rows: int = 6, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return 2.0 * torch.randn(num_rows, VOCAB_SIZE, generator=generator)


def _token_ids(lengths: list[int], seed: int = 1) -> list[list[int]]:
    """Random ids with plenty of repeats (drawn from a tenth of the vocabulary)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB_SIZE // 10, (n,), generator=generator).tolist() for n in lengths]


def _hf_rows(
    processors: list[list[LogitsProcessor]],
    logits: torch.Tensor,
    ids: list[list[int]] | None = None,
) -> torch.Tensor:
    """Row i through processors[i] in order, one row at a time, as HF would see it alone."""
    rows = []
    for i, chain in enumerate(processors):
        row = logits[i : i + 1].clone()
        input_ids = torch.tensor([ids[i] if ids else []], dtype=torch.int64)
        for processor in chain:
            row = processor(input_ids, row)
        rows.append(row)
    return torch.cat(rows)


def _exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert_close(actual, expected, rtol=0.0, atol=0.0)  # -inf positions must match too


def test_token_counts_matches_a_loop() -> None:
    ids = _token_ids([0, 3, 50, 200])
    counts = token_counts(ids, _logits(num_rows=4))
    expected = torch.zeros(4, VOCAB_SIZE)
    for i, row in enumerate(ids):
        for token_id in row:
            expected[i, token_id] += 1
    _exact(counts, expected)


def test_repetition_penalty_matches_transformers() -> None:
    logits = _logits()
    penalties = [1.0, 1.3, 0.7, 2.0, 1.1, 0.5]
    ids = _token_ids([0, 5, 30, 100, 1, 400])
    mask = token_counts(ids, logits) > 0
    actual = apply_repetition_penalty(logits, mask, torch.tensor(penalties))
    expected = _hf_rows([[RepetitionPenaltyLogitsProcessor(p)] for p in penalties], logits, ids)
    _exact(actual, expected)


def test_frequency_presence_matches_formula() -> None:
    logits = _logits()
    frequency, presence = [0.0, 0.5, -0.3, 1.0, 0.0, 2.0], [0.0, 0.0, 0.4, -1.0, 1.5, 0.1]
    ids = _token_ids([0, 5, 30, 100, 1, 400])
    actual = apply_frequency_presence(
        logits, token_counts(ids, logits), torch.tensor(frequency), torch.tensor(presence)
    )
    expected = logits.clone()
    for i, row in enumerate(ids):
        for token_id in set(row):
            expected[i, token_id] -= frequency[i] * row.count(token_id) + presence[i]
    assert_close(actual, expected)


def test_temperature_matches_transformers() -> None:
    logits = _logits()
    temperatures = [0.05, 0.3, 0.7, 1.0, 1.5, 2.0]
    actual = apply_temperature(logits, torch.tensor(temperatures))
    _exact(actual, _hf_rows([[TemperatureLogitsWarper(t)] for t in temperatures], logits))


def test_top_k_matches_transformers_with_ties() -> None:
    logits = torch.round(_logits() * 2) / 2  # half-integers: many ties at the k-th value
    ks = [0, 1, 5, 50, VOCAB_SIZE - 1, 5 * VOCAB_SIZE]
    actual = apply_top_k(logits, torch.tensor(ks))
    expected = _hf_rows([[TopKLogitsWarper(k)] if k else [] for k in ks], logits)
    _exact(actual, expected)
    num_kept = actual.isfinite().sum(-1).tolist()
    assert num_kept[1] >= 1 and num_kept[2] >= 5 and num_kept[3] > 50  # ties at the k-th stay
    _exact(actual[[0, 5]], logits[[0, 5]])


def test_top_p_matches_transformers() -> None:
    logits = apply_temperature(_logits(), torch.tensor([1.0, 0.5, 2.0, 1.0, 0.3, 1.0]))
    ps = [1.0, 0.95, 0.5, 0.1, 0.999, 1e-6]
    actual = apply_top_p(logits, torch.tensor(ps, dtype=torch.float64))
    _exact(actual, _hf_rows([[TopPLogitsWarper(p)] for p in ps], logits))
    assert actual[5].isfinite().sum() == 1  # tiny p keeps only the most likely token


def test_top_p_threshold_edges_match_transformers() -> None:
    """Uniform rows make the cumulative probabilities exact: a token whose cumulative probability
    equals 1 - p is dropped, and a p so small that every cumsum is <= 1 - p still keeps one."""
    logits = torch.zeros(3, 8)
    ps = [0.5, 1e-9, 1.0]
    actual = apply_top_p(logits, torch.tensor(ps, dtype=torch.float64))
    expected = _hf_rows([[TopPLogitsWarper(p)] for p in ps], logits)
    assert actual.isfinite().sum(-1).tolist() == expected.isfinite().sum(-1).tolist() == [4, 1, 8]


def test_typical_p_matches_transformers() -> None:
    logits = apply_temperature(_logits(), torch.tensor([1.0, 0.5, 2.0, 1.0, 0.3, 1.0]))
    masses = [1.0, 0.9, 0.5, 0.2, 0.01, 0.99]
    actual = apply_typical_p(logits, torch.tensor(masses))
    expected = _hf_rows([[TypicalLogitsWarper(m)] if m < 1 else [] for m in masses], logits)
    _exact(actual, expected)
    assert actual[4].isfinite().sum() == 1


def test_filter_chain_matches_transformers() -> None:
    """The filters also agree when fed rows already holding -inf from an earlier filter."""
    logits = _logits()
    ks, ps, masses = [3, 40, 0, 200, 1, 10], [0.9, 0.6, 0.8, 1.0, 0.5, 0.99], [0.95, 0.7] * 3
    actual = apply_top_k(logits, torch.tensor(ks))
    actual = apply_top_p(actual, torch.tensor(ps, dtype=torch.float64))
    actual = apply_typical_p(actual, torch.tensor(masses))
    chains: list[list[LogitsProcessor]] = [
        [*([TopKLogitsWarper(k)] if k else []), TopPLogitsWarper(p), TypicalLogitsWarper(m)]
        for k, p, m in zip(ks, ps, masses, strict=True)
    ]
    _exact(actual, _hf_rows(chains, logits))


def _same_distribution(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Exactly the same -inf positions, probabilities within 1e-6."""
    assert torch.equal(actual.isinf(), expected.isinf())
    assert_close(actual.softmax(-1), expected.softmax(-1), rtol=0.0, atol=1e-6)


def test_min_p_matches_transformers() -> None:
    logits = apply_temperature(_logits(), torch.tensor([1.0, 0.5, 2.0, 1.0, 0.3, 1.0]))
    min_ps = [0.0, 0.05, 0.1, 0.5, 0.9, 1.0]
    actual = apply_min_p(logits, torch.tensor(min_ps))
    expected = _hf_rows([[MinPLogitsWarper(p)] if p else [] for p in min_ps], logits)
    _same_distribution(actual, expected)
    num_kept = actual.isfinite().sum(-1).tolist()
    assert num_kept[0] == VOCAB_SIZE and num_kept[5] == 1 and 1 < num_kept[1] < VOCAB_SIZE


def test_min_p_after_other_filters_matches_transformers() -> None:
    """In the sampler's order (HF's): temperature, top-k, top-p, min-p, typical-p."""
    logits = _logits()
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, typical_p=tp)
        for t, k, p, m, tp in [
            (0.7, 50, 0.9, 0.1, 1.0), (1.3, 0, 1.0, 0.02, 0.9), (1.0, 5, 0.95, 0.3, 0.8),
            (2.0, 0, 0.8, 0.0, 1.0), (0.5, 200, 1.0, 0.2, 0.95), (1.0, 0, 1.0, 0.01, 1.0),
        ]
    ]  # fmt: skip
    actual = apply_temperature(logits, torch.tensor([p.temperature for p in params]))
    actual = apply_top_k(actual, torch.tensor([p.top_k for p in params]))
    actual = apply_top_p(actual, torch.tensor([p.top_p for p in params], dtype=torch.float64))
    actual = apply_min_p(actual, torch.tensor([p.min_p for p in params]))
    actual = apply_typical_p(actual, torch.tensor([p.typical_p for p in params]))
    chains: list[list[LogitsProcessor]] = [
        [
            TemperatureLogitsWarper(p.temperature),
            *([TopKLogitsWarper(p.top_k)] if p.top_k else []),
            *([TopPLogitsWarper(p.top_p)] if p.top_p < 1 else []),
            *([MinPLogitsWarper(p.min_p)] if p.min_p else []),
            *([TypicalLogitsWarper(p.typical_p)] if p.typical_p < 1 else []),
        ]
        for p in params
    ]
    _same_distribution(actual, _hf_rows(chains, logits))


def test_min_tokens_matches_transformers() -> None:
    """Rows before their `min_tokens` have the stop ids at -inf, as HF's processor does with
    EOS; the others are untouched."""
    logits = _logits()
    stop_ids = [(2,), (2, 7), (5, 9, 11), (2,), (), (3, 4)]
    min_tokens = [3, 3, 1, 0, 4, 10]
    prompts, outputs = _token_ids([4, 2, 6, 3, 5, 1]), _token_ids([0, 2, 5, 1, 0, 9], seed=2)
    active = [
        ids if len(out) < k else ()
        for ids, k, out in zip(stop_ids, min_tokens, outputs, strict=True)
    ]
    actual = apply_min_tokens(logits, active)
    chains: list[list[LogitsProcessor]] = [
        [MinNewTokensLengthLogitsProcessor(len(prompt), k, list(ids))] if ids else []
        for prompt, k, ids in zip(prompts, min_tokens, stop_ids, strict=True)
    ]
    seen = [p + o for p, o in zip(prompts, outputs, strict=True)]
    expected = _hf_rows(chains, logits, seen)
    _same_distribution(actual, expected)
    assert actual.isinf().sum(-1).tolist() == [1, 2, 0, 0, 0, 2]


def test_min_tokens_masks_the_stop_ids_until_reached() -> None:
    """A greedy row whose favourite is its stop id takes the next best while its output is
    shorter than `min_tokens`, then the stop id; min_p leaves a greedy row alone."""
    logits = torch.zeros(3, 10)
    logits[:, 2], logits[:, 6] = 5.0, 3.0  # 2: the stop id, 6: the runner-up
    params = [
        SamplingParams(min_tokens=2, min_tokens_stop_ids=(2,)),
        SamplingParams(min_tokens=2, min_tokens_stop_ids=(2,), min_p=0.9),
        SamplingParams(min_tokens=2, min_tokens_stop_ids=(2,), temperature=1.0, min_p=0.5),
    ]
    assert not any(p.needs_only_argmax for p in params)
    sampler = Sampler(CPU)
    steps: list[tuple[list[int], list[int]]] = [([], [6] * 3), ([6], [6] * 3), ([6, 6], [2] * 3)]
    for output, expected in steps:
        inputs = SamplingInputs(params, [[1]] * 3, [output] * 3)
        assert sampler(logits, inputs).token_ids.tolist() == expected


def _bitmask(allowed: list[int], num_bits: int) -> bytes:
    words = [0] * (num_bits // 32)
    for token_id in allowed:
        words[token_id // 32] |= 1 << (token_id % 32)
    return b"".join(word.to_bytes(4, "little") for word in words)


def test_token_masks_leave_only_the_allowed_tokens() -> None:
    """Bit t of the little-endian words allows token t; columns past the mask (a vocabulary
    padded past the tokenizer's) are not allowed; a row without a mask is untouched."""
    logits = torch.randn(3, 70)
    masks = [_bitmask([0, 33, 63], 64), None, _bitmask([5], 96)]
    masked = apply_token_masks(logits, masks)
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [0, 33, 63]
    assert_close(masked[1], logits[1])
    assert torch.isfinite(masked[2]).nonzero().flatten().tolist() == [5]
    assert_close(masked[0, [0, 33, 63]], logits[0, [0, 33, 63]])


def test_a_masked_row_samples_only_allowed_tokens_greedy_or_not() -> None:
    logits = torch.zeros(2, 64)
    logits[:, 7] = 10.0  # the favourite, masked out
    logits[:, 40] = 1.0
    params = [SamplingParams(), SamplingParams(temperature=1.5, seed=1)]
    masks: list[bytes | None] = [_bitmask([3, 40], 64)] * 2
    for _ in range(20):
        inputs = SamplingInputs(params, [[1]] * 2, [[]] * 2, token_masks=masks)
        tokens = Sampler(CPU)(logits, inputs).token_ids.tolist()
        assert tokens[0] == 40 and tokens[1] in (3, 40)


def test_greedy_rows_take_argmax_after_penalties_and_logprobs_are_raw() -> None:
    raw = _logits()
    top_ids = raw.argmax(-1).tolist()
    params = [
        SamplingParams(),
        SamplingParams(repetition_penalty=1.5, logprobs=True, top_n_logprobs=3),
        SamplingParams(frequency_penalty=0.7, presence_penalty=0.4, top_n_logprobs=5),
        SamplingParams(temperature=0.8, top_k=20, top_n_logprobs=2),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.5),
        SamplingParams(repetition_penalty=1.2, presence_penalty=1.0, logprobs=True),
    ]
    prompts = [[t, t] for t in top_ids]  # every row's raw favourite is in its prompt ...
    outputs = [[*ids, t] for ids, t in zip(_token_ids([3, 0, 4, 2, 8, 1]), top_ids, strict=True)]
    untouched = raw.clone()
    out = Sampler(CPU)(raw, SamplingInputs(params, prompts, outputs))
    _exact(raw, untouched)

    seen = [prompt + output for prompt, output in zip(prompts, outputs, strict=True)]
    penalised = _hf_rows(
        [[RepetitionPenaltyLogitsProcessor(p.repetition_penalty)] for p in params], raw, seen
    )
    for i, (p, output) in enumerate(zip(params, outputs, strict=True)):
        for token_id in set(output):  # ... but only output tokens count for these two
            penalised[i, token_id] -= p.frequency_penalty * output.count(token_id)
            penalised[i, token_id] -= p.presence_penalty
    greedy = [0, 1, 2, 4, 5]
    assert out.token_ids[greedy].tolist() == penalised[greedy].argmax(-1).tolist()
    assert all(out.token_ids[i] != top_ids[i] for i in [1, 2, 5])  # the penalties mattered

    log_probs = raw.log_softmax(-1)
    assert out.token_ids.dtype == torch.int64
    assert out.top_token_ids is not None
    assert_close(out.logprobs, log_probs.gather(-1, out.token_ids[:, None]).squeeze(-1))
    expected_top = log_probs.topk(5, dim=-1)
    assert torch.equal(out.top_token_ids, expected_top.indices)
    assert_close(out.top_logprobs, expected_top.values)


def test_logprobs_are_skipped_unless_a_row_asks() -> None:
    logits = torch.randn(3, 50)
    inputs = SamplingInputs([SamplingParams()] * 3, [[1]] * 3, [[]] * 3)
    out = Sampler(torch.device("cpu"))(logits, inputs)
    assert out.logprobs is None and out.top_token_ids is None and out.top_logprobs is None
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


def test_frequency_presence_count_output_tokens_only() -> None:
    raw = _logits(num_rows=2)
    top_ids = raw.argmax(-1).tolist()
    params = [SamplingParams(frequency_penalty=50.0, presence_penalty=50.0)] * 2
    inputs = SamplingInputs(params, [[top_ids[0]], []], [[], [top_ids[1]]])
    token_ids = Sampler(CPU)(raw, inputs).token_ids.tolist()
    assert token_ids[0] == top_ids[0]
    assert token_ids[1] != top_ids[1]


def _step_logits(step: int) -> torch.Tensor:
    return _logits(num_rows=1, seed=100 + step)


def _seeded_sequence(params: SamplingParams, num_steps: int = 20) -> list[int]:
    """One row alone, with a fresh Sampler every step (as when a preempted row is recomputed)."""
    output: list[int] = []
    for step in range(num_steps):
        inputs = SamplingInputs([params], [[1, 2, 3]], [list(output)])
        output.append(int(Sampler(CPU)(_step_logits(step), inputs).token_ids[0]))
    return output


def test_seeded_row_is_reproducible_alone_in_any_batch_and_after_recompute() -> None:
    target = SamplingParams(temperature=0.9, top_k=100, top_p=0.95, repetition_penalty=1.1, seed=7)
    others = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.8, seed=99),
        SamplingParams(),
        SamplingParams(temperature=1.2, typical_p=0.9, seed=7),  # same seed, other logits
    ]
    other_outputs = _token_ids([4, 9, 0, 13])
    expected = _seeded_sequence(target)
    batch_sampler = Sampler(CPU)
    output: list[int] = []
    for step, expected_id in enumerate(expected):
        position = step % (len(others) + 1)
        params = [*others[:position], target, *others[position:]]
        outputs = [*other_outputs[:position], output, *other_outputs[position:]]
        other_logits = _logits(num_rows=len(others), seed=1000 + step)
        logits = torch.cat([other_logits[:position], _step_logits(step), other_logits[position:]])
        inputs = SamplingInputs(params, [[1, 2, 3]] * len(params), outputs)
        assert int(batch_sampler(logits, inputs).token_ids[position]) == expected_id
        output.append(expected_id)
    assert len(set(expected)) > 1


def test_seeded_draw_depends_on_the_output_length_not_its_contents() -> None:
    logits = _step_logits(0)
    params = [SamplingParams(temperature=1.0, seed=5)]
    sampler = Sampler(CPU)
    by_length = [
        int(sampler(logits, SamplingInputs(params, [[]], [[0] * n])).token_ids[0])
        for n in range(10)
    ]
    assert len(set(by_length)) > 1
    other_contents = SamplingInputs(params, [[1, 2]], [list(range(3, 12))])
    assert int(sampler(logits, other_contents).token_ids[0]) == by_length[9]


def test_different_seeds_give_different_sequences() -> None:
    first = _seeded_sequence(SamplingParams(temperature=1.0, seed=1234))
    assert first == _seeded_sequence(SamplingParams(temperature=1.0, seed=1234))
    assert first != _seeded_sequence(SamplingParams(temperature=1.0, seed=4321))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.7),
        SamplingParams(temperature=1.5),
        SamplingParams(temperature=0.5, typical_p=0.9, top_k=4),
    ],
)
def test_unseeded_draws_follow_the_filtered_softmax(params: SamplingParams) -> None:
    num_draws = 20_000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    chain: list[LogitsProcessor] = [TemperatureLogitsWarper(params.temperature)]
    chain += [TopKLogitsWarper(params.top_k)] if params.top_k else []
    chain += [TopPLogitsWarper(params.top_p)] if params.top_p < 1 else []
    chain += [TypicalLogitsWarper(params.typical_p)] if params.typical_p < 1 else []
    expected = _hf_rows([chain], logits).softmax(-1)[0]

    batch = logits.expand(num_draws, -1).contiguous()
    empty: list[list[int]] = [[] for _ in range(num_draws)]
    inputs = SamplingInputs([params] * num_draws, empty, empty)
    token_ids = Sampler(CPU)(batch, inputs).token_ids
    frequencies = torch.bincount(token_ids, minlength=5).double() / num_draws
    assert frequencies[expected == 0].sum() == 0  # filtered tokens never appear
    assert_close(frequencies, expected.double(), rtol=0.0, atol=0.02)  # ~6 standard deviations
