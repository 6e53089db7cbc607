"""What listens, with the default settings: on the real stack (the api and batcher processes and
every process they started), the api's port is the only listening socket, and it is on the
loopback address. The compose file publishes the api's port on every address of the host and
any other service's (Prometheus, Grafana) on the loopback address only.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import yaml  # type: ignore[import-untyped]

from tests.api.stack import ROOT, Stack
from tgq.api.settings import Settings

LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


def listening_sockets() -> dict[str, tuple[str, int]]:
    """inode -> (address, port) of every listening TCP socket (IPv4 and IPv6)."""
    sockets = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != LISTEN:
                continue
            address_hex, port_hex = fields[1].split(":")
            raw = bytes.fromhex(address_hex)
            # The kernel writes each 32-bit word in host (little-endian) order.
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            sockets[fields[9]] = (str(ipaddress.ip_address(words)), int(port_hex, 16))
    return sockets


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it."""
    pids, index = [pid], 0
    while index < len(pids):
        for task in Path(f"/proc/{pids[index]}/task").iterdir():
            pids += [int(child) for child in (task / "children").read_text().split()]
        index += 1
    return pids


def listeners_of(pid: int) -> set[tuple[str, int]]:
    sockets = listening_sockets()
    found = set()
    for tree_pid in process_tree(pid):
        for fd in Path(f"/proc/{tree_pid}/fd").iterdir():
            target = os.readlink(fd) if fd.is_symlink() else ""
            inode = target.removeprefix("socket:[").removesuffix("]")
            if target.startswith("socket:") and inode in sockets:
                found.add(sockets[inode])
    return found


def test_only_the_api_listens_and_on_loopback(stack: Stack) -> None:
    assert stack.api is not None
    assert Settings.model_fields["hostname"].default == "127.0.0.1"
    assert listeners_of(stack.api.pid) == {("127.0.0.1", stack.port)}
    for batcher in stack.batchers:
        assert listeners_of(batcher.pid) == set()


def test_compose_publishes_only_the_api() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    ports = {name: service.get("ports", []) for name, service in services.items()}
    assert ports["api"] == ["3000:3000"]
    others = [port for name, published in ports.items() if name != "api" for port in published]
    assert all(port.startswith("127.0.0.1:") for port in others), others
    hostnames = {name for name, s in services.items() if "HOSTNAME" in s.get("environment", {})}
    assert hostnames == {"api"}
