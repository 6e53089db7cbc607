"""What `--quantize int8` and `--quantize fp8`, compressed-tensors FP8-dynamic, INT8 W8A8 and
W4A16 (int4 in groups of 128) checkpoints written by the library, and GPTQ and AWQ int4
checkpoints (groups of 128, rounded to nearest: `devtools.grouped_checkpoint`) cost in quality
against the same model unquantized, on real text (the bundled corpus of Python's documentation):

- mean KL divergence KL(bf16 || quantized) of the next-token distributions, and how often their
  argmax agrees, over `--positions` positions of corpus text (teacher forcing: transformers on
  the bf16 weights, and on the quantized ones dequantized, q * scale, which tgq's quantized
  layers compute exactly, or running the compressed checkpoint through the library's forward, or
  on the GPTQ/AWQ weights dequantized to bf16;
  tests/gpu_worker/test_quantize.py and test_compressed.py check those equalities);
- free-running greedy agreement through tgq itself: 64 corpus prompts x 128 new tokens, bf16
  against `--quantize`: the share of tokens before the first divergence.

Three models: the trained demo model (`devtools.demo`, built on first use: ~5 minutes), and the
medium Llama and a Qwen3-shaped one of the same size (q/k norms), random weights with a trained
tokenizer. Prints one table; writes JSON to
bench/results/.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from bench.harness import chat_llama, write_results
from tgq.batcher.offline import OfflineEngine
from tgq.devtools.compressed_checkpoint import write_compressed
from tgq.devtools.corpus import load_corpus
from tgq.devtools.demo import demo_model
from tgq.devtools.grouped_checkpoint import dequantized_dir, write_grouped
from tgq.devtools.quantized_reference import dequantize_in_place
from tgq.gpu_worker.layers.linear import quantize_rows
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig

WINDOW = 256  # tokens per teacher-forced window
PROMPTS, PROMPT_LEN, NUM_NEW = 64, 32, 128


def corpus_ids(model_dir: Path, count: int) -> list[int]:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids: list[int] = []
    for text in load_corpus():
        ids += tokenizer.encode(text).ids
        if len(ids) >= count:
            break
    return ids[:count]


METHODS = ("int8", "fp8")  # `--quantize`
SCHEMES = ("FP8_DYNAMIC", "W8A8", "W4A16")  # compressed-tensors checkpoints the library writes
GROUPED = ("gptq", "awq")  # 4-bit checkpoints devtools.grouped_checkpoint writes (groups of 128)
GROUP_SIZE = 128


@dataclass(frozen=True)
class Variant:
    model_dir: Path  # what tgq loads
    quantize: str | None  # `--quantize`
    reference: Callable[[], Any]  # transformers' model of the same weights, bf16


def variants(model_dir: Path, cache: Path, wanted: set[str]) -> dict[str, Variant]:
    """The quantized variants of `model_dir` labelled in `wanted` (all where empty), their
    checkpoints written on first use; the library's W4A16 only where every linear's inputs
    are whole groups of 128 (it has no partial groups)."""
    from transformers import AutoModelForCausalLM

    def keep(label: str) -> bool:
        return not wanted or label in wanted

    def dequantized(method: str) -> Callable[[], Any]:
        rows = functools.partial(quantize_rows, method=method)
        model = functools.partial(AutoModelForCausalLM.from_pretrained, model_dir)
        return lambda: dequantize_in_place(model(dtype=torch.bfloat16), rows, torch.bfloat16).eval()

    def library(path: Path) -> Callable[[], Any]:
        return lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()

    config = json.loads((model_dir / "config.json").read_text())
    whole_groups = all(config[k] % GROUP_SIZE == 0 for k in ("hidden_size", "intermediate_size"))
    found = {m: Variant(model_dir, m, dequantized(m)) for m in METHODS if keep(m)}
    for scheme in SCHEMES:
        if not keep(f"ct {scheme}") or (scheme == "W4A16" and not whole_groups):
            continue
        path = write_compressed(model_dir, cache / f"{model_dir.name}-{scheme}", scheme)
        found[f"ct {scheme}"] = Variant(path, None, library(path))
    for fmt in GROUPED:
        if not keep(f"{fmt} int4"):
            continue
        path = write_grouped(model_dir, cache / f"{model_dir.name}-{fmt}", fmt, GROUP_SIZE)
        found[f"{fmt} int4"] = Variant(path, None, library(dequantized_dir(path)))
    return found


def teacher_forced(model_dir: Path, quantized: Any, positions: int) -> dict[str, float]:
    """KL(bf16 || quantized) and argmax agreement over corpus windows, transformers both."""
    from transformers import AutoModelForCausalLM

    bf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    ids = torch.tensor(corpus_ids(model_dir, positions + positions // WINDOW + 1))
    kl_sum, agree, count = 0.0, 0, 0
    with torch.no_grad():
        for start in range(0, positions, WINDOW):
            window = ids[start : start + WINDOW + 1][None, :-1]
            ref = torch.log_softmax(bf16(window).logits[0].float(), -1)
            ours = torch.log_softmax(quantized(window).logits[0].float(), -1)
            kl_sum += (ref.exp() * (ref - ours)).sum(-1).sum().item()
            agree += int((ref.argmax(-1) == ours.argmax(-1)).sum())
            count += window.shape[1]
    return {"mean_kl": kl_sum / count, "top1_agreement": agree / count, "positions": count}


def generate(model_dir: Path, quantize: str | None, prompts: list[list[int]]) -> list[Any]:
    config = RunnerConfig(str(model_dir), num_blocks=1200, quantize=quantize)
    return OfflineEngine(ModelRunner(config)).generate(prompts, max_new_tokens=NUM_NEW)


def greedy_agreement(outputs: list[Any], baseline: list[Any]) -> float:
    """The share of generated tokens before each output's first divergence from bf16's."""
    same = 0
    for ours, theirs in zip(outputs, baseline, strict=True):
        for a, b in zip(ours.token_ids, theirs.token_ids, strict=True):
            if a != b:
                break
            same += 1
    return same / (PROMPTS * NUM_NEW)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache", type=Path, default=Path(".cache/bench"))
    parser.add_argument("--positions", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--models", default="demo,medium,qwen3", help="comma-separated: demo, medium, qwen3"
    )
    parser.add_argument(
        "--variants", default="", help="comma-separated labels (e.g. 'int8,gptq int4'); all"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    makers: dict[str, tuple[str, Callable[[], Path]]] = {
        "demo": ("demo (trained)", demo_model),
        "medium": ("medium (random)", lambda: chat_llama(args.cache, "medium")),
        "qwen3": (
            "medium qwen3 (random)",
            lambda: chat_llama(args.cache, "medium", "Qwen3ForCausalLM"),
        ),
    }
    models = {makers[m][0]: makers[m][1]() for m in args.models.split(",") if m}
    wanted = {v.strip() for v in args.variants.split(",") if v.strip()}
    results: dict[str, dict[str, float]] = {}
    for name, path in models.items():
        ids = corpus_ids(path, PROMPTS * PROMPT_LEN * 4)
        prompts = [ids[i * PROMPT_LEN * 4 :][:PROMPT_LEN] for i in range(PROMPTS)]
        baseline = generate(path, None, prompts)
        for label, variant in variants(path, args.cache, wanted).items():
            forced = teacher_forced(path, variant.reference(), args.positions)
            outputs = generate(variant.model_dir, variant.quantize, prompts)
            results[f"{name} {label}"] = {
                **forced,
                "greedy_agreement": greedy_agreement(outputs, baseline),
            }
    write_results("quant-quality", args, results, None)
    print(f"{'model':<36}{'mean KL':>10}{'top-1 agree':>13}{'greedy agree':>14}{'positions':>11}")
    for name, r in results.items():
        print(
            f"{name:<36}{r['mean_kl']:>10.5f}{r['top1_agreement']:>13.4f}"
            f"{r['greedy_agreement']:>14.4f}{int(r['positions']):>11}"
        )


if __name__ == "__main__":
    main()
