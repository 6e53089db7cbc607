"""What `--quantize int8` and `--quantize fp8` cost in quality, against the same model
unquantized, on real text (the bundled corpus of Python's documentation):

- mean KL divergence KL(bf16 || quantized) of the next-token distributions, and how often their
  argmax agrees, over `--positions` positions of corpus text (teacher forcing: transformers on
  the bf16 weights, and on the quantized ones dequantized, q * scale, which tgq's quantized
  layers compute exactly; tests/gpu_worker/test_quantize.py checks that equality);
- free-running greedy agreement through tgq itself: 64 corpus prompts x 128 new tokens, bf16
  against `--quantize`: the share of tokens before the first divergence.

Two models: the trained demo model (`devtools.demo`, built on first use: ~5 minutes) and the
medium random-weight model with a trained tokenizer. Prints one table; writes JSON to
bench/results/.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from bench.harness import chat_llama, write_results
from tgq.batcher.offline import OfflineEngine
from tgq.devtools.corpus import load_corpus
from tgq.devtools.demo import demo_model
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


METHODS = ("int8", "fp8")


def teacher_forced(model_dir: Path, method: str, positions: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    def load() -> Any:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    bf16 = load().to(torch.bfloat16).eval()
    quantized = dequantize_in_place(
        load(), lambda w: quantize_rows(w, method), torch.bfloat16
    ).eval()
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


def free_running(model_dir: Path) -> dict[str, float]:
    """Each method's greedy agreement with bf16 (`greedy_agreement_<method>`)."""
    ids = corpus_ids(model_dir, PROMPTS * PROMPT_LEN * 4)
    prompts = [ids[i * PROMPT_LEN * 4 :][:PROMPT_LEN] for i in range(PROMPTS)]
    outputs = {}
    for quantize in (None, *METHODS):
        config = RunnerConfig(str(model_dir), num_blocks=1200, quantize=quantize)
        engine = OfflineEngine(ModelRunner(config))
        outputs[quantize] = engine.generate(prompts, max_new_tokens=NUM_NEW)
    agreement = {}
    for method in METHODS:
        same = 0
        for ours, theirs in zip(outputs[method], outputs[None], strict=True):
            for a, b in zip(ours.token_ids, theirs.token_ids, strict=True):
                if a != b:
                    break
                same += 1
        agreement[method] = same / (PROMPTS * NUM_NEW)
    return agreement


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache", type=Path, default=Path(".cache/bench"))
    parser.add_argument("--positions", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = {"demo (trained)": demo_model(), "medium (random)": chat_llama(args.cache, "medium")}
    results: dict[str, dict[str, float]] = {}
    for name, path in models.items():
        greedy = free_running(path)
        for method in METHODS:
            forced = teacher_forced(path, method, args.positions)
            results[f"{name} {method}"] = {**forced, "greedy_agreement": greedy[method]}
    write_results("quant-quality", args, results, None)
    print(f"{'model':<23}{'mean KL':>10}{'top-1 agree':>13}{'greedy agree':>14}{'positions':>11}")
    for name, r in results.items():
        print(
            f"{name:<23}{r['mean_kl']:>10.5f}{r['top1_agreement']:>13.4f}"
            f"{r['greedy_agreement']:>14.4f}{int(r['positions']):>11}"
        )


if __name__ == "__main__":
    main()
