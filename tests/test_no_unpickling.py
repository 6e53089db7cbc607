"""The build fails if code outside tests can unpickle: the pickle modules' load functions,
pyzmq's Python-object receive, torch's checkpoint loader without `weights_only=True`, or a
Celery app accepting anything but JSON. Weights come from safetensors, and process boundaries
carry JSON (see gpu_worker/rank_protocol.py, batcher/messages.py).

The names this test looks for are assembled from parts, so that the test itself does not
contain the calls it forbids."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tgq.api.settings import Settings
from tgq.bulk.celery_app import make_app

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (
    "api",
    "batcher",
    "bulk",
    "cli",
    "gpu_worker",
    "kernels",
    "devtools",
    "bench",
    "migrations",
)
LOAD = "lo" + "ad"  # the attribute name of the calls looked for
RECEIVE_OBJECT = "recv_" + "pyobj"
FORBIDDEN = re.compile(rf"\b(pickle|cPickle|dill|cloudpickle)\.{LOAD}s?\b|\b{RECEIVE_OBJECT}\b")


def sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def unsafe_torch_loads(path: Path) -> list[int]:
    """Lines calling torch's loader without `weights_only=True`."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == LOAD
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch"
        ):
            safe = any(
                k.arg == "weights_only"
                and isinstance(k.value, ast.Constant)
                and k.value.value is True
                for k in node.keywords
            )
            if not safe:
                lines.append(node.lineno)
    return lines


def test_no_code_outside_tests_unpickles() -> None:
    found = []
    for path in sources():
        text = path.read_text(encoding="utf-8")
        found += [
            f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
            for number, line in enumerate(text.splitlines(), 1)
            if FORBIDDEN.search(line)
        ]
        found += [f"{path.relative_to(ROOT)}:{n}: torch.{LOAD} without weights_only=True"
                  for n in unsafe_torch_loads(path)]  # fmt: skip
    assert not found, "\n".join(found)


def test_the_check_catches_what_it_should(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    call = f"torch.{LOAD}('w.pt'"
    bad.write_text(f"import torch\nx = {call})\ny = {call}, weights_only=True)\n")
    assert unsafe_torch_loads(bad) == [2]
    assert FORBIDDEN.search(f"data = pickle.{LOAD}s(blob)")
    assert FORBIDDEN.search(f"socket.{RECEIVE_OBJECT}()")
    assert not FORBIDDEN.search("# never unpickled: safetensors only")


def test_celery_accepts_json_only() -> None:
    conf = make_app(Settings()).conf
    assert conf.accept_content == ["json"] and conf.result_accept_content == ["json"]
    assert conf.task_serializer == conf.result_serializer == "json"
