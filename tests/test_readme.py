"""The README documents what the code has: every api setting is in its configuration table, and
every `tgq` command in its command table."""

from __future__ import annotations

import re
from pathlib import Path

from tgq.api.settings import Settings
from tgq.cli.main import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"


def _section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_every_setting_is_in_the_configuration_table() -> None:
    table = _section("Configuration")
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", table))
    missing = sorted({name.upper() for name in Settings.model_fields} - documented)
    assert not missing, f"settings missing from the README's configuration table: {missing}"


def test_every_command_is_in_the_command_table() -> None:
    table = _section("The `tgq` command")
    actions = build_parser()._subparsers._group_actions  # type: ignore[union-attr]
    commands = actions[0].choices
    assert isinstance(commands, dict)
    missing = sorted(name for name in commands if f"`tgq {name}" not in table)
    assert not missing, f"commands missing from the README's `tgq` table: {missing}"
