"""Command-line flags generated from a configuration model (`batcher.options`, `api.settings`).

A field `max_batch_size` is the flag `--max-batch-size` and the environment variable
`MAX_BATCH_SIZE`; a flag given beats its variable, which beats the field's default. A switch is
`--name` for a field that defaults to false and `--no-name` for one that defaults to true. The
help text is the field's description, its variable and its default: `COMMAND --help` is the
reference the README's tables are checked against.
"""

from __future__ import annotations

import argparse
import json
import types
from collections.abc import Iterator, Mapping
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

Model = TypeVar("Model", bound=BaseSettings)
DEST_PREFIX = "option_"  # apart from a root parser's own flags (`tgq --api-key` is the client's)
ALIASES = {"redis_prefix": ("--prefix",)}  # older spellings still taken


def flag_of(name: str, field: FieldInfo) -> str:
    """The flag that sets field `name`."""
    dashed = name.replace("_", "-")
    return f"--no-{dashed}" if field.default is True else f"--{dashed}"


def flags_of(model: type[BaseSettings]) -> dict[str, str]:
    """Every flag of `model`, by field name."""
    return {name: flag_of(name, field) for name, field in model.model_fields.items()}


def add_flags(parser: argparse.ArgumentParser, model: type[BaseSettings]) -> None:
    for name, field in model.model_fields.items():
        flags = (flag_of(name, field), *ALIASES.get(name, ()))
        env, dest = name.upper(), DEST_PREFIX + name
        shown = "" if field.default is None else f"; default {shown_default(field.default)}"
        described = f"{field.description} (env {env}{shown})".replace("%", "%%")
        if _annotation(field) is bool:
            parser.add_argument(
                *flags, dest=dest, action="store_const", const=not field.default, help=described
            )
        else:
            kind = _kind(field)
            metavar = "{" + ",".join(kind["choices"]) + "}" if "choices" in kind else env
            parser.add_argument(*flags, dest=dest, metavar=metavar, help=described, **kind)


def given(args: argparse.Namespace, model: type[BaseSettings]) -> dict[str, Any]:
    """The fields of `model` set on the command line."""
    values = {name: getattr(args, DEST_PREFIX + name, None) for name in model.model_fields}
    return {name: value for name, value in values.items() if value is not None}


def build(model: type[Model], values: Mapping[str, Any]) -> Model:
    """`model` from `values` over the environment; a bad value raises `ValueError`."""
    try:
        return model(**values)
    except ValidationError as error:
        raise ValueError(_message(error)) from None


def parse(model: type[Model], argv: list[str] | None, **parser_options: Any) -> Model:
    """A process's options: its flags over its environment (argparse's exit on bad ones)."""
    parser = argparse.ArgumentParser(**parser_options)
    add_flags(parser, model)
    args = parser.parse_args(argv)
    try:
        return build(model, given(args, model))
    except ValueError as error:
        parser.error(str(error))


def as_env(values: Mapping[str, Any]) -> dict[str, str]:
    """Fields as a child's environment variables (lists as JSON, as pydantic-settings reads)."""
    return {name.upper(): _env_value(value) for name, value in values.items()}


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return json.dumps(list(value))
    return str(value)


def _annotation(field: FieldInfo) -> Any:
    """The field's type without `| None`."""
    kinds = [kind for kind in _members(field.annotation) if kind is not type(None)]
    return kinds[0] if len(kinds) == 1 else field.annotation


def _members(annotation: Any) -> Iterator[Any]:
    if get_origin(annotation) in (Union, types.UnionType):
        yield from get_args(annotation)
    else:
        yield annotation


def _kind(field: FieldInfo) -> dict[str, Any]:
    annotation = _annotation(field)
    if get_origin(annotation) is Literal:
        return {"choices": get_args(annotation)}
    if get_origin(annotation) is tuple:
        return {"nargs": "+"}
    if annotation in (int, float):
        return {"type": annotation}
    return {}  # str, and what pydantic parses from text (ByteSize: "2GiB")


def shown_default(default: Any) -> str:
    """A default as `--help` and the README show it."""
    if isinstance(default, tuple):
        return " ".join(default) or "none"
    return str(default).lower() if isinstance(default, bool) else str(default)


def _message(error: ValidationError) -> str:
    """pydantic's errors as one line per field, named by flag."""
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"])
        named = f"--{where.replace('_', '-')}: " if where else ""
        lines.append(f"{named}{item['msg']}")
    return "; ".join(lines)
