"""The README documents what the code has: every option of the configuration model is in its
configuration tables with the flag, variable and default that `tgq COMMAND --help` shows, nothing
else is, and every `tgq` command is in its command table."""

from __future__ import annotations

import re
from pathlib import Path

from tgq.api.settings import Settings
from tgq.batcher.flags import ALIASES, flag_of, shown_default
from tgq.cli.main import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"
_ROW = re.compile(r"^\| `(--[a-z0-9-]+)` \| `([A-Z0-9_]+)` \| (.+?) \| (.+) \|$", re.MULTILINE)
SERVICE_COMMANDS = ("serve", "api", "batcher", "worker", "beat")


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


def _table_rows() -> dict[str, tuple[str, str]]:
    """The configuration tables' rows: flag -> (variable, default as written)."""
    rows = _ROW.findall(_section("Configuration"))
    return {flag: (env, default) for flag, env, default, _ in rows}


def _command_flags(command: str) -> set[str]:
    """The long flags `tgq COMMAND --help` lists (older aliases apart)."""
    actions = build_parser()._subparsers._group_actions  # type: ignore[union-attr]
    parser = actions[0].choices[command]  # type: ignore[index]
    aliases = {alias for names in ALIASES.values() for alias in names}
    flags = {name for action in parser._actions for name in action.option_strings}
    return {flag for flag in flags if flag.startswith("--") and flag != "--help"} - aliases


def test_the_configuration_tables_are_the_commands_flags() -> None:
    documented = set(_table_rows())
    every_flag = set().union(*(_command_flags(command) for command in SERVICE_COMMANDS))
    assert sorted(every_flag - documented) == [], "flags missing from the README's tables"
    assert sorted(documented - every_flag) == [], "flags in the README that no command takes"


def test_the_configuration_tables_show_each_variable_and_default() -> None:
    rows = _table_rows()
    for name, field in Settings.model_fields.items():
        no_default = "\N{EN DASH}"
        shown = no_default if field.default is None else f"`{shown_default(field.default)}`"
        assert rows[flag_of(name, field)] == (name.upper(), shown), name
