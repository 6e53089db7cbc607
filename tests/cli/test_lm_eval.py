"""lm-eval-harness, the real package, against `tgq serve`: its `local-completions` model scores a
small offline multiple-choice task (a local JSONL file and task config) through
`/v1/completions` (token-id prompts, `echo`, `logprobs: 1`, `max_tokens: 1`), and its own `hf`
model scores the same task on the same weights. Each answer's loglikelihood agrees within 1e-3,
and so does the accuracy: what the random-weight model prefers does not matter, only that both
read the same numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.api.stack import free_port, wait_healthy
from tests.cli.test_processes_cli import _serve

pytestmark = pytest.mark.timeout(600)
TASK = "tgq_local_mc"
DOCS = [
    {
        "question": "The capital of France is",
        "choices": [" Paris", " London", " a loop"],
        "answer": 0,
    },
    {"question": "def main():\n    return", "choices": [" 0", " None", " the list"], "answer": 1},
    {"question": "Python is a programming", "choices": [" language", " snake"], "answer": 0},
    {
        "question": "import os\nprint(os.",
        "choices": ["path)", "getcwd())", "environ)"],
        "answer": 1,
    },
    {"question": "for i in range(", "choices": ["10):", "len(x)):", "'a')"], "answer": 0},
]
TOLERANCE = 1e-3


def write_task(directory: Path) -> Path:
    """A task config reading a local JSONL file (lm-eval's `json` dataset, offline)."""
    docs = directory / "docs.jsonl"
    docs.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS), encoding="utf-8")
    config = f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
    (directory / f"{TASK}.yaml").write_text(config, encoding="utf-8")
    return directory


def evaluate(model: str, model_args: str, tasks_dir: Path) -> dict[str, Any]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    results: dict[str, Any] = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(tasks_dir)),
        log_samples=True,
        batch_size=1,
    )
    return results


def test_lm_eval_local_completions_equals_its_hf_model(
    text_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks_dir = write_task(tmp_path)
    port = free_port()
    flags = ("--model-id", str(text_model_dir), "--port", str(port), "--enable-prefill-logprobs")
    process = _serve(tmp_path, {}, *flags)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process, tmp_path / "serve.log", 60)
        served = evaluate(
            "local-completions",
            f"model=tgq-test,base_url=http://127.0.0.1:{port}/v1/completions,"
            f"tokenizer={text_model_dir},tokenizer_backend=huggingface,tokenized_requests=True,"
            "num_concurrent=1,max_retries=1",
            tasks_dir,
        )
    finally:
        process.kill()
    reference = evaluate("hf", f"pretrained={text_model_dir},dtype=float32,device=cpu", tasks_dir)
    ours, theirs = served["samples"][TASK], reference["samples"][TASK]
    assert len(ours) == len(theirs) == len(DOCS)
    for mine, their in zip(ours, theirs, strict=True):
        assert mine["doc"] == their["doc"]
        mine_ll = [response[0][0] for response in mine["resps"]]
        their_ll = [response[0][0] for response in their["resps"]]
        assert mine_ll == pytest.approx(their_ll, abs=TOLERANCE)
        assert [r[0][1] for r in mine["resps"]] == [r[0][1] for r in their["resps"]]  # is_greedy
    accuracy = served["results"][TASK]["acc,none"]
    assert accuracy == reference["results"][TASK]["acc,none"]
