"""Train a small byte-level BPE tokenizer on text that ships with Python (the pydoc topics), so
examples have a real `tokenizer.json` without any hub."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1 (bos), 2 (eos)


def bundled_text() -> list[str]:
    from pydoc_data.topics import topics

    return list(topics.values())


def train_tokenizer(
    out_dir: str | Path, vocab_size: int = 512, texts: Iterable[str] | None = None
) -> Path:
    """On `texts` (default: the pydoc topics)."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(bundled_text() if texts is None else texts, trainer=trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (out / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return out
