"""The model runner: executes one `StepPlan` and returns the sampled tokens.

It owns the model, the paged KV cache, the sampler, and per-sequence state (token ids and block
table), which the plan updates with diffs; see `gpu_worker.plan` for the contract.

With tensor parallelism every rank runs a `ModelRunner` over its slice of the model and of the
KV cache, executing the same plans; rank 0 samples and its tokens are broadcast to the others
(which keep the same per-sequence state); only rank 0's `StepResult` carries them.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from tgq.gpu_worker.config import ModelConfig
from tgq.gpu_worker.drafter import Drafter, DraftRequest
from tgq.gpu_worker.host_memory import keep_freed_memory
from tgq.gpu_worker.kv_cache import allocate_kv_cache, num_blocks_for_budget
from tgq.gpu_worker.loader import LoadedModel, load_model
from tgq.gpu_worker.lora import load_adapters
from tgq.gpu_worker.parallel import SINGLE, TensorParallel
from tgq.gpu_worker.plan import (
    PromptLogprobs,
    SampledToken,
    ScheduledChunk,
    StepPlan,
    StepResult,
    TokenLogprob,
    accepted_length,
)
from tgq.gpu_worker.row_sampler import RowSampler, RunnerSequence
from tgq.gpu_worker.sampling import Sampler, SamplerOutput
from tgq.kernels import (
    AttentionBackend,
    AttentionStep,
    SeqSpan,
    block_size_rule,
    cpu_ops,
    get_backend,
)
from tgq.kernels.cpu_paged import CpuPagedAttention
from tgq.kernels.interface import UNIT_SCALES, KvScales
from tgq.kernels.kv_write import FP8_CACHE_DTYPES

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 1 << 30
PROMPT_LOGPROB_ROWS = 256  # prompt positions scored per pass (their fp32 logits: 32 MB at 32K)


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    model_id: str
    revision: str | None = None
    cache_dir: str | None = None
    dtype: str | None = None  # None/"auto": the checkpoint's (bf16 instead of fp16 on CPU)
    device: str = "cpu"
    block_size: int | None = None  # None: the attention backend's default (kernels registry)
    num_blocks: int | None = None  # None: as many as `kv_cache_bytes` holds
    kv_cache_bytes: int | None = None  # None: 1 GiB on CPU, 90% of free memory on CUDA
    attention_backend: str = "auto"
    # bf16 on AVX512_BF16 + VNNI CPUs: argmax-only rows from the int8-screened lm_head
    # (kernels.greedy_head; same tokens, costs N x K bytes and keeps an untied head's rows).
    greedy_head: bool = True
    # False (TGI's --disable-custom-kernels): the torch attention backend and plain torch ops,
    # none of the C++ CPU kernels (linear, norms, greedy head, decode path) nor flash-attn.
    custom_kernels: bool = True
    quantize: str | None = None  # "int8" or "fp8" (`--quantize`): the linears quantized at load
    # "auto": the model's dtype; "fp8" / "fp8_e4m3" (`--kv-cache-dtype`): E4M3, one byte a value;
    # "fp8_e5m2": E5M2 (more range, less precision)
    kv_cache_dtype: str = "auto"
    # `--speculative-model`: a draft model's directory (the same tokenizer), for chunks that ask
    # for model drafts (`ScheduledChunk.num_model_drafts`; `gpu_worker.drafter`).
    speculative_model: str | None = None
    # `--lora-adapters`: (name, PEFT checkpoint directory) of each LoRA adapter served
    # (`gpu_worker.lora`); a sequence picks one by name (`NewSequence.adapter`).
    lora_adapters: tuple[tuple[str, str], ...] = ()


class ModelRunner:
    def __init__(
        self, config: RunnerConfig, loaded: LoadedModel | None = None, tp: TensorParallel = SINGLE
    ) -> None:
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()
        self.loaded = loaded or load_model(
            config.model_id,
            device=self.device,
            dtype=config.dtype,
            revision=config.revision,
            cache_dir=config.cache_dir,
            cpu_kernels=config.custom_kernels,
            greedy_head=config.greedy_head,
            tp=tp,
            quantize=config.quantize,
        )
        self.tp = self.loaded.tp
        self.backend, self.block_size = pick_attention(config, self.device)
        local = self.loaded.local_config  # this rank's KV heads
        if isinstance(self.backend, CpuPagedAttention):  # its prefill kernel, by measurement
            self.backend.choose_kernels(
                local.num_heads, local.num_kv_heads, local.head_dim, self.loaded.dtype
            )
        self.kv_dtype = kv_cache_dtype(config, self.loaded.dtype, self.backend)
        if isinstance(self.backend, CpuPagedAttention):
            self.backend.use_kv_dtype(self.kv_dtype, self.loaded.dtype)
        self.kv_scales = use_kv_scales(self.loaded, self.kv_dtype)
        self.num_blocks = config.num_blocks or num_blocks_for_budget(
            local, self.block_size, self.kv_dtype, kv_budget(config, self.device)
        )
        self.kv_caches = allocate_kv_cache(
            local, self.num_blocks, self.block_size, self.kv_dtype, self.device
        )
        self.drafts_by_model = config.speculative_model is not None  # `num_model_drafts`
        self.drafter = self._drafter(config)
        self.sequences: dict[str, RunnerSequence] = {}
        sampler = Sampler(self.device, custom_kernels=config.custom_kernels)
        self.rows = RowSampler(self.loaded.model, sampler, self.sequences)
        if config.lora_adapters and self.tp.world_size > 1:
            raise ValueError("--lora-adapters is not supported with --num-shard > 1")
        self.adapters = load_adapters(
            self.loaded.model,
            dict(config.lora_adapters),
            self.loaded.dtype,
            packed=self.loaded.num_cpu_kernel_modules > 0
            and self.loaded.dtype == torch.bfloat16
            and cpu_ops.has_avx512_bf16(),
        )
        if config.lora_adapters:
            log.info("LoRA adapters %s", ", ".join(name for name, _ in config.lora_adapters))

    def _drafter(self, config: RunnerConfig) -> Drafter | None:
        """The draft model's runner over this one's block tables (`--speculative-model`); with
        tensor parallelism on rank 0 only, the whole draft model, guessing for every rank
        (`_model_drafts`)."""
        if config.speculative_model is None or not self.tp.is_first:
            return None
        draft_config = dataclasses.replace(
            config,
            model_id=config.speculative_model,
            revision=None,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            quantize=None,
            kv_cache_dtype="auto",
            speculative_model=None,
            lora_adapters=(),
        )
        drafter = Drafter(ModelRunner(draft_config))
        draft_vocab = drafter.runner.model_config.vocab_size
        if draft_vocab > self.model_config.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft_vocab} tokens) is larger than the"
                f" target's ({self.model_config.vocab_size}): it needs the same tokenizer"
            )
        log.info("speculative draft model %s", config.speculative_model)
        return drafter

    @property
    def model_config(self) -> ModelConfig:
        """The model's config (the engine's scheduler reads its rope's prefix-cache salts)."""
        return self.loaded.model.config

    @property
    def adapter_names(self) -> frozenset[str]:
        """The LoRA adapters a sequence may name (`RunnerConfig.lora_adapters`)."""
        return frozenset(self.adapters.slots)

    @property
    def checks_argmax_first(self) -> bool:
        """Whether constrained greedy rows may check their argmax against the grammar before
        their mask is computed (`plan.ArgmaxFirst`): where the model has a greedy head, whose
        argmax costs no logits. Without one every row's logits are computed, and the masks are
        best computed up front, together (on llguidance's pool where it runs)."""
        return self.loaded.model.greedy_head is not None

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Runs one step. A plan that breaks the contract raises ValueError before any state
        changes, so the runner stays usable (and in step with the scheduler) afterwards."""
        self._validate(plan)
        self._take_sequences(plan)
        if not plan.chunks:
            return StepResult()
        # Single-token chunks first: the attention backends batch them in one call. A chunk
        # with drafts is single-token rows too (`_flatten`). Then by LoRA adapter: each
        # adapter's rows in runs (`lora.AdapterRows`).
        chunks = sorted(
            plan.chunks,
            key=lambda c: (
                c.num_new_tokens != 1 and not c.num_drafts,
                self.sequences[c.request_id].adapter_slot,
            ),
        )
        for chunk in chunks:
            self.sequences[chunk.request_id].block_ids.extend(chunk.new_block_ids)
        chunks = self._model_drafts(chunks)
        for chunk in chunks:
            seq = self.sequences[chunk.request_id]
            seq.token_ids.extend(chunk.draft_token_ids)  # for this step only (`_keep`)
        try:
            inputs = self._flatten(chunks)
            meta = self.backend.prepare(inputs.attention, self.device)
            if self.adapters.slots:
                slots = [self.sequences[c.request_id].adapter_slot for c in chunks]
                counts = [c.num_new_tokens for c in chunks]
                rows = [slot for slot, n in zip(slots, counts, strict=True) for _ in range(n)]
                self.adapters.use(rows, self.device)
            hidden = self.loaded.model(
                inputs.input_ids,
                inputs.positions,
                self.kv_caches,
                self.backend,
                meta,
                inputs.lengths,
            )
            prompt = self._prompt_logprobs(chunks, hidden)
            if not inputs.sample_request_ids:
                return StepResult(prompt_logprobs=prompt)
            if len(inputs.sample_request_ids) < hidden.shape[0]:  # else every row, in order
                hidden = hidden[inputs.sample_rows]
            rows_of = {c.request_id: c.num_drafts + 1 for c in chunks if c.num_drafts}
            output = self.rows.sample(
                hidden,
                inputs.sample_request_ids,
                inputs.sample_lengths,
                plan.token_masks,
                rows_of,
            )
        finally:
            for chunk in chunks:
                if chunk.draft_token_ids:
                    del self.sequences[chunk.request_id].token_ids[-len(chunk.draft_token_ids) :]
        num_rows = len(inputs.sample_request_ids)
        if output is None:  # another rank samples: take its tokens
            tokens = self.tp.broadcast_tokens(None, num_rows)
            for row in self._keep(inputs.samples, tokens):
                self.sequences[inputs.sample_request_ids[row]].token_ids.append(tokens[row])
            self._trim(inputs.samples)
            return StepResult()
        tokens = output.token_ids.tolist()
        self.tp.broadcast_tokens(tokens, num_rows)
        result = self._record(inputs, tokens, output, self._keep(inputs.samples, tokens))
        self._trim(inputs.samples)
        return dataclasses.replace(result, prompt_logprobs=prompt)

    def _take_sequences(self, plan: StepPlan) -> None:
        """Drops the plan's finished sequences, then adds its new ones (the draft model's KV
        of either is forgotten: a sequence added again after a preemption has other blocks)."""
        for request_id in plan.finished_request_ids:
            self.sequences.pop(request_id, None)
        for new in plan.new_sequences:
            self.sequences[new.request_id] = RunnerSequence(
                list(new.token_ids),
                new.num_prompt_tokens,
                new.sampling,
                list(new.block_ids),
                self.adapters.slot(new.adapter),
            )
        if self.drafter is not None:
            for request_id in [
                *plan.finished_request_ids,
                *(n.request_id for n in plan.new_sequences),
            ]:
                self.drafter.forget(request_id)

    def _keep(self, samples: list[_Samples], tokens: list[int]) -> list[int]:
        """The sampled rows whose tokens the sequences keep: each sequence's first row, and with
        drafts, one more per draft accepted (`plan.accepted_length`)."""
        kept: list[int] = []
        for sample in samples:
            num_rows = len(sample.draft_token_ids) + 1
            row_tokens = tokens[sample.first_row : sample.first_row + num_rows]
            num_kept = accepted_length(sample.draft_token_ids, row_tokens) + 1
            kept += range(sample.first_row, sample.first_row + num_kept)
        return kept

    def _model_drafts(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """The chunks, those that ask for model drafts with the draft model's guesses (made on
        rank 0 and broadcast to the other ranks)."""
        asking = [chunk for chunk in chunks if chunk.num_model_drafts]
        if not asking:
            return chunks
        guessed = None
        if self.drafter is not None:
            requests = [
                DraftRequest(
                    chunk.request_id,
                    self.sequences[chunk.request_id].token_ids,
                    self.sequences[chunk.request_id].block_ids,
                    chunk.num_model_drafts,
                )
                for chunk in asking
            ]
            drafts = self.drafter.propose(requests)
            guessed = [token for chunk in asking for token in drafts[chunk.request_id]]
        tokens = iter(self.tp.broadcast_tokens(guessed, sum(c.num_model_drafts for c in asking)))
        by_request = {
            c.request_id: list(itertools.islice(tokens, c.num_model_drafts)) for c in asking
        }
        return [
            dataclasses.replace(chunk, draft_token_ids=by_request[chunk.request_id])
            if chunk.num_model_drafts
            else chunk
            for chunk in chunks
        ]

    def _trim(self, samples: list[_Samples]) -> None:
        """After speculation: hold the blocks of the computed tokens only (every known token but
        the last), as the scheduler's KV manager does; rejected drafts' slots are free again."""
        for sample in samples:
            if sample.draft_token_ids:
                seq = self.sequences[sample.request_id]
                num_blocks = -(-(len(seq.token_ids) - 1) // self.block_size)
                del seq.block_ids[num_blocks:]
                if self.drafter is not None:
                    self.drafter.verified(sample.request_id, len(seq.token_ids))

    def _prompt_logprobs(
        self, chunks: list[ScheduledChunk], hidden: torch.Tensor
    ) -> list[PromptLogprobs]:
        """For the chunks of sequences that ask (`SamplingParams.prompt_logprobs`): the logprob
        of each prompt token their rows predict (position p's logits score token p + 1), from
        the raw logits, in passes of at most PROMPT_LOGPROB_ROWS rows (a 4,096-token chunk's
        logits alone would be 0.5 GB at 32,000 tokens). Every rank computes the logits (their
        gather is collective); rank 0 returns them."""
        out: list[PromptLogprobs] = []
        row = 0
        for chunk in chunks:
            seq = self.sequences[chunk.request_id]
            start, top = chunk.num_computed_tokens, seq.sampling.prompt_logprobs
            end = min(start + chunk.num_new_tokens, seq.num_prompt_tokens - 1)
            if top is not None and end > start:
                targets = torch.tensor(seq.token_ids[start + 1 : end + 1], device=self.device)
                rows = hidden[row : row + end - start]
                logprobs: list[float] = []
                ranks: list[int] = []
                tops: list[list[TokenLogprob]] = []
                for first in range(0, len(targets), PROMPT_LOGPROB_ROWS):
                    part = slice(first, first + PROMPT_LOGPROB_ROWS)
                    logits = self.loaded.model.compute_logits(rows[part])
                    if logits is None:
                        continue  # another rank's answer
                    scores = torch.log_softmax(logits, dim=-1)
                    chosen = scores.gather(1, targets[part, None])
                    logprobs += chosen[:, 0].tolist()
                    ranks += ((scores > chosen).sum(dim=-1) + 1).tolist()
                    if top:
                        values, ids = scores.topk(top, dim=-1)
                        tops += [
                            [TokenLogprob(t, lp) for t, lp in zip(i, v, strict=True)]
                            for i, v in zip(ids.tolist(), values.tolist(), strict=True)
                        ]
                if self.tp.is_first:
                    out.append(PromptLogprobs(chunk.request_id, start + 1, logprobs, tops, ranks))
            row += chunk.num_new_tokens
        return out

    def _validate(self, plan: StepPlan) -> None:
        # (number of tokens, number of blocks) of every sequence the plan's chunks may name
        shapes = {
            request_id: (len(seq.token_ids), len(seq.block_ids))
            for request_id, seq in self.sequences.items()
            if request_id not in plan.finished_request_ids
        }
        for new in plan.new_sequences:
            if new.request_id in shapes:
                raise ValueError(f"sequence {new.request_id!r} is already running")
            if not 0 < new.num_prompt_tokens <= len(new.token_ids):
                raise ValueError(
                    f"sequence {new.request_id!r}: {new.num_prompt_tokens} prompt tokens out of"
                    f" {len(new.token_ids)} tokens"
                )
            self._check_block_ids(new.request_id, new.block_ids)
            if new.adapter is not None and new.adapter not in self.adapters.slots:
                raise ValueError(f"sequence {new.request_id!r}: unknown adapter {new.adapter!r}")
            shapes[new.request_id] = (len(new.token_ids), len(new.block_ids))
        if len({c.request_id for c in plan.chunks}) != len(plan.chunks):
            raise ValueError("a sequence is scheduled twice in one step")
        for chunk in plan.chunks:
            if chunk.request_id not in shapes:
                raise ValueError(f"chunk for unknown sequence {chunk.request_id!r}")
            self._check(chunk, *shapes[chunk.request_id])
            mask = plan.token_masks.get(chunk.request_id) if chunk.num_drafts else None
            if mask is not None and len(mask) % (chunk.num_drafts + 1):
                raise ValueError(
                    f"sequence {chunk.request_id!r}: {chunk.num_drafts} drafts need a mask for"
                    f" each of {chunk.num_drafts + 1} rows, not {len(mask)} bytes"
                )

    def _check(self, chunk: ScheduledChunk, num_tokens: int, num_blocks: int) -> None:
        end = chunk.num_computed_tokens + chunk.num_new_tokens
        num_drafts = chunk.num_drafts
        if chunk.num_model_drafts and (not self.drafts_by_model or chunk.draft_token_ids):
            raise ValueError(
                f"sequence {chunk.request_id!r}: model drafts need a draft model"
                " (--speculative-model) and no drafts of the plan's own"
            )
        if num_drafts and (
            chunk.num_computed_tokens != num_tokens - 1 or chunk.num_new_tokens != num_drafts + 1
        ):
            raise ValueError(
                f"sequence {chunk.request_id!r}: {num_drafts} drafts need a chunk of"
                f" {num_drafts + 1} tokens from its last token ({num_tokens - 1})"
            )
        num_tokens += num_drafts
        if chunk.num_new_tokens < 1 or end > num_tokens:
            raise ValueError(
                f"sequence {chunk.request_id!r}: chunk [{chunk.num_computed_tokens}, {end}) is"
                f" outside its {num_tokens} tokens"
            )
        self._check_block_ids(chunk.request_id, chunk.new_block_ids)
        num_blocks += len(chunk.new_block_ids)
        if num_blocks * self.block_size < end:
            raise ValueError(
                f"sequence {chunk.request_id!r}: {num_blocks} blocks cannot hold {end} tokens"
            )

    def _check_block_ids(self, request_id: str, block_ids: list[int]) -> None:
        """Block 0 is reserved; an id past the cache would write out of bounds."""
        if block_ids and not 0 < min(block_ids) <= max(block_ids) < self.num_blocks:
            raise ValueError(
                f"sequence {request_id!r}: block ids must be in [1, {self.num_blocks}),"
                f" got {block_ids}"
            )

    def _flatten(self, chunks: list[ScheduledChunk]) -> _StepInputs:
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[SeqSpan] = []
        sample_rows: list[int] = []
        sample_request_ids: list[str] = []
        sample_lengths: list[int] = []
        samples: list[_Samples] = []
        model = self.loaded.model
        lengths: list[int] | None = [] if model.rotary.uses_lengths else None
        for chunk in chunks:
            seq = self.sequences[chunk.request_id]
            start, end = chunk.num_computed_tokens, chunk.num_computed_tokens + chunk.num_new_tokens
            token_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            if lengths is not None:
                rope_length = functools.partial(
                    model.config.rope_length, seq.num_prompt_tokens, len(seq.token_ids)
                )
                lengths.extend(map(rope_length, range(start, end)))
            slots.extend(self._slot(seq.block_ids, pos) for pos in range(start, end))
            if chunk.draft_token_ids:
                # One decode row per position, each attending up to itself: every row's KV is
                # written before any attends, so this is the chunk's causal attention, on the
                # decode kernels (and a decode step's replay) rather than the prefill path.
                spans += [SeqSpan(1, position + 1, seq.block_ids) for position in range(start, end)]
            else:
                spans.append(SeqSpan(chunk.num_new_tokens, end, seq.block_ids))
            if end == len(seq.token_ids):
                drafts = chunk.draft_token_ids
                samples.append(_Samples(chunk.request_id, len(sample_rows), drafts))
                for back in range(len(drafts), -1, -1):  # the last token's row, then each draft's
                    sample_rows.append(len(token_ids) - 1 - back)
                    sample_request_ids.append(chunk.request_id)
                    sample_lengths.append(end - back)
        return _StepInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            lengths=None
            if lengths is None
            else torch.tensor(lengths, dtype=torch.int64, device=self.device),
            attention=AttentionStep(spans, slots, self.block_size),
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=self.device),
            sample_request_ids=sample_request_ids,
            sample_lengths=sample_lengths,
            samples=samples,
        )

    def _slot(self, block_ids: list[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def _record(
        self, inputs: _StepInputs, token_ids: list[int], output: SamplerOutput, rows: list[int]
    ) -> StepResult:
        """Appends the kept rows' tokens (`token_ids`: every row's) to their sequences; their
        `SampledToken`s, in order."""
        logprobs = output.logprobs.tolist() if output.logprobs is not None else None
        top_ids = output.top_token_ids.tolist() if output.top_token_ids is not None else None
        top_logprobs = output.top_logprobs.tolist() if output.top_logprobs is not None else None
        sampled = []
        for row in rows:
            request_id = inputs.sample_request_ids[row]
            seq = self.sequences[request_id]
            seq.token_ids.append(token_ids[row])
            logprob, top = None, []
            if seq.sampling.wants_logprobs and logprobs is not None:
                logprob = logprobs[row]
            num_top = seq.sampling.top_n_logprobs
            if num_top and top_ids is not None and top_logprobs is not None:
                pairs = zip(top_ids[row][:num_top], top_logprobs[row][:num_top], strict=True)
                top = [TokenLogprob(t, lp) for t, lp in pairs]
            sampled.append(SampledToken(request_id, token_ids[row], logprob, top))
        return StepResult(sampled)


def pick_attention(config: RunnerConfig, device: torch.device) -> tuple[AttentionBackend[Any], int]:
    """The attention backend and the KV block size it reads: the configured size when the
    backend can read it (else a ValueError stating its rule), else the backend's default."""
    name = config.attention_backend
    if not config.custom_kernels:
        if name not in ("auto", "torch"):
            raise ValueError(
                f"attention backend {name!r} is a custom kernel; custom kernels are disabled"
            )
        name = "torch"
    backend = get_backend(name, device)
    rule = block_size_rule(backend.name)
    block_size = rule.default if config.block_size is None else config.block_size
    return backend, rule.check(backend.name, block_size)


def kv_cache_dtype(
    config: RunnerConfig, model_dtype: torch.dtype, backend: AttentionBackend[Any]
) -> torch.dtype:
    """The KV cache's element type (`--kv-cache-dtype`): the model's, or FP8 (E4M3 or E5M2) where
    the attention backend stores and reads it (`AttentionBackend.fp8_kv`; else a ValueError)."""
    if config.kv_cache_dtype == "auto":
        return model_dtype
    if config.kv_cache_dtype not in FP8_KV_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype {config.kv_cache_dtype!r} is not supported (auto,"
            f" {', '.join(FP8_KV_DTYPES)})"
        )
    if not backend.fp8_kv:
        raise ValueError(
            f"--kv-cache-dtype {config.kv_cache_dtype} needs the cpu or torch attention backend,"
            f" not {backend.name!r}"
        )
    return FP8_KV_DTYPES[config.kv_cache_dtype]


FP8_KV_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def use_kv_scales(loaded: LoadedModel, kv_dtype: torch.dtype) -> tuple[KvScales, ...] | None:
    """Gives the model's layers the checkpoint's calibrated KV-cache scales where the cache is
    FP8, else unit scales; returns the scales in use (None: unit)."""
    num_layers = loaded.config.num_layers
    if loaded.kv_scales is not None and kv_dtype not in FP8_CACHE_DTYPES:
        log.info(
            "the checkpoint's FP8 KV-cache scales are not used: the KV cache is %s"
            " (--kv-cache-dtype fp8 applies them)",
            str(kv_dtype).removeprefix("torch."),
        )
    scales = loaded.kv_scales if kv_dtype in FP8_CACHE_DTYPES else None
    loaded.model.use_kv_scales(list(scales or [UNIT_SCALES] * num_layers))
    if scales is not None:
        log.info(
            "KV cache %s with the checkpoint's scales: keys %.4g-%.4g, values %.4g-%.4g",
            str(kv_dtype).removeprefix("torch."),
            min(s.k for s in scales),
            max(s.k for s in scales),
            min(s.v for s in scales),
            max(s.v for s in scales),
        )
    return scales


def kv_budget(config: RunnerConfig, device: torch.device) -> int:
    """Bytes for the KV cache: the configured budget, else 90% of the device's free memory
    (CUDA; measured per rank, so each rank sizes its own), else 1 GiB on CPU."""
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.9)
    return DEFAULT_CPU_KV_BYTES


@dataclass(frozen=True, slots=True)
class _StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    lengths: torch.Tensor | None  # [T] int64, for a length-dependent rope (`rope_length`)
    attention: AttentionStep
    sample_rows: torch.Tensor  # [N] int64: rows of the hidden states that get a next token
    sample_request_ids: list[str]  # [N] (a sequence with k drafts has k + 1 rows)
    sample_lengths: list[int]  # [N]: the sequence's tokens before the one each row samples
    samples: list[_Samples]  # the sequences that sample, in row order


@dataclass(frozen=True, slots=True)
class _Samples:
    """A sequence's sampled rows: `first_row` and one more per draft."""

    request_id: str
    first_row: int
    draft_token_ids: list[int]
