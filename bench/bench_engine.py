"""Engine benchmark: tgq's paged runner against transformers `generate` on the same weights.

Medium Llama shape (hidden 768, 12 layers, 12 heads, intermediate 2048, vocab 32000; ~134M
parameters), random bf16 weights, CPU, 2 threads. Measured in one run, baseline first:

- decode step time at batch 1: (time of N2 new tokens - time of N1 new tokens) / (N2 - N1), so
  prompt processing cancels out;
- decode tokens/s at batch 16 and 64 (transformers: static batching of equal-length prompts);
- prefill tokens/s for 16 x 512-token prompts (transformers: one forward over the padded-free
  batch, optionally fewer prompts since it is slow here; a rate is per token either way).

Every number is the best of a few repetitions, taken in turns with the baseline (see
`best_interleaved`). Prints one summary table and writes JSON and a PNG bar chart to
bench/results/.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.harness import (
    RESULTS,
    Engines,
    HFEngine,
    TgqEngine,
    best_decode_step,
    best_interleaved,
    medium_llama_2k,
    pyplot,
    random_prompts,
    save_figure,
    timed,
    write_results,
)
from tgq.gpu_worker.runner import ModelRunner

PROMPT_LEN = 16


def measure(engines: Engines, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {name: {} for name in engines}

    def record(metric: str, values: dict[str, float]) -> None:
        for name, value in values.items():
            out[name][metric] = value

    single = random_prompts(1, PROMPT_LEN)
    for engine in engines.values():
        engine.generate(single, args.n1)  # warm-up
    step = best_decode_step(engines, single, args.n1, args.n2, args.repeats)
    record("decode_b1_ms", {name: 1e3 * seconds for name, seconds in step.items()})
    for batch in args.batches:
        prompts = random_prompts(batch, PROMPT_LEN)
        step = best_decode_step(engines, prompts, 2, 2 + args.steps, args.batch_repeats)
        record(f"decode_b{batch}_tok_s", {name: batch / s for name, s in step.items()})
    for engine in engines.values():
        engine.prefill(random_prompts(1, 64))

    def prefill_rate(engine: HFEngine | TgqEngine, repeat: int) -> float:
        # Fresh prompts every time: a repeated prompt would hit tgq's prefix cache.
        count = args.hf_prefill_prompts if isinstance(engine, HFEngine) else args.prefill_prompts
        batch = random_prompts(count, args.prefill_len, seed=repeat)
        return timed(lambda: engine.prefill(batch)) / (count * args.prefill_len)

    per_token = best_interleaved(engines, prefill_rate, args.prefill_repeats)
    record("prefill_tok_s", {name: 1 / seconds for name, seconds in per_token.items()})
    return out


def plot(results: dict[str, dict[str, float]], path: Path) -> None:
    plt = pyplot()
    metrics = list(results["transformers"])
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics), 3.4))
    for ax, metric in zip(axes, metrics, strict=True):
        names = list(results)
        bars = ax.bar(names, [results[n][metric] for n in names], color=["#999999", "#1f77b4"])
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_title(metric, fontsize=9)
        ax.tick_params(labelsize=8)
    save_figure(
        fig, "tgq vs transformers, medium Llama bf16, CPU 2 threads (lower ms / higher tok/s)", path
    )


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
    parser.add_argument("--batch-repeats", type=int, default=3, help="batched decode repetitions")
    parser.add_argument("--prefill-repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = medium_llama_2k(args.cache)
    engines: Engines = {
        "transformers": HFEngine(model_dir),
        "tgq": TgqEngine(model_dir, args.backend),
    }
    tgq = engines["tgq"]
    assert isinstance(tgq, TgqEngine)
    report(measure(engines, args), args, tgq.runner)


def report(
    results: dict[str, dict[str, float]], args: argparse.Namespace, runner: ModelRunner
) -> None:
    write_results("engine", args, results, runner)
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
