"""`tgq bench`'s flags, each falling back to a `BENCH_*` environment variable."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tgq.cli.bench.backends import BACKENDS
from tgq.cli.bench.datasets import DATASETS
from tgq.cli.bench.report import parse_slos

ENV_PREFIX = "BENCH_"


def _slos(text: str) -> dict[str, float]:
    try:
        return parse_slos(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


@dataclass(frozen=True)
class Flag:
    """A flag of `tgq bench`; its default can come from the environment (`env`)."""

    names: tuple[str, ...]  # the first is tgq's name, the others vLLM's
    help: str
    type: Callable[[str], Any] = str
    default: Any = None
    choices: tuple[str, ...] | None = None
    is_switch: bool = False

    @property
    def env(self) -> str:  # --num-prompts: BENCH_NUM_PROMPTS
        return ENV_PREFIX + self.names[0].removeprefix("--").replace("-", "_").upper()

    def add_to(self, parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
        value = environ.get(self.env)
        shown = "" if self.default is None else f"; default {self.default}"
        text = f"{self.help} (env {self.env}{shown})"
        if self.is_switch:
            is_on = value is not None and value.lower() in ("1", "true", "yes", "on")
            parser.add_argument(*self.names, action="store_true", default=is_on, help=text)
        else:  # argparse converts a string default (the environment's) with `type`
            default = self.default if value is None else value
            parser.add_argument(
                *self.names, type=self.type, default=default, choices=self.choices, help=text
            )


FLAGS = (
    Flag(("--backend",), "the route: /v1/chat/completions, /v1/completions or TGI's "
         "/generate_stream", default="openai-completions", choices=tuple(BACKENDS)),
    Flag(("--model",), "the OpenAI `model` field (left out when not given)"),
    Flag(("--num-prompts",), "requests measured", int, 100),
    Flag(("--concurrency", "--max-concurrency"),
         "requests in flight: alone, a closed loop; with --request-rate, a cap", int),
    Flag(("--request-rate",), "Poisson arrivals, requests/s (`inf`: all at once)", float),
    Flag(("--seed",), "of the prompts and the arrival times", int, 0),
    Flag(("--dataset", "--dataset-name"), "random lengths, shared-prefix groups, or a JSONL "
         "file of prompts", default="random", choices=DATASETS),
    Flag(("--dataset-path",), 'the JSONL file: {"prompt": "...", "output_len": 64} per line',
         Path),
    Flag(("--tokenizer",), "a tokenizer.json (or its directory) for prompts of exact token "
         "lengths; without it, lengths are in words", Path),
    Flag(("--input-len", "--random-input-len"), "prompt length (shared-prefix: the unique part)",
         int, 128),
    Flag(("--output-len", "--random-output-len"), "max tokens asked for (jsonl: the default)",
         int, 64),
    Flag(("--range-ratio", "--random-range-ratio"),
         "lengths uniform in [len * (1 - r), len * (1 + r)]", float, 0.0),
    Flag(("--prefix-len",), "shared-prefix: length of each group's common prefix", int, 256),
    Flag(("--num-groups",), "shared-prefix: groups (prompt i is in group i %% G)", int, 4),
    Flag(("--ignore-eos",), "send `ignore_eos: true` (tgq's and vLLM's extension) for exact "
         "output lengths", is_switch=True),
    Flag(("--slo", "--goodput"), "goodput SLOs, e.g. ttft=500ms,tpot=50ms,e2e=2s", _slos),
    Flag(("--warmup", "--num-warmups"), "requests sent, not measured, before the run", int, 0),
    Flag(("--timeout-s",), "per request, from send to the end of its stream", float, 300.0),
    Flag(("--output-json",), "write the settings, the summary and every request here", Path),
    Flag(("--plot-dir",), "write latency_cdf.png and throughput.png here (needs matplotlib)",
         Path),
    Flag(("--fail-on-error",), "exit 1 if a request failed", is_switch=True),
)  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str] = os.environ) -> None:
    """`tgq bench`'s flags; `--url` and `--api-key` may come after `bench` too."""
    parser.add_argument("--url", default=argparse.SUPPRESS, help="as tgq --url (env TGQ_URL)")
    parser.add_argument(
        "--api-key", default=argparse.SUPPRESS, help="as tgq --api-key (env TGQ_API_KEY)"
    )
    for flag in FLAGS:
        flag.add_to(parser, environ)
