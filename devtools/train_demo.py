"""Train the demo model: a small Llama on Python's bundled documentation, on the CPU, in minutes.

`python -m tgq.devtools.train_demo [--steps N] [--out DIR]` trains a byte-level BPE tokenizer and a
`LlamaForCausalLM` on `devtools.corpus`, then writes a Hugging Face model dir (bf16 safetensors,
tokenizer with the chat template, generation config). Progress goes to stderr. Everything is
seeded, and the thread count is fixed, so a rerun on the same machine gives the same weights.
Training runs in float32: bf16 autocast was ten times slower on a CPU without AVX512-BF16.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from tgq.devtools.corpus import load_corpus
from tgq.devtools.demo import add_chat_template
from tgq.devtools.tokenizer import train_tokenizer

BOS_ID, EOS_ID = 1, 2  # devtools.tokenizer.SPECIAL_TOKENS
CLI_FIELDS = ("steps", "batch_size", "lr", "seed", "num_threads")  # TrainConfig's, as flags


@dataclass(frozen=True)
class TrainConfig:
    """The defaults train in about five minutes on two quiet AVX2 cores (about 1M tokens)."""

    steps: int = 450
    batch_size: int = 16
    context: int = 128  # tokens per training window
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.1
    vocab_size: int = 2048
    hidden_size: int = 192
    intermediate_size: int = 512
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 1024  # the service's default max_total_tokens
    val_fraction: float = 0.02
    seed: int = 0
    num_threads: int = 2


@dataclass(frozen=True)
class TrainResult:
    first_loss: float
    final_loss: float  # mean over the last tenth of the steps
    val_loss: float
    num_params: int
    seconds: float


def token_stream(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    """All documents as one id sequence, each ended by `</s>`: [num_tokens] int64."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids += [*encoding.ids, EOS_ID]
    return torch.tensor(ids, dtype=torch.long)


def llama_config(cfg: TrainConfig) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )


def random_windows(ids: torch.Tensor, cfg: TrainConfig, gen: torch.Generator) -> torch.Tensor:
    """`batch_size` windows of `context + 1` tokens at random offsets: [batch, context + 1]."""
    starts = torch.randint(0, len(ids) - cfg.context - 1, (cfg.batch_size,), generator=gen)
    return torch.stack([ids[s : s + cfg.context + 1] for s in starts.tolist()])


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def loss_on(model: LlamaForCausalLM, windows: torch.Tensor, cfg: TrainConfig) -> torch.Tensor:
    logits = model(input_ids=windows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())


def train(model: LlamaForCausalLM, ids: torch.Tensor, cfg: TrainConfig) -> list[float]:
    """AdamW on random windows of `ids`; returns each step's loss."""
    gen = torch.Generator().manual_seed(cfg.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups: list[dict[str, Any]] = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay},
    ]
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = loss_on(model, random_windows(ids, cfg, gen), cfg)
        optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        report_progress(step, losses, time.perf_counter() - start, cfg)
    return losses


def report_progress(step: int, losses: list[float], elapsed: float, cfg: TrainConfig) -> None:
    done = step + 1
    if done % 10 and done != cfg.steps:
        return
    tokens_per_s = done * cfg.batch_size * cfg.context / elapsed
    eta = elapsed / done * (cfg.steps - done)
    recent = losses[-10:]
    print(
        f"step {done}/{cfg.steps}  loss {sum(recent) / len(recent):.3f}  "
        f"{tokens_per_s:,.0f} tokens/s  eta {eta:.0f}s",
        file=sys.stderr,
        flush=True,
    )


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, ids: torch.Tensor, cfg: TrainConfig) -> float:
    """Mean loss over consecutive non-overlapping windows of held-out `ids`."""
    model.eval()
    num_windows = (len(ids) - 1) // cfg.context
    starts = range(0, num_windows * cfg.context, cfg.context)
    windows = torch.stack([ids[s : s + cfg.context + 1] for s in starts])
    losses = [loss_on(model, chunk, cfg).item() for chunk in torch.split(windows, cfg.batch_size)]
    return sum(losses) / len(losses)


def save(model: LlamaForCausalLM, out: Path) -> None:
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID).save_pretrained(out)
    add_chat_template(out)


def build(out: Path, cfg: TrainConfig = TrainConfig()) -> TrainResult:
    """Train the tokenizer and the model on the corpus and write both to `out`."""
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.num_threads)
    start = time.perf_counter()
    texts = load_corpus()
    train_tokenizer(out, cfg.vocab_size, texts)
    ids = token_stream(Tokenizer.from_file(str(out / "tokenizer.json")), texts)
    num_val = int(len(ids) * cfg.val_fraction)
    train_ids, val_ids = ids[:-num_val], ids[-num_val:]
    model = LlamaForCausalLM(llama_config(cfg))
    num_params = sum(p.numel() for p in model.parameters())
    print(
        f"corpus: {len(texts)} documents, {len(ids):,} tokens; model: {num_params:,} parameters",
        file=sys.stderr,
    )
    losses = train(model, train_ids, cfg)
    val_loss = evaluate(model, val_ids, cfg)
    save(model, out)
    tail = losses[-max(len(losses) // 10, 1) :]
    seconds = time.perf_counter() - start
    result = TrainResult(losses[0], sum(tail) / len(tail), val_loss, num_params, seconds)
    print(f"done: {result}", file=sys.stderr)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(".cache/demo/trained"))
    defaults = TrainConfig()
    for field in CLI_FIELDS:
        default = getattr(defaults, field)
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(default), default=default)
    args = parser.parse_args()
    overrides = {field: getattr(args, field) for field in CLI_FIELDS}
    build(args.out, dataclasses.replace(defaults, **overrides))
    print(args.out)


if __name__ == "__main__":
    main()
