"""The prompts `tgq bench` sends: random lengths, shared-prefix groups, or a JSONL file; their
text made of words that are one token each (with a tokenizer) or about one (without)."""

from __future__ import annotations

import argparse
import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tgq.cli import CommandError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

DATASETS = ("random", "shared-prefix", "jsonl")
MAX_VOCABULARY_WORDS = 2000
# Without a tokenizer, prompts are made of these words: about one token each in common
# vocabularies, so lengths in words are close to lengths in tokens.
FALLBACK_WORDS = (
    "the of and to in is was for on are with as by at from that this have not but they all "
    "can more one time year people way day man thing woman life child world school state "
    "family group country problem hand part place case week company system program question "
    "work government number night point home water room mother area money story fact month "
    "lot right study book eye job word business issue side kind head house service friend"
)


@dataclass(frozen=True)
class Prompt:
    text: str
    num_tokens: int  # by the tokenizer when one is given, else in words
    output_len: int


class Words:
    """Prompt text as words. With a tokenizer each word is one token, even after a space and
    next to any other word, so N words are exactly N tokens; without, FALLBACK_WORDS."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.unit = "words" if tokenizer is None else "tokens"
        self.words = FALLBACK_WORDS.split() if tokenizer is None else single_token_words(tokenizer)

    def text(self, num_words: int, rng: random.Random) -> str:
        return " ".join(rng.choices(self.words, k=num_words))

    def count(self, text: str) -> int:
        if self.tokenizer is None:
            return len(text.split())
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)


def single_token_words(tokenizer: Tokenizer) -> list[str]:
    """Alphabetic vocabulary entries that are one token both alone and after a space: then
    `"a b c"` encodes to one token per word (the pre-tokenizer splits at spaces)."""

    def is_one_token(word: str) -> bool:  # alone, and as the next word
        return len(tokenizer.encode(f"{word} {word}", add_special_tokens=False).ids) == 2

    words: dict[str, None] = {}  # ordered, unique
    for token_id in range(tokenizer.get_vocab_size()):
        word = tokenizer.decode([token_id]).strip()
        if word.isascii() and word.isalpha() and word not in words and is_one_token(word):
            words[word] = None
            if len(words) == MAX_VOCABULARY_WORDS:
                break
    if not words:
        raise CommandError("the tokenizer has no single-token words to build prompts from")
    return list(words)


def load_tokenizer(path: Path) -> Tokenizer:
    from tokenizers import Tokenizer

    file = path / "tokenizer.json" if path.is_dir() else path
    try:
        return Tokenizer.from_file(str(file))
    except Exception as error:  # tokenizers raises its own untyped Exception
        raise CommandError(f"cannot load the tokenizer {file}: {error}") from None


def lengths(mean: int, range_ratio: float, num: int, rng: random.Random) -> list[int]:
    """Uniform in [mean * (1 - ratio), mean * (1 + ratio)], as vLLM's random dataset."""
    low, high = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
    return [max(1, rng.randint(low, high)) for _ in range(num)]


def synthetic_prompts(
    words: Words, args: argparse.Namespace, num: int, rng: random.Random
) -> list[Prompt]:
    """Random-length prompts; for `shared-prefix`, prompt i starts with group `i % G`'s common
    prefix of `--prefix-len` tokens, then `--input-len` tokens of its own."""
    is_shared = args.dataset == "shared-prefix"
    num_groups = args.num_groups if is_shared else 1
    prefixes = [words.text(args.prefix_len if is_shared else 0, rng) for _ in range(num_groups)]
    input_lens = lengths(args.input_len, args.range_ratio, num, rng)
    output_lens = lengths(args.output_len, args.range_ratio, num, rng)
    prompts = []
    for index, (input_len, output_len) in enumerate(zip(input_lens, output_lens, strict=True)):
        text = " ".join(filter(None, (prefixes[index % num_groups], words.text(input_len, rng))))
        prompts.append(Prompt(text, words.count(text), output_len))
    return prompts


def jsonl_prompts(words: Words, path: Path, num: int, output_len: int) -> list[Prompt]:
    """Lines `{"prompt": "...", "output_len": 64}` (`output_len` optional), taken in order and
    repeated from the first when `num` exceeds them."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
        rows = [json.loads(line) for line in lines if line.strip()]
    except (OSError, ValueError) as error:
        raise CommandError(f"cannot read prompts from {path}: {error}") from None
    for number, row in enumerate(rows, 1):
        if not (isinstance(row, dict) and isinstance(row.get("prompt"), str)):
            raise CommandError(f'{path}: prompt {number} has no string "prompt"')
    if not rows:
        raise CommandError(f"{path} has no prompts")
    return [
        Prompt(row["prompt"], words.count(row["prompt"]), int(row.get("output_len", output_len)))
        for row in itertools.islice(itertools.cycle(rows), num)
    ]


def build_prompts(
    words: Words, args: argparse.Namespace, num: int, rng: random.Random
) -> list[Prompt]:
    if args.dataset == "jsonl":
        return jsonl_prompts(words, args.dataset_path, num, args.output_len)
    return synthetic_prompts(words, args, num, rng)
