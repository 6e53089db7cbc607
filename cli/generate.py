"""Offline generation from the command line: `python -m tgq.cli.generate --model-id DIR`.

`--demo` uses the demo model: a tiny Llama trained (once, under .cache/demo, a few minutes) on
Python's bundled documentation, so the example runs with no hub.
"""

from __future__ import annotations

import argparse
import time

from tokenizers import Tokenizer

from tgq.batcher.offline import OfflineEngine
from tgq.gpu_worker.plan import SamplingParams
from tgq.gpu_worker.runner import ModelRunner, RunnerConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-id", help="local directory or hub id (safetensors only)")
    parser.add_argument("--demo", action="store_true", help="use the demo model")
    parser.add_argument("--revision")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompt", action="append", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int)
    args = parser.parse_args()
    if not args.model_id and not args.demo:
        parser.error("give --model-id or --demo")
    if args.demo:
        from tgq.devtools.demo import demo_model

        model_id = str(demo_model())
    else:
        model_id = args.model_id
    runner = ModelRunner(RunnerConfig(model_id, revision=args.revision, dtype=args.dtype))
    tokenizer = Tokenizer.from_file(str(runner.loaded.model_dir / "tokenizer.json"))
    engine = OfflineEngine(runner, eos_token_ids=tuple(runner.loaded.config.eos_token_ids))
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    prompts = [tokenizer.encode(p).ids for p in args.prompt]
    start = time.perf_counter()
    results = engine.generate(prompts, sampling, max_new_tokens=args.max_new_tokens)
    elapsed = time.perf_counter() - start
    for text, result in zip(args.prompt, results, strict=True):
        print(f"{text!r} -> {tokenizer.decode(result.token_ids)!r} ({result.finish_reason})")
    num_tokens = sum(len(r.token_ids) for r in results)
    print(f"{num_tokens} tokens in {elapsed:.2f}s ({num_tokens / elapsed:.1f} tokens/s)")


if __name__ == "__main__":
    main()
