"""tgq installed as a new user installs it, in a fresh venv beside the latest transformers (and
so Hugging Face's `kernels`): the venv, `tgq serve` with Postgres and Redis started from a
directory outside the repository, the requests it must answer (`test_install.py`)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import redis

from tests.api.stack import (
    REDIS_URL,
    create_database,
    drop_database,
    free_port,
    wait_healthy,
)

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"  # the local CPU build: any other torch downloads gigabytes
INSTALL_TIMEOUT_S = 600
HEALTHY_TIMEOUT_S = 180
REQUEST_TIMEOUT_S = 120
STOP_TIMEOUT_S = 60
# The test's own environment must not leak into the installed service.
NOT_INHERITED = (
    "PYTHONPATH", "VIRTUAL_ENV", "HOSTNAME", "PORT", "REDIS_URL", "DATABASE_URL", "REDIS_PREFIX",
    "MODEL_ID", "MODEL_DIR", "API_KEY", "REQUIRE_API_KEYS",
)  # fmt: skip
WHICH_KERNELS = """
import importlib.metadata, json, kernels, tgq
print(json.dumps({
    "kernels": kernels.__file__,
    "kernels_from": importlib.metadata.packages_distributions()["kernels"],
    "has_get_kernel": hasattr(kernels, "get_kernel"),
    "tgq": tgq.__file__,
}))
"""
KERNEL_SOURCES = """
import json
from tgq.kernels import cpu_ops
print(json.dumps([str(path) for path in cpu_ops._SOURCES]))
"""


def run(
    command: list[str | Path], *, cwd: Path, timeout: float = INSTALL_TIMEOUT_S, **extra_env: str
) -> str:
    done = subprocess.run(
        [str(part) for part in command], cwd=cwd, env=child_env(**extra_env), capture_output=True,
        text=True, timeout=timeout, check=False,
    )  # fmt: skip
    output = f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    assert done.returncode == 0, f"{command} failed ({done.returncode}):\n{output}"
    return done.stdout


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def source_copy(destination: Path) -> Path:
    """The repository's files (tracked, and untracked ones git does not ignore), copied with their
    symlinks: a build from it sees no stale `build/` or egg-info of the checkout."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        source = ROOT / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the working tree, not yet in git
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, target)
    return destination


def new_venv(home: Path, *packages: str | Path) -> Path:
    """A fresh venv in `home` with torch, then `packages` under the repository's pins,
    transformers apart; the latest `kernels` must have come with them."""
    run([sys.executable, "-m", "venv", home / "venv"], cwd=home)
    pip: list[str | Path] = [home / "venv" / "bin" / "python", "-m", "pip"]
    install: list[str | Path] = [*pip, "install", "-q", "--no-compile"]  # imports compile
    run([*install, TORCH], cwd=home)
    pins = (ROOT / "constraints.txt").read_text().splitlines()
    constraints = home / "constraints.txt"
    constraints.write_text("\n".join(p for p in pins if not p.startswith("transformers==")) + "\n")
    run([*install, "-c", constraints, *packages], cwd=home)
    listed = json.loads(run([*pip, "list", "--format", "json"], cwd=home))
    installed = {package["name"].lower(): package["version"] for package in listed}
    assert "kernels" in installed, f"the latest transformers did not pull `kernels`: {installed}"
    return home / "venv"


def kernel_sources(venv: Path, cwd: Path) -> list[Path]:
    """The C++ files the installed tgq builds its kernels from (`cpu_ops._SOURCES`), each an
    existing file of the installed package."""
    listed = json.loads(run([venv / "bin" / "python", "-c", KERNEL_SOURCES], cwd=cwd))
    sources = [Path(path) for path in listed]
    site_packages = next((venv / "lib").glob("python3*/site-packages"))
    assert sources and all(p.is_file() and p.is_relative_to(site_packages) for p in sources)
    return sources


def _which_kernels(venv: Path, cwd: Path) -> dict[str, object]:
    found: dict[str, object] = json.loads(
        run([venv / "bin" / "python", "-c", WHICH_KERNELS], cwd=cwd)
    )
    return found


def assert_kernels_is_hugging_faces(venv: Path, cwd: Path) -> dict[str, object]:
    found = _which_kernels(venv, cwd)
    site_packages = next((venv / "lib").glob("python3*/site-packages"))
    assert Path(str(found["kernels"])).is_relative_to(site_packages / "kernels"), found
    assert found["kernels_from"] == ["kernels"], found  # no module of tgq's is named `kernels`
    assert found["has_get_kernel"] is True, found
    return found


@contextlib.contextmanager
def serving(venv: Path, model_dir: Path, workdir: Path, **extra_env: str) -> Iterator[str]:
    """`tgq serve` of `venv`, run in `workdir` on a fresh database and a Redis prefix of its own;
    stopped (and its database dropped, its Redis keys deleted) whatever happens."""
    database_url, prefix, port = create_database(), f"test-install-{uuid.uuid4().hex}", free_port()
    env = child_env(
        **extra_env,
        DATABASE_URL=database_url, REDIS_URL=REDIS_URL, REDIS_PREFIX=prefix, PORT=str(port),
        HOSTNAME="127.0.0.1", MODEL_DIR=str(model_dir), MAX_TOTAL_TOKENS="1024",
        NUM_BLOCKS="512", DRAIN_TIMEOUT_S="5",
    )  # fmt: skip
    log_path = workdir / "serve.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [venv / "bin" / "tgq", "serve"], cwd=workdir, env=env, stdout=log, stderr=log,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, log_path, HEALTHY_TIMEOUT_S)
        yield url
    except BaseException as error:
        raise AssertionError(f"{error}\n--- tgq serve's log:\n{_tail(log_path)}") from error
    finally:
        _stop(process)
        _forget(database_url, prefix)


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-6000:] if path.exists() else "(no log)"


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the supervisor stops its children), then SIGKILL to the whole session."""
    if process.poll() is None:
        process.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(STOP_TIMEOUT_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # children the supervisor left behind, if any
    process.wait()


def _forget(database_url: str, prefix: str) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*"))
        if keys:
            client.delete(*keys)
    finally:
        client.close()
        drop_database(database_url)


def complete_requests(url: str) -> None:
    generated = httpx.post(
        f"{url}/generate",
        json={"inputs": "Hello", "parameters": {"max_new_tokens": 4, "details": True}},
        timeout=REQUEST_TIMEOUT_S,
    )
    assert generated.status_code == 200, generated.text
    assert generated.json()["details"]["generated_tokens"] == 4
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "tgq", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
        timeout=REQUEST_TIMEOUT_S,
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] == 3
