"""Generate an argparse CLI from a frozen config dataclass, so flags and config never drift.

Each field becomes `--field-name`; its help text comes from `field(metadata={"help": ...})`,
booleans get `--flag/--no-flag`, `Literal[...]` types become choices.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(annotation: Any) -> tuple[Any, tuple | None]:
    """(python type, choices) for a field annotation such as `int | None` or `Literal[...]`."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        choices = typing.get_args(annotation)
        return type(choices[0]), choices
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0])
    return annotation, None


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name in skip or not field.init:
            continue
        kind, choices = _base_type(hints[field.name])
        default = field.default if field.default is not dataclasses.MISSING else None
        help_text = field.metadata.get("help", "")
        if kind is bool:
            parser.add_argument(
                _flag(field.name),
                dest=field.name,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=help_text,
            )
            continue
        parser.add_argument(
            _flag(field.name),
            dest=field.name,
            type=kind,
            choices=choices,
            default=default,
            metavar=None if choices else field.name.upper(),
            help=f"{help_text} (default: {default})" if help_text else None,
        )


def dataclass_from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    return cls(**values)
