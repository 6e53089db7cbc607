"""Turn one step's logits `[N, V]` into one token per row, each row with its own SamplingParams.

First a row under a grammar (structured output) has every token outside its bitmask set to -inf,
as vLLM does, so the processors below only ever see allowed tokens. They run in this order (that
of Hugging Face `generate` and TGI):

0. min_tokens (vLLM): while a row has generated fewer than `min_tokens` tokens, its
   `min_tokens_stop_ids` (EOS, stop token ids) are set to -inf, as transformers'
   `MinNewTokensLengthLogitsProcessor` does with EOS.
1. repetition penalty (HF/TGI): a token seen in the prompt or the output has its logit divided by
   the penalty when positive, multiplied when negative; once per token, however often it was seen.
2. frequency/presence penalty (OpenAI): `logit -= frequency * count + presence * (count > 0)`,
   counting OUTPUT tokens only.
3. greedy rows (`temperature == 0`) take the argmax here and skip the rest.
4. temperature, 5. top-k, 6. top-p, 7. min-p, 8. typical-p. Each filter sets removed logits to
   -inf and keeps at least one token; ties and thresholds follow transformers'
   `TopKLogitsWarper`, `TopPLogitsWarper`, `MinPLogitsWarper` and `TypicalLogitsWarper` exactly
   (min_tokens_to_keep=1).
9. sample by exponential race: `argmax(probs / E)` with `E ~ Exp(1)` per token picks token i with
   probability `probs[i]`, so a row needs one draw of V exponentials.

The processors are pure functions over all rows at once, with per-row `[N]` parameter tensors; a
row whose knob is off passes through unchanged, and the sampler skips a processor no row uses.

Randomness: unseeded rows share one batched draw from the Sampler's generator. A seeded row's draw
depends only on (seed, number of output tokens so far): a generator is re-seeded from a splitmix64
mix of the two, so a seed replays the same tokens whatever else is in the batch, and again after
the sequence is preempted and recomputed.

Logprobs (chosen token and top-n) are those of the RAW logits, before any processor, and are only
computed when some row asks for them (`logprobs` or `top_n_logprobs`): over a 32k vocabulary at
batch 16 the log-normaliser costs more than the rest of sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tgq.gpu_worker.plan import SamplingParams
from tgq.kernels import cpu_ops

_MASK64 = (1 << 64) - 1
_NEG_INF = float("-inf")
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


@dataclass
class SamplingInputs:
    params: list[SamplingParams]  # one per row of logits
    prompt_token_ids: list[list[int]]  # per row, for the repetition penalty
    output_token_ids: list[list[int]]  # per row, generated so far: penalties and the seeded step
    # per row, the grammar's bitmask of allowed tokens (`plan.StepPlan.token_masks`), or None
    token_masks: list[bytes | None] | None = None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    # None when no row asked for logprobs:
    logprobs: torch.Tensor | None  # [N] float32, log_softmax(raw logits) at the chosen token
    top_token_ids: torch.Tensor | None  # [N, max_n] int64, max_n = max top_n_logprobs (<= V)
    top_logprobs: torch.Tensor | None  # [N, max_n] float32, log_softmax(raw logits), descending


def apply_repetition_penalty(
    logits: torch.Tensor, token_mask: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """token_mask: [N, V] bool, tokens seen in prompt or output; penalty: [N], 1.0 is off."""
    penalty = _column(penalty, logits)
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(token_mask, penalised, logits)


def apply_frequency_presence(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """output_counts: [N, V], occurrences of each token in the OUTPUT; frequency, presence: [N]."""
    counts = output_counts.to(logits.dtype)
    is_present = (counts > 0).to(logits.dtype)
    return logits - (_column(frequency, logits) * counts + _column(presence, logits) * is_present)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """temperature: [N], > 0 (greedy rows never get here)."""
    return logits / _column(temperature, logits)


def apply_top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits, ties with the k-th included. k: [N] int, 0 keeps all."""
    max_k = min(int(k.max()), logits.shape[-1])
    if max_k == 0:
        return logits
    kth = logits.topk(max_k, dim=-1).values.gather(-1, k.clamp(1, max_k)[:, None] - 1)
    kth = kth.masked_fill((k == 0)[:, None], _NEG_INF)
    return logits.masked_fill(logits < kth, _NEG_INF)


def apply_top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Nucleus filter, p: [N] (1.0 is off). As in HF: sort ascending, drop the tokens whose
    cumulative probability is <= 1 - p, and always keep the most likely one."""
    sorted_logits, order = logits.sort(dim=-1)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    # 1 - p in float64, then rounded to the logits dtype: what HF's Python-float threshold becomes.
    threshold = (1.0 - p.to(torch.float64)).to(logits.dtype)[:, None]
    is_removed = cumulative <= threshold
    is_removed[:, -1] = False
    return logits.masked_fill(_unsort(is_removed, order), _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop the tokens whose probability is below min_p * the row's top probability; min_p: [N]
    (0.0 is off). The top token always stays (its probability is never below the threshold)."""
    probs = logits.softmax(-1)
    threshold = _column(min_p, probs) * probs.amax(-1, keepdim=True)
    return logits.masked_fill(probs < threshold, _NEG_INF)


def token_mask_words(masks: list[bytes | None], num_bytes: int) -> torch.Tensor:
    """[N, num_bytes / 4] int32: the bitmasks as words, each padded with zeros (tokens not
    allowed) to `num_bytes`, a multiple of 4; a None row allows every token."""
    packed = b"".join(
        b"\xff" * num_bytes if mask is None else mask.ljust(num_bytes, b"\0") for mask in masks
    )
    return torch.frombuffer(bytearray(packed), dtype=torch.int32).view(len(masks), -1)


def apply_token_masks(
    logits: torch.Tensor,
    masks: list[bytes | None],
    *,
    in_place: bool = False,
    custom_kernels: bool = True,
) -> torch.Tensor:
    """Sets every token outside row i's bitmask `masks[i]` to -inf (None: the row is free).
    Bit `t % 32` of little-endian 32-bit word `t // 32` allows token t; columns past the mask's
    end (a model vocabulary padded beyond the tokenizer's) are not allowed. `in_place` when the
    raw logits are not needed afterwards (no row asked for logprobs); `custom_kernels=False`
    (`--disable-custom-kernels`): torch ops only, the C++ kernels are never built."""
    rows = [i for i, mask in enumerate(masks) if mask is not None]
    if not rows:
        return logits
    width = max(len(masks[i] or b"") for i in rows)  # one tokenizer: all alike, but be sure
    words = token_mask_words([masks[i] for i in rows], width)
    masked = logits if in_place else logits.clone()
    is_cpu_fp32 = logits.device.type == "cpu" and logits.dtype == torch.float32
    if custom_kernels and is_cpu_fp32 and masked.is_contiguous() and cpu_ops.is_available():
        cpu_ops.apply_token_mask_(masked, words, torch.tensor(rows, dtype=torch.int64))
        return masked
    bits = (words.view(len(rows), -1, 1) >> _BIT_SHIFTS) & 1
    allowed = bits.view(len(rows), -1).to(torch.bool)
    vocab_size = logits.shape[-1]
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]))
    allowed = allowed[:, :vocab_size].to(logits.device)
    masked[rows] = masked[rows].masked_fill(~allowed, _NEG_INF)
    return masked


def apply_min_tokens(logits: torch.Tensor, stop_ids: list[tuple[int, ...]]) -> torch.Tensor:
    """Sets row i's `stop_ids[i]` to -inf (empty for the rows past their min_tokens)."""
    vocab_size = logits.shape[-1]
    cells = [(row, i) for row, ids in enumerate(stop_ids) for i in ids if 0 <= i < vocab_size]
    if not cells:
        return logits
    rows, columns = zip(*cells, strict=True)
    masked = logits.clone()
    masked[list(rows), list(columns)] = _NEG_INF
    return masked


def apply_typical_p(logits: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Locally typical filter, mass: [N] (1.0 is off). As in HF: rank tokens by
    |-log p - entropy|, find the first rank where the cumulative probability reaches `mass`, and
    drop the tokens strictly farther than it."""
    log_probs = logits.log_softmax(-1)
    entropy = -(log_probs * log_probs.exp()).nansum(-1, keepdim=True)
    distance, order = (-log_probs - entropy).abs().sort(dim=-1)
    cumulative = logits.gather(-1, order).softmax(-1).cumsum(-1)
    mass = mass.to(logits.dtype)[:, None]
    last = (cumulative < mass).sum(-1, keepdim=True).clamp_(max=logits.shape[-1] - 1)
    # Strictly farther than the cutoff: the best-ranked token (sorted first) always stays.
    is_removed = (distance > distance.gather(-1, last)) & (mass < 1.0)
    return logits.masked_fill(_unsort(is_removed, order), _NEG_INF)


class Sampler:
    """One call per step. Owns a randomly seeded generator for unseeded rows, and one it re-seeds
    for each seeded row."""

    def __init__(self, device: torch.device, *, custom_kernels: bool = True) -> None:
        """`custom_kernels=False` (`--disable-custom-kernels`): torch ops only, the C++ kernels
        are never built."""
        self._generator = torch.Generator(device)
        self._generator.seed()
        self._seeded_generator = torch.Generator(device)
        self._custom_kernels = custom_kernels
        # torch's CPU argmax is scalar: ~220 us over [16, 32000] logits, the kernel's ~15 us.
        self._cpu_argmax = custom_kernels and device.type == "cpu" and cpu_ops.is_available()

    def _argmax(self, x: torch.Tensor) -> torch.Tensor:
        if self._cpu_argmax and x.dtype == torch.float32:
            return cpu_ops.argmax(x)
        return x.argmax(-1)

    def __call__(self, logits: torch.Tensor, inputs: SamplingInputs) -> SamplerOutput:
        params = inputs.params
        processed = _penalise(logits, inputs, custom_kernels=self._custom_kernels)
        token_ids = torch.empty(len(params), dtype=torch.int64, device=logits.device)
        greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
        sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if greedy_rows:
            token_ids[greedy_rows] = self._argmax(_take_rows(processed, greedy_rows))
        if sampled_rows:
            token_ids[sampled_rows] = self._sample(
                _take_rows(processed, sampled_rows),
                [params[i] for i in sampled_rows],
                [len(inputs.output_token_ids[i]) for i in sampled_rows],
            )
        if not any(p.wants_logprobs for p in params):
            return SamplerOutput(token_ids, None, None, None)
        return _with_logprobs(logits, token_ids, max((p.top_n_logprobs for p in params), default=0))

    def _sample(
        self, logits: torch.Tensor, params: list[SamplingParams], steps: list[int]
    ) -> torch.Tensor:
        if any(p.temperature != 1.0 for p in params):
            logits = apply_temperature(logits, _param([p.temperature for p in params], logits))
        if any(p.top_k > 0 for p in params):
            logits = apply_top_k(logits, _param([p.top_k for p in params], logits, torch.int64))
        if any(p.top_p < 1.0 for p in params):
            logits = apply_top_p(logits, _param([p.top_p for p in params], logits, torch.float64))
        if any(p.min_p > 0.0 for p in params):
            logits = apply_min_p(logits, _param([p.min_p for p in params], logits))
        if any(p.typical_p < 1.0 for p in params):
            logits = apply_typical_p(logits, _param([p.typical_p for p in params], logits))
        probs = logits.softmax(-1)
        return self._argmax(probs / self._exponentials(params, steps, probs))

    def _exponentials(
        self, params: list[SamplingParams], steps: list[int], probs: torch.Tensor
    ) -> torch.Tensor:
        """[n, V] Exp(1) noise; clamped away from 0 so a filtered token (prob 0) never wins."""
        noise = torch.empty_like(probs)
        unseeded_rows = [i for i, p in enumerate(params) if p.seed is None]
        if len(unseeded_rows) == len(params):
            noise.exponential_(generator=self._generator)
        elif unseeded_rows:
            draw = torch.empty_like(noise[unseeded_rows]).exponential_(generator=self._generator)
            noise[unseeded_rows] = draw
        for i, (p, step) in enumerate(zip(params, steps, strict=True)):
            if p.seed is not None:
                self._seeded_generator.manual_seed(_step_seed(p.seed, step))
                noise[i].exponential_(generator=self._seeded_generator)
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _step_seed(seed: int, step: int) -> int:
    """The 64-bit generator seed for a seeded row's draw at output position `step`."""
    return _splitmix64((_splitmix64(seed & _MASK64) + step) & _MASK64)


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _penalise(
    logits: torch.Tensor, inputs: SamplingInputs, *, custom_kernels: bool
) -> torch.Tensor:
    params = inputs.params
    if inputs.token_masks is not None:
        raw_needed = any(p.wants_logprobs for p in params)  # logprobs read the raw logits
        logits = apply_token_masks(
            logits,
            inputs.token_masks,
            in_place=not raw_needed,
            custom_kernels=custom_kernels,
        )
    stop_ids = [
        p.min_tokens_stop_ids if p.masks_stop_ids and len(output) < p.min_tokens else ()
        for p, output in zip(params, inputs.output_token_ids, strict=True)
    ]
    if any(stop_ids):
        logits = apply_min_tokens(logits, stop_ids)
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = [
            prompt + output if p.repetition_penalty != 1.0 else []
            for p, prompt, output in zip(
                params, inputs.prompt_token_ids, inputs.output_token_ids, strict=True
            )
        ]
        penalty = _param([p.repetition_penalty for p in params], logits)
        logits = apply_repetition_penalty(logits, token_counts(seen, logits) > 0, penalty)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        counts = token_counts(inputs.output_token_ids, logits)
        frequency = _param([p.frequency_penalty for p in params], logits)
        presence = _param([p.presence_penalty for p in params], logits)
        logits = apply_frequency_presence(logits, counts, frequency, presence)
    return logits


def token_counts(token_ids: list[list[int]], logits: torch.Tensor) -> torch.Tensor:
    """[N, V] occurrences of each token id per row, in the logits dtype, by one scatter_add over
    ids padded with V (a spare column, cut off afterwards)."""
    num_rows, vocab_size = logits.shape
    width = max(map(len, token_ids), default=0)
    padded = torch.tensor(
        [ids + [vocab_size] * (width - len(ids)) for ids in token_ids],
        dtype=torch.int64,
        device=logits.device,
    ).view(num_rows, width)
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=logits.dtype))
    return counts[:, :vocab_size]


def _with_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, max_n: int) -> SamplerOutput:
    raw = raw.float()
    log_norm = raw.logsumexp(-1, keepdim=True)
    chosen = raw.gather(-1, token_ids[:, None]) - log_norm
    top_values, top_ids = raw.topk(min(max_n, raw.shape[-1]), dim=-1)
    return SamplerOutput(token_ids, chosen.squeeze(-1), top_ids, top_values - log_norm)


def _unsort(sorted_mask: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Map a mask over sorted positions back to vocabulary positions."""
    return sorted_mask.scatter(-1, order, sorted_mask)


def _take_rows(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return tensor if len(rows) == tensor.shape[0] else tensor[rows]


def _param(
    values: list[float] | list[int], like: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A per-row [N] parameter tensor on the logits' device (in their dtype unless given)."""
    return torch.tensor(values, dtype=dtype or like.dtype, device=like.device)


def _column(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return values.to(dtype=like.dtype, device=like.device)[:, None]
