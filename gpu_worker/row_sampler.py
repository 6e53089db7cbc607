"""Sampling a step's rows for the model runner: the greedy head for rows that need only the
argmax (under a grammar, the argmax of the tokens it allows, checking the free argmax first where
the plan's masks allow it: `plan.ArgmaxFirst`), the sampler for the rest, one output for all.
A sequence verifying k drafts has k + 1 rows, each under its own grammar mask."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import torch

from tgq.gpu_worker.models.decoder import DecoderForCausalLM
from tgq.gpu_worker.plan import ArgmaxFirst, SamplingParams
from tgq.gpu_worker.sampling import Sampler, SamplerOutput, SamplingInputs, token_mask_words


@dataclass
class RunnerSequence:
    """What the runner keeps of a sequence: its tokens (sampled ones appended) and blocks."""

    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: list[int] = field(default_factory=list)
    adapter_slot: int = 0  # its LoRA adapter's (`gpu_worker.lora`; 0: the base model)


class RowSampler:
    def __init__(
        self,
        model: DecoderForCausalLM,
        sampler: Sampler,
        sequences: Mapping[str, RunnerSequence],
    ) -> None:
        """`model`: for its greedy head and logits; `sequences`: the runner's, by request id."""
        self.model = model
        self.sampler = sampler
        self.sequences = sequences
        self._token_masks: Mapping[str, bytes] = {}  # the step's (structured output)
        self._num_rows: Mapping[str, int] = {}  # the step's rows of sequences verifying drafts

    def sample(
        self,
        hidden: torch.Tensor,
        request_ids: list[str],
        lengths: list[int],
        token_masks: Mapping[str, bytes],
        num_rows: Mapping[str, int],
    ) -> SamplerOutput | None:
        """The next token of each row (None on a rank that does not sample). Rows that only need
        the argmax (greedy, no penalties, no logprobs) take it from the model's greedy head where
        it has one, without computing their logits (under a grammar, the argmax of the tokens
        it allows). `lengths`: each row's tokens before the one it samples (a sequence's rows
        under speculation see the drafts before them). `token_masks`: the step's grammar masks
        (`StepPlan.token_masks`); `num_rows`: the rows of each sequence verifying drafts."""
        self._token_masks, self._num_rows = token_masks, num_rows
        model = self.model
        argmax_rows = [
            row
            for row, request_id in enumerate(request_ids)
            if self.sequences[request_id].sampling.needs_only_argmax
        ]
        every_row = len(argmax_rows) == len(request_ids)
        greedy = (
            self._greedy(
                hidden if every_row else hidden[argmax_rows],
                [request_ids[row] for row in argmax_rows],
            )
            if argmax_rows
            else None
        )
        if greedy is None:
            logits = model.compute_logits(hidden)
            return (
                None
                if logits is None
                else self.sampler(logits, self._sampling_inputs(request_ids, lengths))
            )
        if every_row:
            return SamplerOutput(greedy, None, None, None)
        taken = set(argmax_rows)
        rest = [row for row in range(len(request_ids)) if row not in taken]
        logits = model.compute_logits(hidden[rest])
        assert logits is not None  # a model with a greedy head samples on this rank
        sampled = self.sampler(
            logits,
            self._sampling_inputs([request_ids[r] for r in rest], [lengths[r] for r in rest]),
        )
        return merge_rows(len(request_ids), argmax_rows, greedy, rest, sampled)

    def _greedy(self, hidden: torch.Tensor, request_ids: list[str]) -> torch.Tensor | None:
        """The model's greedy-head argmax of these rows, each under its grammar's mask (None:
        no greedy head). Rows that check their argmax first (`plan.ArgmaxFirst`) take it over
        every token; those whose grammar does not allow it take it again under their mask."""
        model = self.model
        masks = self._token_masks
        first = (
            {row for row, request_id in enumerate(request_ids)
             if masks.checks_argmax_first(request_id)}
            if isinstance(masks, ArgmaxFirst)
            else set()
        )  # fmt: skip
        tokens = model.greedy_tokens(hidden, self._greedy_masks(request_ids, free_rows=first))
        if tokens is None or not first:
            return tokens
        assert isinstance(masks, ArgmaxFirst)
        chosen = tokens.tolist()
        missed = [row for row in sorted(first) if not masks.allows(request_ids[row], chosen[row])]
        if missed:
            again = model.greedy_tokens(
                hidden[missed], self._greedy_masks([request_ids[row] for row in missed])
            )
            assert again is not None
            tokens[missed] = again
        return tokens

    def _greedy_masks(
        self, request_ids: list[str], free_rows: Collection[int] = ()
    ) -> torch.Tensor | None:
        """[N, W] int32 bitmasks of these rows for the greedy head (all ones for a row without
        a grammar or in `free_rows`, zeros past a mask's end); None when all rows are free."""
        if not self._token_masks:
            return None
        masks = self._row_masks(request_ids, free_rows)
        if all(mask is None for mask in masks):
            return None
        vocab_bytes = (self.model.config.vocab_size + 31) // 32 * 4
        width = max(vocab_bytes, *(len(mask) for mask in masks if mask is not None))
        return token_mask_words(masks, width)

    def _row_masks(
        self, request_ids: list[str], free_rows: Collection[int] = ()
    ) -> list[bytes | None]:
        """Each row's grammar mask (None: no grammar, or in `free_rows`). A sequence verifying k
        drafts has k + 1 masks one after another (`StepPlan.token_masks`), its rows' in order;
        its rows come together and in order here."""
        masks: list[bytes | None] = []
        seen: dict[str, int] = {}
        for row, request_id in enumerate(request_ids):
            mask = None if row in free_rows else self._token_masks.get(request_id)
            num_rows = self._num_rows.get(request_id, 1)
            if mask is not None and num_rows > 1:
                index = seen[request_id] = seen.get(request_id, -1) + 1
                size = len(mask) // num_rows
                mask = mask[index * size : (index + 1) * size]
            masks.append(mask)
        return masks

    def _sampling_inputs(self, request_ids: list[str], lengths: list[int]) -> SamplingInputs:
        seqs = [self.sequences[request_id] for request_id in request_ids]
        return SamplingInputs(
            params=[s.sampling for s in seqs],
            prompt_token_ids=[s.token_ids[: s.num_prompt_tokens] for s in seqs],
            output_token_ids=[
                s.token_ids[s.num_prompt_tokens : n] for s, n in zip(seqs, lengths, strict=True)
            ],
            token_masks=self._row_masks(request_ids) if self._token_masks else None,
        )


def merge_rows(
    num_rows: int,
    greedy_rows: list[int],
    greedy: torch.Tensor,
    sampled_rows: list[int],
    sampled: SamplerOutput,
) -> SamplerOutput:
    """One output for all rows: the greedy head's tokens and the sampler's tokens and logprobs
    (zeros in the greedy rows, which asked for none)."""
    token_ids = torch.empty(num_rows, dtype=torch.int64, device=greedy.device)
    token_ids[greedy_rows] = greedy
    token_ids[sampled_rows] = sampled.token_ids

    def spread(values: torch.Tensor | None) -> torch.Tensor | None:
        if values is None:
            return None
        out = values.new_zeros((num_rows, *values.shape[1:]))
        out[sampled_rows] = values
        return out

    return SamplerOutput(
        token_ids,
        spread(sampled.logprobs),
        spread(sampled.top_token_ids),
        spread(sampled.top_logprobs),
    )
