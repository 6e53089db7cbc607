"""The demo model: a small Llama trained on Python's bundled documentation (`devtools.train_demo`,
minutes on the CPU), with a chat template, built once under `.cache/demo/tiny-llama` (no hub
needed). `python -m tgq.devtools.demo` builds it if needed and prints only its path on stdout.

A version stamp file marks a finished build of the current recipe: a dir without it (an older
random-weight demo, or a build that was interrupted) is rebuilt from scratch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tgq.devtools.train_demo import TrainConfig

DEMO_DIR = Path(".cache/demo/tiny-llama")
DEMO_VERSION = "trained-1"  # bump when the corpus, tokenizer or training recipe changes
VERSION_FILE = "tgq-demo-version"
# ChatML-style, with the tokenizer's own special tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def add_chat_template(model_dir: Path, template: str = CHAT_TEMPLATE) -> None:
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = template
    config_path.write_text(json.dumps(config), encoding="utf-8")


def is_current(path: Path) -> bool:
    stamp = path / VERSION_FILE
    return stamp.is_file() and stamp.read_text(encoding="utf-8").strip() == DEMO_VERSION


def demo_model(path: Path = DEMO_DIR, config: TrainConfig | None = None) -> Path:
    """`path`, trained first unless it holds the current version (`config`: for tests)."""
    if not is_current(path):
        from tgq.devtools.train_demo import TrainConfig, build

        shutil.rmtree(path, ignore_errors=True)
        build(path, config or TrainConfig())
        (path / VERSION_FILE).write_text(DEMO_VERSION, encoding="utf-8")
    return path


if __name__ == "__main__":
    print(demo_model())
