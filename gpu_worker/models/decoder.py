"""The Llama-family decoder that Llama, Mistral, Qwen2 and Qwen3 share.

Each architecture file subclasses `DecoderForCausalLM` and states its differences as class
attributes (qkv bias, q/k norm, sliding window). Module names follow the Hugging Face checkpoints,
except that q/k/v and gate/up are fused into one matmul each (`qkv_proj`, `gate_up_proj`);
`checkpoint_sources` (models/sources.py) maps every parameter back to the checkpoint tensors
that fill it.

All activations are flat: `[num_tokens, ...]` for every token of every sequence in the step.

With tensor parallelism (`gpu_worker.parallel`) every module is built with the rank's local
shapes (its heads, intermediate size and vocabulary range); o_proj and down_proj all-reduce
their partial sums, the embedding sums the rows of the ranks that own each token, and
`checkpoint_sources` names the slice of each checkpoint tensor this rank reads.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tgq.gpu_worker.config import ModelConfig
from tgq.gpu_worker.layers.activation import ACTIVATIONS, FUSED_ON_CPU
from tgq.gpu_worker.layers.linear import Linear, measure_linears
from tgq.gpu_worker.layers.moe import SparseMoE
from tgq.gpu_worker.layers.norm import OffsetRMSNorm, RMSNorm
from tgq.gpu_worker.layers.rotary import RotaryEmbedding, apply_rotary
from tgq.gpu_worker.models.sources import Source, decoder_sources
from tgq.gpu_worker.parallel import SINGLE, TensorParallel
from tgq.kernels import AttentionBackend, AttentionMetadata, cpu_ops
from tgq.kernels.choice import ROW_BUCKETS, Choices, choose
from tgq.kernels.greedy_head import GreedyHead
from tgq.kernels.interface import UNIT_SCALES, KvScales
from tgq.kernels.replay import OpReplay, tensors_of

# K and V of one layer, each [num_blocks, block_size, num_kv_heads, head_dim]
KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, slots=True)
class ForwardContext:
    backend: AttentionBackend[Any]
    meta: AttentionMetadata
    cos: torch.Tensor  # [num_tokens, rotary_dim]
    sin: torch.Tensor
    # The sliding-window layers' own rotation (Gemma 3's local rope base); None: `cos`, `sin`.
    local_cos: torch.Tensor | None = None
    local_sin: torch.Tensor | None = None

    def rope(self, local: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for a layer: the local ones where it takes them and they exist."""
        if local and self.local_cos is not None and self.local_sin is not None:
            return self.local_cos, self.local_sin
        return self.cos, self.sin


@dataclass(frozen=True, slots=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        sliding_window: int | None,
        tp: TensorParallel = SINGLE,
        norm: type[nn.Module] = RMSNorm,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.shape = AttentionShape(config.num_heads, config.num_kv_heads, config.head_dim)
        qkv_size = self.shape.q_size + 2 * self.shape.kv_size
        self.qkv_proj = Linear(config.hidden_size, qkv_size, bias=qkv_bias)
        self.o_proj = Linear(self.shape.q_size, config.hidden_size, bias=o_bias)
        self.q_norm = norm(config.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = norm(config.head_dim, config.rms_norm_eps) if qk_norm else None
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.softcap = config.attn_logit_softcapping
        self.sliding_window = sliding_window
        # Gemma 3: sliding layers rotate with their own base (`ForwardContext.rope`)
        self.local_rope = sliding_window is not None and config.local_rope_theta is not None
        self.rotary_dim = config.rotary_dim
        # Rotary in place on the fused qkv: not with q/k norm or partial rotary (see
        # `has_cpu_kernel`).
        self.use_cpu_kernel = False
        # An FP8 cache's scales for this layer (`DecoderForCausalLM.use_kv_scales`)
        self.kv_scales: KvScales = UNIT_SCALES

    @property
    def has_cpu_kernel(self) -> bool:
        """Whether the CPU kernel `rotary_qk_` can rotate q and k in place on the fused qkv: it
        rotates whole heads, before any norm."""
        return self.q_norm is None and self.rotary_dim == self.shape.head_dim

    def forward(self, x: torch.Tensor, kv_cache: KVCache, ctx: ForwardContext) -> torch.Tensor:
        num_tokens, shape = x.shape[0], self.shape
        qkv = self.qkv_proj(x)
        cos, sin = ctx.rope(self.local_rope)
        if self.use_cpu_kernel:  # one fused op rotates q and k in place, before the split
            heads = shape.num_heads + shape.num_kv_heads
            cpu_ops.rotary_qk_(qkv, cos, sin, heads, shape.head_dim)
        q, k, v = qkv.split([shape.q_size, shape.kv_size, shape.kv_size], dim=-1)
        q = q.reshape(num_tokens, shape.num_heads, shape.head_dim)
        k = k.reshape(num_tokens, shape.num_kv_heads, shape.head_dim)
        v = v.reshape(num_tokens, shape.num_kv_heads, shape.head_dim)
        if not self.use_cpu_kernel:
            q, k = self._norm_and_rotate(q, k, cos, sin)
        k_cache, v_cache = kv_cache
        ctx.backend.write_kv(k_cache, v_cache, k, v, ctx.meta, self.kv_scales)
        out = ctx.backend.attend(
            q,
            k_cache,
            v_cache,
            ctx.meta,
            scale=self.scale,
            sliding_window=self.sliding_window,
            softcap=self.softcap,
            kv_scales=self.kv_scales,
        )
        return self.tp.all_reduce_(self.o_proj(out.reshape(num_tokens, shape.q_size)))

    def _norm_and_rotate(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


# On CPU the MLP runs over at most this many bytes of [rows, 2 * intermediate] activation at a
# time, so a long prefill's largest buffers stay below glibc's 32 MiB ceiling for heap blocks
# (gpu_worker.host_memory); the medium model's gate_up activation for 16 x 512 tokens is 128 MiB
# per layer. Larger ones are mapped afresh and page-faulted in: measured in fresh processes, the
# first 8 x 512-token prefill took 236K minor faults and ran at 1,884 tok/s in one pass against
# 30K and 2,629 in passes (the next prefill, and the steady state in turns, alike within noise).
# Rows are independent, so the passes give the same result.
CPU_MLP_PASS_BYTES = 16 << 20


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate_size = config.intermediate_size
        bias = config.mlp_bias
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.activation = config.hidden_act
        self.act = ACTIVATIONS[config.hidden_act]
        self.use_cpu_kernel = False  # one fused pass for act(gate) * up (`has_cpu_kernel`)

    @property
    def has_cpu_kernel(self) -> bool:
        """Whether a fused CPU kernel computes this MLP's activation (`FUSED_ON_CPU`)."""
        return self.activation in FUSED_ON_CPU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.rows_per_pass(x)
        if x.shape[0] <= rows:
            return self.tp.all_reduce_(self._rows(x))
        out = x.new_empty(x.shape)
        for start in range(0, x.shape[0], rows):
            out[start : start + rows] = self._rows(x[start : start + rows])
        return self.tp.all_reduce_(out)

    def rows_per_pass(self, x: torch.Tensor) -> int:
        """Rows of x per pass of the MLP (CPU_MLP_PASS_BYTES on CPU; all of them elsewhere, and
        with LoRA adapters, whose rows are numbered over the whole step)."""
        if x.device.type != "cpu" or self.gate_up_proj.lora or self.down_proj.lora:
            return x.shape[0]
        row_bytes = 2 * self.intermediate_size * x.element_size()
        return max(1, CPU_MLP_PASS_BYTES // row_bytes)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.use_cpu_kernel:
            return self.down_proj(FUSED_ON_CPU[self.activation](gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attention: Attention, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, delta: torch.Tensor | None, kv_cache: KVCache, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream, updated in place; delta: the previous layer's MLP output, not
        yet added to x (None in the first layer). Returns x and this layer's MLP output, which
        the next layer adds in its input norm (one fused op, as after attention)."""
        norm = self.input_layernorm
        hidden = norm(x) if delta is None else norm.add_and_norm(x, delta)
        attn = self.self_attn(hidden, kv_cache, ctx)
        hidden = self.post_attention_layernorm.add_and_norm(x, attn)
        return x, self.mlp(hidden)


class SandwichDecoderLayer(nn.Module):
    """A decoder layer with a norm before and after each sublayer (Gemma 2 / 3): the sublayer's
    output is normed before it joins the residual stream. Same contract as `DecoderLayer`."""

    def __init__(
        self, config: ModelConfig, attention: Attention, mlp: nn.Module, norm: type[nn.Module]
    ) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = norm(size, eps)
        self.self_attn = attention
        self.post_attention_layernorm = norm(size, eps)
        self.pre_feedforward_layernorm = norm(size, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = norm(size, eps)

    def forward(
        self, x: torch.Tensor, delta: torch.Tensor | None, kv_cache: KVCache, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if delta is not None:
            x.add_(delta)
        x.add_(
            self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), kv_cache, ctx))
        )
        return x, self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class VocabParallelEmbedding(nn.Module):
    """The rows of this rank's vocabulary range; a token another rank owns contributes zeros
    here, and the all-reduce sums each token's one real row."""

    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.start, self.stop = tp.vocab_range(config.vocab_size)
        self.weight = nn.Parameter(
            torch.empty(tp.vocab_shard_size(config.vocab_size), config.hidden_size)
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        owned = (input_ids >= self.start) & (input_ids < self.stop)
        rows = F.embedding(torch.where(owned, input_ids - self.start, 0), self.weight)
        return self.tp.all_reduce_(rows.mul_(owned.unsqueeze(-1).to(rows.dtype)))


class DecoderModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layers: list[nn.Module],
        tp: TensorParallel = SINGLE,
        norm: type[nn.Module] = RMSNorm,
    ) -> None:
        super().__init__()
        self.embed_tokens: nn.Module = (
            nn.Embedding(config.vocab_size, config.hidden_size)
            if tp.world_size == 1
            else VocabParallelEmbedding(config, tp)
        )
        self.layers = nn.ModuleList(layers)
        self.norm = norm(config.hidden_size, config.rms_norm_eps)


class DecoderForCausalLM(nn.Module):
    """Base of the Llama-family architectures; subclasses set the class attributes."""

    qk_norm: ClassVar[bool] = False
    uses_sliding_window: ClassVar[bool] = False
    fused_checkpoint: ClassVar[bool] = False  # q/k/v and gate/up stored fused (Phi-3)
    norm: ClassVar[type[nn.Module]] = RMSNorm  # every norm's class
    scales_embeddings: ClassVar[bool] = False  # embeddings times sqrt(hidden_size) (Gemma)
    # MoE: the router's top-k weights cast to the model's dtype (Qwen) or kept fp32 (Mixtral)
    router_weights_in_model_dtype: ClassVar[bool] = True

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = config  # the whole model's
        self.tp = tp
        local = tp.local_config(config)
        self.model = DecoderModel(
            config, [self._layer(local, i) for i in range(config.num_layers)], tp, self.norm
        )
        self.lm_head = Linear(config.hidden_size, local.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.rope_theta,
            config.rope_scaling,
            config.max_position_embeddings,
            config.rotary_dim,
        )
        self.local_rotary = (
            None
            if config.local_rope_theta is None
            else RotaryEmbedding(
                config.head_dim,
                config.local_rope_theta,
                None,
                config.max_position_embeddings,
                config.rotary_dim,
            )
        )
        self.greedy_head: GreedyHead | None = None  # set by use_cpu_kernels where it can run
        self.experts_choices: Choices | None = None  # set by use_cpu_kernels for fused experts
        self.replay: OpReplay | None = None  # likewise
        # Tensors this step's layers read besides their inputs and parameters (the LoRA rows'
        # adapter slots, `gpu_worker.lora`): inputs of the recorded ops, their count in the key.
        self.replay_inputs: list[torch.Tensor] = []
        self.kernel_choices: Choices | None = None  # set by linear_kernels

    @classmethod
    def attention_biases(cls, config: ModelConfig) -> tuple[bool, bool]:
        """(q/k/v bias, o_proj bias); by default both follow `attention_bias`."""
        return config.attention_bias, config.attention_bias

    def _layer(self, config: ModelConfig, index: int) -> nn.Module:
        return DecoderLayer(config, self._attention(config, index), self._mlp(config, index))

    def _mlp(self, config: ModelConfig, index: int) -> nn.Module:
        """The layer's MLP: the sparse mixture of experts where the config makes it one."""
        if not config.moe_layers[index]:
            return MLP(config, self.tp)
        return SparseMoE(
            config,
            MLP,  # rank-free (no all-reduce per expert): the block sums once
            self.tp,
            weights_in_model_dtype=self.router_weights_in_model_dtype,
        )

    @classmethod
    def checkpoint_name(cls, name: str) -> str:
        """Our checkpoint-side tensor name -> this family's (Mixtral renames its experts')."""
        return name

    @classmethod
    def stored_name(cls, stored: str) -> str | None:
        """A tensor name as the checkpoint stores it -> ours (the names `checkpoint_name`
        gives), or None for a tensor this model does not load (`weights.Checkpoint.open`)."""
        return stored

    def _attention(self, config: ModelConfig, index: int) -> Attention:
        qkv_bias, o_bias = self.attention_biases(config)
        is_sliding = self.uses_sliding_window and config.layer_types[index] == "sliding_attention"
        return Attention(
            config,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=self.qk_norm,
            sliding_window=config.sliding_window if is_sliding else None,
            tp=self.tp,
            norm=self.norm,
        )

    def use_cpu_kernels(self, *, greedy_head: bool = True) -> int:
        """bf16 on a CPU with the kernels: run matmuls, norms, rotary embeddings and the MLP's
        activation there. With AVX512_BF16 the decoder layers' linears run, per call size, on
        the kernel measured fastest on this CPU (`linear_kernels`: the AVX-512 or AMX kernel
        over weights packed once, or torch's oneDNN), and the lm_head on the AVX-512 kernel (a
        tied lm_head gets its own packed copy; the embedding keeps its rows; the greedy head's
        exact logits are those of that kernel); otherwise kernels/cpu_ops.py picks per call.
        Quantized linears (`loader.quantize_linears`, `gpu_worker.compressed`,
        `gpu_worker.grouped`) run on their kernel where the CPU has it (`Linear.
        use_quantized_kernel`), else stay on torch. On one rank with `greedy_head`,
        argmax-only rows get their tokens from `self.greedy_head` (kernels.greedy_head), which
        keeps the head's [N, K] rows and an int8 copy, screened on the kernel measured fastest
        per row count (VNNI or AMX-INT8 beside a packed head; AVX2 without AVX512_BF16, each
        row's tokens those of its logits computed alone). On one
        rank, the layers of a step the attention backend can key (`replay_key`:
        decode-only steps on the CPU kernels) run as the ops recorded from their first such
        step (`self.replay`, kernels.replay): bit-identical, without the Python between the ops.
        Returns the modules switched."""
        weight = self.lm_head.weight
        if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
            return 0
        if not cpu_ops.is_available():
            return 0
        pack = cpu_ops.has_avx512_bf16()
        # The [N, K] head, which packing releases: the greedy head's screen is built from it.
        head = weight.detach()
        quantized = any(m.is_quantized for m in self.modules() if isinstance(m, Linear))
        # Beside 8-bit layers: routers, or what a checkpoint left float; AVX-512, unmeasured.
        layer_kernels = [(1, "avx512")] if quantized else []
        if pack and not quantized:
            layer_kernels = self.linear_kernels().thresholds("linear")
        switched = 0
        for module in self.modules():
            if isinstance(module, Linear):
                switched += self._switch_linear(module, layer_kernels if pack else None)
            elif isinstance(module, RMSNorm | OffsetRMSNorm | MLP | Attention):
                module.use_cpu_kernel = module.has_cpu_kernel
                switched += 1
        fused = self._fuse_experts() if pack else not self.config.num_experts
        single = self.tp.world_size == 1
        # Steps the backend can key (decode-only ones on the CPU kernels, soft-capped or not)
        # run as recorded ops; not with experts one by one (which run depends on the tokens;
        # the one-call kernel's ops do not).
        if single and fused:
            self.replay = OpReplay(self)
        # Greedy rows' tokens from an int8 screen of the head (one rank holds the whole head),
        # against the packed head or, without AVX512_BF16, the AVX2 kernel's.
        if greedy_head and single:
            packed = self.lm_head.weight.detach() if pack else None
            self.greedy_head = GreedyHead.build(packed, head, pick_kernels=True)
        return switched

    def _switch_linear(self, module: Linear, layer_kernels: list[tuple[int, str]] | None) -> bool:
        """One linear onto the CPU kernels (`layer_kernels`: the packed kernels' thresholds, None
        without AVX512_BF16); whether it switched."""
        if module.is_quantized:  # its one kernel, or torch where the CPU or the layout lacks it
            return module.use_quantized_kernel()
        if layer_kernels is None:
            out_fp32 = module is self.lm_head
            module.matmul = functools.partial(cpu_ops.linear_bf16, out_fp32=out_fp32)
        elif module is self.lm_head:
            # Logits straight to fp32 (the values of .float() of the bf16 result, a pass less).
            module.use_kernels([(1, "avx512")], out_fp32=True)
        else:
            module.use_kernels(layer_kernels, out_fp32=False)
        return True

    def _fuse_experts(self) -> bool:
        """Experts in one kernel call at the step sizes where that measured faster
        (`SparseMoE.stack_experts`); whether every block can (True without experts)."""
        blocks = [m for m in self.modules() if isinstance(m, SparseMoE)]
        if not blocks:
            return True
        if not all([block.stack_experts() for block in blocks]):
            return False
        self.experts_choices = blocks[0].measure_experts()
        for block in blocks:
            block.use_thresholds(self.experts_choices.thresholds("moe_experts"))
        return True

    def linear_kernels(self) -> Choices:
        """Which kernel runs the decoder layers' linears at each call size, measured on this CPU
        with the first layer's four linears (kernels.choice; cached per CPU and shapes). Call
        before the linears switch (`use_cpu_kernels`): it times their [N, K] weights."""
        layer = self.model.layers[0]
        assert isinstance(layer, DecoderLayer | SandwichDecoderLayer)
        mlp = layer.mlp.experts[0] if isinstance(layer.mlp, SparseMoE) else layer.mlp
        assert isinstance(mlp, MLP)
        linears = [
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            mlp.gate_up_proj,
            mlp.down_proj,
        ]
        shapes = {"linear": [[m.out_features, m.in_features] for m in linears]}
        choices = choose(shapes, lambda: measure_linears("linear", linears, ROW_BUCKETS))
        self.kernel_choices = choices
        return choices

    def use_kv_scales(self, scales: list[KvScales]) -> None:
        """Each layer's FP8 cache scales, one per layer in order: a checkpoint's calibrated ones
        (`loader.read_kv_scales`) beside an FP8 cache, else 1 (`runner.ModelRunner`)."""
        attentions = [m for m in self.modules() if isinstance(m, Attention)]  # layer order
        if len(scales) != len(attentions):
            raise ValueError(f"{len(scales)} KV scales for {len(attentions)} layers")
        if [attention.kv_scales for attention in attentions] == scales:
            return
        for attention, layer_scales in zip(attentions, scales, strict=True):
            attention.kv_scales = layer_scales
        if self.replay is not None:  # its recordings hold the scales they were made with
            self.replay = OpReplay(self)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # type: ignore[assignment]

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[KVCache],
        backend: AttentionBackend[Any],
        meta: AttentionMetadata,
        lengths: torch.Tensor | None = None,  # [T] int64: `ModelConfig.rope_length` per token
    ) -> torch.Tensor:  # [T, hidden] (before the final norm)
        x = self.model.embed_tokens(input_ids)
        if self.scales_embeddings:  # the scale rounded to the weights' dtype, as the reference
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        cos, sin = self.rotary.cos_sin(positions, x.dtype, lengths)
        local = None if self.local_rotary is None else self.local_rotary.cos_sin(positions, x.dtype)
        ctx = ForwardContext(backend, meta, cos, sin, *(local or (None, None)))
        if self.replay is not None and (key := backend.replay_key(meta)) is not None:
            # Everything `_layers` reads that is not a parameter of this model is an input.
            ropes = [cos, sin, *(local or ())]
            inputs = [x, *ropes, *tensors_of(meta), *(t for kv in kv_caches for t in kv)]
            inputs += self.replay_inputs
            return self.replay(
                (x.shape[0], key, len(self.replay_inputs)),
                inputs,
                lambda: self._layers(x, kv_caches, ctx),
            )
        return self._layers(x, kv_caches, ctx)

    def _layers(
        self, x: torch.Tensor, kv_caches: list[KVCache], ctx: ForwardContext
    ) -> torch.Tensor:
        delta = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, delta = layer(x, delta, kv_cache, ctx)
        return x if delta is None else x.add_(delta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] rows that need a next token -> [N, vocab] fp32 logits, on rank 0 (None
        on the other ranks, which only send their vocabulary range)."""
        logits: torch.Tensor = self.lm_head(self.model.norm(hidden)).float()
        if (cap := self.config.final_logit_softcapping) is not None:
            logits = torch.tanh(logits / cap) * cap
        return self.tp.gather_logits(logits, self.config.vocab_size)

    def greedy_tokens(
        self, hidden: torch.Tensor, masks: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """[N, hidden] rows -> [N] the argmax of their logits, the tokens greedy decoding picks
        from `compute_logits`, without computing all the logits (kernels.greedy_head); with
        `masks` ([N, W] int32 bitmasks, a grammar's), the argmax over the allowed tokens. None
        where that is not available (then use compute_logits). A final soft cap (Gemma 2) is
        monotonic, so the argmax is the capped logits' too (ties that only the cap's rounding
        makes aside)."""
        if self.greedy_head is None:
            return None
        return self.greedy_head.argmax(self.model.norm(hidden), masks)

    def checkpoint_sources(self) -> dict[str, list[Source]]:
        """Our parameter name -> the checkpoint tensors (this rank's slices) that fill it."""
        return decoder_sources(
            self, self.config, self.tp, fused=self.fused_checkpoint, rename=self.checkpoint_name
        )
