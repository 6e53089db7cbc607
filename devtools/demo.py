"""The demo model: a tiny random-weight Llama with a tokenizer trained on Python's bundled docs
and a chat template, built once under `.cache/demo/tiny-llama` (no hub needed). Its output is
not language yet (random weights). `python -m devtools.demo` builds it and prints its path."""

from __future__ import annotations

import json
from pathlib import Path

from devtools.random_model import make_config, write_model
from devtools.tokenizer import train_tokenizer

DEMO_DIR = Path(".cache/demo/tiny-llama")
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


def demo_model(path: Path = DEMO_DIR) -> Path:
    if not (path / "model.safetensors").is_file():
        train_tokenizer(path)
        write_model(path, make_config("LlamaForCausalLM"))
    if "chat_template" not in (path / "tokenizer_config.json").read_text(encoding="utf-8"):
        add_chat_template(path)  # also for a demo built before it had one
    return path


if __name__ == "__main__":
    print(demo_model())
