"""tgq's 8-bit and 4-bit weights against llama.cpp's Q8_0 and Q4_K_M on the same weights: the
decode step at batch 1 and tokens/s at batch 16, each side against its own bf16, CPU, 2 threads.

Model: `harness.chat_llama`'s medium Llama (random bf16 weights, the tokenizer trained on the
bundled corpus), the directory tgq loads. llama.cpp reads the same weights as GGUF, converted by
hand (this script builds nothing; docs/performance.md gives the commands): `--gguf-dir` holds
`bf16.gguf`, `Q8_0.gguf` and `Q4_K_M.gguf`.

- tgq: bf16, `--quantize int8`, and a GPTQ int4 checkpoint of that directory (groups of 128,
  `devtools.grouped_checkpoint`), timed as `bench_quant` times them: `best_decode_step` over
  random 16-token prompts.
- llama.cpp: `llama-batched-bench -npp 16 -ntg 64 -npl 1,16 -t THREADS` on each GGUF: its
  text-generation speed with 1 and with 16 sequences in parallel, each after a 16-token prompt.

The two sides take turns, `--rounds` rounds; each figure is its best round. Prints one table
(each side's quantized step against its own bf16, and tgq against llama.cpp); writes JSON and a
bar chart to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import torch

from bench.harness import (
    RESULTS,
    Engines,
    TgqEngine,
    bar_panel,
    best_decode_step,
    chat_llama,
    pyplot,
    random_prompts,
    save_figure,
    write_results,
)
from tgq.devtools.grouped_checkpoint import write_grouped

PROMPT_LEN, NEW_TOKENS = 16, 64
BATCHES = (1, 16)
GROUP_SIZE = 128
# (weights, tgq's engine, llama.cpp's GGUF)
PAIRS = (("bf16", "bf16", "bf16"), ("8-bit", "int8", "Q8_0"), ("4-bit", "gptq-int4", "Q4_K_M"))


def prompts(model_dir: Path, batch: int) -> list[list[int]]:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return random_prompts(batch, PROMPT_LEN, vocab=vocab)


def llama_cpp_steps(binary: str, gguf: Path, threads: int) -> dict[int, float]:
    """llama-batched-bench's decode step (ms) per number of parallel sequences."""
    command = [
        binary, "-m", str(gguf), "-c", "2048", "-b", "512", "-ub", "512", "-npp", str(PROMPT_LEN),
        "-ntg", str(NEW_TOKENS), "-npl", ",".join(map(str, BATCHES)), "-t", str(threads),
        "--output-format", "jsonl",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=True, timeout=900)
    steps: dict[int, float] = {}
    for line in (done.stdout + done.stderr).splitlines():
        if line.startswith("{") and '"speed_tg"' in line:
            row = json.loads(line)
            steps[int(row["pl"])] = 1e3 * row["pl"] / row["speed_tg"]
    if set(steps) != set(BATCHES):
        raise RuntimeError(f"llama-batched-bench printed no results for {gguf}:\n{done.stderr}")
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache", type=Path, default=Path(".cache/bench"))
    parser.add_argument("--batched-bench", required=True, help="llama.cpp's llama-batched-bench")
    parser.add_argument("--gguf-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = chat_llama(args.cache, "medium")
    gptq = write_grouped(model_dir, args.cache / "medium-llama-chat-gptq", "gptq", GROUP_SIZE)
    bf16 = TgqEngine(model_dir, "auto")
    engines: Engines = {
        "bf16": bf16,
        "int8": TgqEngine(model_dir, "auto", quantize="int8"),
        "gptq-int4": TgqEngine(gptq, "auto"),
    }
    for engine in engines.values():
        engine.generate(prompts(model_dir, 1), 4)  # warm-up
    ours: dict[str, dict[int, float]] = {name: {} for name in engines}
    theirs: dict[str, dict[int, float]] = {gguf: {} for _, _, gguf in PAIRS}
    for _ in range(args.rounds):
        for batch in BATCHES:
            step = best_decode_step(
                engines, prompts(model_dir, batch), 2, 2 + args.steps, args.repeats
            )
            for name, seconds in step.items():
                ours[name][batch] = min(ours[name].get(batch, float("inf")), seconds * 1e3)
        for gguf, best in theirs.items():
            gguf_path = args.gguf_dir / f"{gguf}.gguf"
            for batch, ms in llama_cpp_steps(args.batched_bench, gguf_path, args.threads).items():
                best[batch] = min(best.get(batch, float("inf")), ms)
    results = {
        **{f"tgq {name}": by_batch(steps) for name, steps in ours.items()},
        **{f"llama.cpp {name}": by_batch(steps) for name, steps in theirs.items()},
    }
    write_results("quant-llamacpp", args, results, bf16.runner)
    plot(results, RESULTS / "quant-llamacpp-cpu.png")
    print(
        f"{'weights':<8}{'tgq b1 ms':>11}{'vs bf16':>9}{'llama.cpp b1 ms':>17}{'vs bf16':>9}"
        f"{'tgq b16 tok/s':>15}{'llama.cpp b16 tok/s':>21}"
        f"{'b1 time tgq/llama':>19}{'b16 tok/s tgq/llama':>21}"
    )
    for weights, tgq_name, gguf in PAIRS:
        a, b = ours[tgq_name], theirs[gguf]
        print(
            f"{weights:<8}{a[1]:>11.2f}{a[1] / ours['bf16'][1]:>9.3f}{b[1]:>17.2f}"
            f"{b[1] / theirs['bf16'][1]:>9.3f}{16e3 / a[16]:>15.1f}{16e3 / b[16]:>21.1f}"
            f"{a[1] / b[1]:>19.3f}{b[16] / a[16]:>21.3f}"
        )


def by_batch(steps: dict[int, float]) -> dict[str, float]:
    return {"decode_b1_step_ms": steps[1], "decode_b16_tok_s": 16e3 / steps[16]}


def plot(results: dict[str, dict[str, float]], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, metric in zip(axes, ("decode_b1_step_ms", "decode_b16_tok_s"), strict=True):
        names = list(results)
        bar_panel(ax, metric, names, [results[n][metric] for n in names], "%.1f")
        for bar, name in zip(ax.patches, names, strict=True):  # tgq blue, llama.cpp grey
            bar.set_color("#1f77b4" if name.startswith("tgq") else "#999999")
        ax.tick_params(axis="x", labelrotation=30)
    save_figure(fig, "tgq int8 / GPTQ int4 vs llama.cpp Q8_0 / Q4_K_M, medium model, CPU", path)


if __name__ == "__main__":
    main()
