"""Multi-LoRA: 16 concurrent requests over 4 adapters (4 each, rank 16 on q/k/v/o and the MLP,
every row of a step its own adapter's) against 16 on the base model alone, same engine, same
run, on the medium model (hidden 768, 12 layers, vocab 32000, bf16), CPU. Also the base requests
on an engine without adapters loaded (what serving adapters costs the base model's traffic).

Each run is 16 fresh prompts of 64 tokens (no prefix hits) and 64 new tokens each, greedy;
tokens/s counts the new tokens over the whole run (prefill included). The runs go in turns
(lora, base, plain, lora, ...), fastest of `--repeats` each. Prints one summary line (the goal:
lora/base >= 0.8) and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.harness import medium_llama_2k, random_prompts, timed, write_results
from tgq.batcher.offline import OfflineEngine
from tgq.devtools.random_lora import write_random_adapter
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig

NUM_ADAPTERS, BATCH, PROMPT_LEN, NUM_NEW, RANK = 4, 16, 64, 64, 16
GOAL = 0.8


class Workload:
    """One engine and which adapter each of its 16 requests takes."""

    def __init__(self, runner: ModelRunner, adapters: list[str | None]) -> None:
        self.engine = OfflineEngine(runner)
        self.adapters = adapters

    def tokens_per_s(self, repeat: int) -> float:
        prompts = random_prompts(BATCH, PROMPT_LEN, seed=repeat)
        seconds = timed(
            lambda: self.engine.generate(prompts, max_new_tokens=NUM_NEW, adapters=self.adapters)
        )
        return BATCH * NUM_NEW / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=Path("/tmp/tgq-bench"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model_dir = medium_llama_2k(args.cache)
    adapters = {
        f"adapter-{index}": str(
            write_random_adapter(model_dir, args.cache / f"lora-r{RANK}-{index}", seed=index)
        )
        for index in range(NUM_ADAPTERS)
    }

    def runner(served: dict[str, str]) -> ModelRunner:
        config = RunnerConfig(
            str(model_dir), num_blocks=1024, block_size=16, lora_adapters=tuple(served.items())
        )
        return ModelRunner(config)

    with_adapters = runner(adapters)
    names: list[str | None] = [list(adapters)[i % NUM_ADAPTERS] for i in range(BATCH)]
    workloads = {
        "lora": Workload(with_adapters, names),
        "base": Workload(with_adapters, [None] * BATCH),
        "plain": Workload(runner({}), [None] * BATCH),
    }
    for workload in workloads.values():  # warm-up: kernels measured, recordings made
        workload.tokens_per_s(-1)
    rates = dict.fromkeys(workloads, 0.0)
    for repeat in range(args.repeats):  # in turns: a slow phase of the machine hits all alike
        for name, workload in workloads.items():
            rates[name] = max(rates[name], workload.tokens_per_s(repeat))
    results = {
        **{f"{name}_tokens_per_s": rate for name, rate in rates.items()},
        "lora_over_base": rates["lora"] / rates["base"],
        "lora_over_plain": rates["lora"] / rates["plain"],
    }
    write_results("lora", args, results, with_adapters)
    print(
        f"lora: {BATCH} requests over {NUM_ADAPTERS} adapters (rank {RANK})"
        f" {rates['lora']:.1f} tok/s, base alone {rates['base']:.1f} tok/s (same engine),"
        f" {rates['plain']:.1f} tok/s (no adapters loaded):"
        f" lora/base {results['lora_over_base']:.2f}x (goal >= {GOAL}),"
        f" lora/plain {results['lora_over_plain']:.2f}x"
    )


if __name__ == "__main__":
    main()
