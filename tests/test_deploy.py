"""The deployment files (docker-compose.yml, docker/) against the code they start: commands
name modules that exist, environment variables are settings the code reads, Prometheus scrapes
the api's port, and the Grafana dashboard queries metrics the api exports. No Docker needed;
`docker-compose config` runs when the binary is installed (Debian: `apt-get install
docker-compose`)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tgq.api.settings import Settings
from tgq.batcher.__main__ import parse_args
from tgq.batcher.options import BatcherOptions
from tgq.kernels import block_size_rule, resolve_block_size

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "tgq.json"
TGQ_SERVICES = ("migrate", "api", "batcher", "worker", "beat")
# Read by code outside Settings: the hub cache (huggingface_hub) and hub offline mode.
OTHER_ENV = frozenset({"HF_HOME", "HF_HUB_OFFLINE"})
_INTERPOLATION = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")
_METRIC = re.compile(r"\b(tg[iq]_\w+)")
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def load_compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def interpolate(value: str) -> str:
    """Compose's `${NAME:-default}` with every variable unset: the defaults."""
    return _INTERPOLATION.sub(lambda match: match.group(2) or "", value)


def command_of(service: dict[str, Any]) -> list[str]:
    command = service["command"]
    words = command.split() if isinstance(command, str) else command
    return [interpolate(str(word)) for word in words]


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    result: dict[str, Any] = load_compose()["services"]
    return result


def test_compose_has_the_stack(services: dict[str, Any]) -> None:
    expected = {*TGQ_SERVICES, "postgres", "redis", "prometheus", "grafana"}
    assert set(services) == expected


@pytest.mark.parametrize("name", TGQ_SERVICES)
def test_command_module_exists(services: dict[str, Any], name: str) -> None:
    command = command_of(services[name])
    if command[0] == "celery":
        module = command[command.index("-A") + 1]
    else:
        assert command[:2] == ["python", "-m"], command
        module = command[2]
    assert importlib.util.find_spec(module) is not None, module


def compose_batcher_options(
    services: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> BatcherOptions:
    """The compose batcher's effective options: its command's flags over its environment."""
    batcher = services["batcher"]
    for name in Settings.model_fields:  # nothing from the test's own environment
        monkeypatch.delenv(name.upper(), raising=False)
    for name, value in batcher["environment"].items():
        monkeypatch.setenv(name, interpolate(str(value)))
    return parse_args(command_of(batcher)[3:])


def test_batcher_options_resolve(services: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    options = compose_batcher_options(services, monkeypatch)
    assert options.device == "cuda"
    assert options.redis_url == "redis://redis:6379/0"
    assert options.redis_prefix == services["api"]["environment"]["REDIS_PREFIX"]
    assert options.model_path == "/models/model"
    assert options.num_shard == 1


def test_gpu_batcher_passes_the_flash_backends_checks(
    services: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU image runs flash-attn: the block size the compose batcher ends up with must be
    one flash reads (a multiple of 256), and its dtype one flash computes in (not fp32)."""
    options = compose_batcher_options(services, monkeypatch)
    assert not options.disable_custom_kernels
    block_size = resolve_block_size("flash", options.device, options.block_size)
    assert block_size_rule("flash").check("flash", block_size) == block_size
    assert block_size % 256 == 0
    assert options.dtype != "float32"


def test_the_old_block_size_is_refused_by_flash() -> None:
    """What the compose batcher had before (16): the check above is not vacuous."""
    with pytest.raises(ValueError, match="256"):
        resolve_block_size("flash", "cuda", 16)


@pytest.mark.parametrize("name", TGQ_SERVICES)
def test_environment_names_are_settings(services: dict[str, Any], name: str) -> None:
    known = {field.upper() for field in Settings.model_fields} | OTHER_ENV
    environment = services[name].get("environment", {})
    assert isinstance(environment, dict), "environment as a mapping"
    assert set(environment) - known == set()


def test_api_and_workers_share_the_files_volume(services: dict[str, Any]) -> None:
    for name in ("api", "worker"):  # beat only schedules; the worker runs the tasks
        environment = services[name]["environment"]
        mount = f"files:{environment['FILE_STORAGE_DIR']}"
        assert mount in services[name]["volumes"], name


@pytest.mark.parametrize("name", ("api", "batcher", "worker", "beat"))
def test_services_reading_the_model_mount_it(services: dict[str, Any], name: str) -> None:
    """The tokenizer, the weights and the token limits' defaults come from MODEL_DIR."""
    model_dir = interpolate(services[name]["environment"]["MODEL_DIR"])
    mounts = [interpolate(str(volume)) for volume in services[name]["volumes"]]
    assert any(model_dir.startswith(mount.split(":")[1]) for mount in mounts), mounts


def test_settings_from_compose_validate(services: dict[str, Any]) -> None:
    for name in ("migrate", "api", "worker", "beat"):
        environment = services[name]["environment"]
        values = {key.lower(): interpolate(str(value)) for key, value in environment.items()}
        Settings.model_validate(values)


@pytest.mark.parametrize("name", TGQ_SERVICES)
def test_build_dockerfile_exists(services: dict[str, Any], name: str) -> None:
    build = services[name]["build"]
    context = ROOT / build["context"]
    assert (context / build["dockerfile"]).is_file()


def test_prometheus_scrapes_the_api_port(services: dict[str, Any]) -> None:
    port = int(services["api"]["environment"]["PORT"])
    assert port == Settings.model_fields["port"].default
    assert f"{port}:{port}" in services["api"]["ports"]
    config = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == [f"api:{port}"]


def dashboard_metrics() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    names = {name for expr in exprs for name in _METRIC.findall(expr)}
    return {_family(name) for name in names}


def _family(name: str) -> str:
    for suffix in _HISTOGRAM_SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def test_dashboard_queries_only_exported_metrics() -> None:
    source = (ROOT / "api" / "metrics.py").read_text()
    exported = set(re.findall(r'"(tg[iq]_\w+)"', source))
    assert dashboard_metrics() - exported == set()


def test_grafana_provisioning_points_at_the_dashboards(services: dict[str, Any]) -> None:
    provider = yaml.safe_load(
        (ROOT / "docker" / "grafana" / "provisioning" / "dashboards" / "tgq.yml").read_text()
    )
    path = provider["providers"][0]["options"]["path"]
    assert f"./docker/grafana/dashboards:{path}:ro" in services["grafana"]["volumes"]


@pytest.mark.skipif(
    shutil.which("docker-compose") is None,
    reason="docker-compose not installed (Debian: apt-get install docker-compose)",
)
def test_docker_compose_config_validates() -> None:
    result = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE), "config", "--quiet"],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
