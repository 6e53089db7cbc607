"""Engine benchmark: tgq's paged runner against transformers `generate` on the same weights.

Medium Llama shape (hidden 768, 12 layers, 12 heads, intermediate 2048, vocab 32000; ~134M
parameters), random bf16 weights, CPU, 2 threads. Measured in one run, baseline first:

- decode step time at batch 1: (time of N2 new tokens - time of N1 new tokens) / (N2 - N1), so
  prompt processing cancels out; best of a few repetitions (so are the batched decodes);
- decode tokens/s at batch 16 and 64 (transformers: static batching of equal-length prompts);
- prefill tokens/s for 16 x 512-token prompts (transformers: one forward over the padded-free
  batch, optionally fewer prompts since it is slow here; a rate is per token either way).

Prints one summary table and writes JSON and a PNG bar chart to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from devtools.random_model import make_config, write_model
from gpu_worker.offline import OfflineEngine
from gpu_worker.runner import ModelRunner, RunnerConfig

RESULTS = Path(__file__).parent / "results"
PROMPT_LEN = 16


def medium_model(cache: Path) -> Path:
    path = cache / "medium-llama-bf16"
    if not (path / "model.safetensors").is_file():
        write_model(
            path, make_config("LlamaForCausalLM", "medium", dtype="bfloat16"), dtype=torch.bfloat16
        )
    return path


def prompts(batch: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(batch * 1000 + length)
    return torch.randint(3, 32000, (batch, length), generator=gen).tolist()


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def decode_step_seconds(run: Callable[[int], Any], n1: int, n2: int, repeats: int) -> float:
    """Best of `repeats` per-token time differences: on this noisy machine, interference only
    ever adds time, so the minimum is the most repeatable estimate (for both engines alike)."""
    run(n1)  # warm-up
    steps = [(timed(lambda: run(n2)) - timed(lambda: run(n1))) / (n2 - n1) for _ in range(repeats)]
    return min(steps)


class HFEngine:
    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
        self.model.generation_config.eos_token_id = None

    def generate(self, batch: list[list[int]], num_new: int) -> None:
        ids = torch.tensor(batch)
        with torch.inference_mode():
            self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=num_new,
                pad_token_id=0,
            )

    def prefill(self, batch: list[list[int]]) -> None:
        with torch.inference_mode():
            self.model(torch.tensor(batch), logits_to_keep=1)


class TgqEngine:
    def __init__(self, model_dir: Path, backend: str) -> None:
        runner = ModelRunner(
            RunnerConfig(str(model_dir), num_blocks=2200, block_size=16, attention_backend=backend)
        )
        self.engine = OfflineEngine(runner)

    def generate(self, batch: list[list[int]], num_new: int) -> None:
        self.engine.generate(batch, max_new_tokens=num_new)

    def prefill(self, batch: list[list[int]]) -> None:
        self.engine.generate(batch, max_new_tokens=1)


def measure(engine: HFEngine | TgqEngine, args: argparse.Namespace, hf: bool) -> dict[str, float]:
    out: dict[str, float] = {}
    single = prompts(1, PROMPT_LEN)
    out["decode_b1_ms"] = 1e3 * decode_step_seconds(
        lambda n: engine.generate(single, n), args.n1, args.n2, args.repeats
    )
    for batch in args.batches:
        many = prompts(batch, PROMPT_LEN)

        def run(num_new: int, batch_prompts: list[list[int]] = many) -> None:
            engine.generate(batch_prompts, num_new)

        step = decode_step_seconds(run, 2, 2 + args.steps, args.batch_repeats)
        out[f"decode_b{batch}_tok_s"] = batch / step
    num_prefill = args.hf_prefill_prompts if hf else args.prefill_prompts
    long = prompts(num_prefill, args.prefill_len)
    engine.prefill(prompts(1, 64))
    out["prefill_tok_s"] = num_prefill * args.prefill_len / timed(lambda: engine.prefill(long))
    return out


def plot(results: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = list(results["transformers"])
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics), 3.4))
    for ax, metric in zip(axes, metrics, strict=True):
        names = list(results)
        bars = ax.bar(names, [results[n][metric] for n in names], color=["#999999", "#1f77b4"])
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_title(metric, fontsize=9)
        ax.tick_params(labelsize=8)
    fig.suptitle(
        "tgq vs transformers, medium Llama bf16, CPU 2 threads (lower ms / higher tok/s)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache", type=Path, default=Path(".cache/bench"))
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--n1", type=int, default=8)
    parser.add_argument("--n2", type=int, default=40)
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed per batch size")
    parser.add_argument("--batches", type=int, nargs="*", default=[16, 64])
    parser.add_argument("--prefill-prompts", type=int, default=16)
    parser.add_argument("--hf-prefill-prompts", type=int, default=2, help="HF is slow here")
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="batch-1 decode repetitions")
    parser.add_argument("--batch-repeats", type=int, default=2, help="batched decode repetitions")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = medium_model(args.cache)
    results = {"transformers": measure(HFEngine(model_dir), args, hf=True)}
    results["tgq"] = measure(TgqEngine(model_dir, args.backend), args, hf=False)
    report(results, args)


def report(results: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "engine.json").write_text(
        json.dumps({"args": vars(args) | {"cache": str(args.cache)}, "results": results}, indent=2)
    )
    plot(results, RESULTS / "engine.png")
    base, ours = results["transformers"], results["tgq"]
    print(f"{'metric':<22}{'transformers':>14}{'tgq':>12}{'tgq/hf':>9}")
    for metric in base:
        print(
            f"{metric:<22}{base[metric]:>14.2f}{ours[metric]:>12.2f}"
            f"{ours[metric] / base[metric]:>9.3f}"
        )


if __name__ == "__main__":
    main()
