"""The `tgq bench` command: check the flags, build the prompts, run the load, report it."""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
from pathlib import Path
from typing import Any

from tgq.cli import CommandError
from tgq.cli.bench.backends import BACKENDS
from tgq.cli.bench.datasets import DATASETS, Words, build_prompts, load_tokenizer
from tgq.cli.bench.load import poisson_arrivals, run_load
from tgq.cli.bench.report import (
    format_summary,
    require_matplotlib,
    summarize,
    write_json,
    write_plots,
)


def bench(args: argparse.Namespace) -> int:
    """Run the benchmark, print its summary, write the JSON and the plots. Exit 1 when a request
    failed and `--fail-on-error` is set, else 0."""
    check(args)
    if args.plot_dir:
        require_matplotlib()
    rng = random.Random(args.seed)
    words = Words(load_tokenizer(args.tokenizer) if args.tokenizer else None)
    prompts = build_prompts(words, args, args.num_prompts + args.warmup, rng)
    measured, warmups = prompts[: args.num_prompts], prompts[args.num_prompts :]
    arrivals = poisson_arrivals(len(measured), args.request_rate or math.inf, rng)
    records, duration_s = asyncio.run(run_load(args, measured, warmups, arrivals))
    summary = summarize(records, duration_s, args.slo or {})
    print(format_summary(summary, describe(args, words)), flush=True)
    if args.output_json:
        write_json(args.output_json, config(args, words), summary, records)
        print(f"wrote {args.output_json}", file=sys.stderr)
    if args.plot_dir:
        for path in write_plots(args.plot_dir, records, summary):
            print(f"wrote {path}", file=sys.stderr)
    return 1 if args.fail_on_error and summary["num_failed"] else 0


def check(args: argparse.Namespace) -> None:
    """What argparse cannot check (values read from the environment, relations of flags)."""
    problems = (
        (args.backend not in BACKENDS, f"--backend must be one of {', '.join(BACKENDS)}"),
        (args.dataset not in DATASETS, f"--dataset must be one of {', '.join(DATASETS)}"),
        (args.concurrency is None and args.request_rate is None,
         "give --concurrency C (fixed concurrency) or --request-rate R (Poisson arrivals)"),
        (args.concurrency is not None and args.concurrency < 1, "--concurrency must be >= 1"),
        (args.request_rate is not None and not args.request_rate > 0,
         "--request-rate must be > 0"),
        (min(args.num_prompts, args.input_len, args.output_len, args.num_groups) < 1,
         "--num-prompts, --input-len, --output-len and --num-groups must be >= 1"),
        (not 0 <= args.range_ratio < 1, "--range-ratio must be in [0, 1)"),
        (args.prefix_len < 0 or args.warmup < 0, "--prefix-len and --warmup must be >= 0"),
        (not args.timeout_s > 0, "--timeout-s must be > 0"),
        (args.dataset == "jsonl" and args.dataset_path is None,
         "--dataset jsonl needs --dataset-path FILE.jsonl"),
    )  # fmt: skip
    for is_wrong, message in problems:
        if is_wrong:
            raise CommandError(message)


def describe(args: argparse.Namespace, words: Words) -> list[tuple[str, str]]:
    """What ran, as the first rows of the summary table."""
    model = f" model={args.model}" if args.model else ""
    if args.request_rate is None:
        load = f"concurrency {args.concurrency}"
    else:
        cap = f", <= {args.concurrency} in flight" if args.concurrency else ""
        load = f"Poisson {args.request_rate:g} req/s{cap}, seed {args.seed}"
    eos = ", ignore_eos" if args.ignore_eos else ""
    spread = f"±{args.range_ratio:.0%}" if args.range_ratio else ""
    lengths = f"in {args.input_len}{spread} / out {args.output_len}{spread}"
    datasets = {
        "random": f"random, {lengths}",
        "shared-prefix": f"shared-prefix, {args.num_groups} x {args.prefix_len} + {lengths}",
        "jsonl": f"jsonl {args.dataset_path}",
    }
    unit = "tokens" if words.tokenizer else "words (no --tokenizer: about a token each)"
    return [
        ("target", f"{args.backend} {args.url}{model}"),
        ("load", f"{args.num_prompts} prompts, {load}{eos}"),
        ("dataset", datasets[args.dataset]),
        ("lengths in", unit),
    ]


def config(args: argparse.Namespace, words: Words) -> dict[str, Any]:
    """The run's settings for the JSON file; the API key stays out."""
    settings = {k: v for k, v in vars(args).items() if k not in ("handler", "api_key")}
    plain = {k: str(v) if isinstance(v, Path) else v for k, v in settings.items()}
    return {**plain, "length_unit": words.unit}
