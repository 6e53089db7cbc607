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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.harness import chat_llama, write_results
from tgq.batcher.offline import OfflineEngine
from tgq.devtools.demo import demo_model
from tgq.devtools.quant_quality import corpus_ids, teacher_forced, variants
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig

PROMPTS, PROMPT_LEN, NUM_NEW = 64, 32, 128


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
