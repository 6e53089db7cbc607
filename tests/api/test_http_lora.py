"""LoRA adapters over HTTP (`LORA_ADAPTERS`, embedded mode): TGI's `adapter_id` and OpenAI's
`model` pick an adapter (named in the answer's `model`), whose greedy tokens equal transformers
with the PEFT adapter merged; `/v1/models` lists the base model and the adapters; an unknown
`adapter_id` is a 422."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.api.stack import Stack
from tests.api.test_http_routes import encode
from tests.gpu_worker.lora_adapters import merged_model, write_adapter

pytest.importorskip("peft")
pytestmark = pytest.mark.timeout(300)

PROMPT = "The Python language"
MAX_NEW = 8
ADAPTERS = {"support-bot": 8, "legal-bot": 16}  # name -> rank


@pytest.fixture(scope="module")
def lora_stack(text_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("lora-http")
    adapters = {
        name: write_adapter(text_model_dir, root / name, rank=rank, alpha=2 * rank, seed=rank)
        for name, rank in ADAPTERS.items()
    }
    settings = {
        "AUTO_MIGRATE": "true",
        "LORA_ADAPTERS": ",".join(f"{name}={path}" for name, path in adapters.items()),
    }
    url = f"sqlite+aiosqlite:///{root / 'tgq.db'}"
    running = Stack(text_model_dir, url, root, redis_url=None, api_env=settings)
    try:
        running.start_api()
        yield running
    finally:
        running.stop()


def reference(model_dir: Path, adapter: Path | None) -> list[int]:
    model = merged_model(model_dir, adapter)
    prompt = encode(model_dir, PROMPT)
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
        do_sample=False,
        max_new_tokens=MAX_NEW,
        pad_token_id=0,
    )
    tokens: list[int] = out[0, len(prompt) :].tolist()
    return tokens


def generate(url: str, adapter_id: str | None) -> httpx.Response:
    params = {"max_new_tokens": MAX_NEW, "details": True, "ignore_eos": True}
    body: dict[str, Any] = {"inputs": PROMPT, "parameters": {**params, "adapter_id": adapter_id}}
    return httpx.post(f"{url}/generate", json=body, timeout=120)


def test_each_adapter_and_the_base_in_parallel_equal_merged_peft(lora_stack: Stack) -> None:
    names: list[str | None] = [None, *ADAPTERS]
    with ThreadPoolExecutor(len(names)) as pool:
        answers = list(pool.map(lambda name: generate(lora_stack.url, name), names))
    for name, answer in zip(names, answers, strict=True):
        assert answer.status_code == 200, answer.text
        tokens = [t["id"] for t in answer.json()["details"]["tokens"]]
        adapter = None if name is None else lora_stack.log_dir / name
        assert tokens == reference(lora_stack.model_dir, adapter), name


def test_the_openai_model_field_picks_the_adapter(lora_stack: Stack) -> None:
    body = {"prompt": PROMPT, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    for name in ADAPTERS:
        completion = httpx.post(
            f"{lora_stack.url}/v1/completions", json={**body, "model": name}, timeout=120
        )
        assert completion.status_code == 200, completion.text
        assert completion.json()["model"] == name
        tgi = generate(lora_stack.url, name).json()["generated_text"]
        assert completion.json()["choices"][0]["text"] == tgi


def test_models_lists_the_base_and_the_adapters(lora_stack: Stack) -> None:
    models = httpx.get(f"{lora_stack.url}/v1/models", timeout=10).json()["data"]
    base = models[0]["id"]
    assert [(m["id"], m["parent"]) for m in models] == [
        (base, None),
        *((name, base) for name in ADAPTERS),
    ]


def test_an_unknown_adapter_id_is_a_422(lora_stack: Stack) -> None:
    answer = generate(lora_stack.url, "nope")
    message = (
        "Input validation error: `adapter_id` must be null, the base model's id ('tgq-test') or"
        " a served LoRA adapter ('legal-bot', 'support-bot'). Given: 'nope'"
    )
    assert (answer.status_code, answer.json()) == (
        422,
        {"error": message, "error_type": "validation"},
    )
