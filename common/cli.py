"""Generate an argparse CLI from a frozen config dataclass, so flags and config never drift.

Each field becomes `--field-name` (or the `flag` given to `option`); its help text comes from
`option(default, help)`, booleans get `--flag/--no-flag`, `Literal[...]` types become choices, and
a `parse` function turns the flag's text into the field's value (tuples, units). Nothing here
imports TensorFlow, so `--help` stays instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def option(
    default: Any,
    help: str,  # noqa: A002 - the argparse word
    *,
    flag: str | None = None,
    parse: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    hidden: bool = False,
    shown_default: str | None = None,
    group: str | None = None,
) -> Any:
    """A dataclass field with its command-line description.

    flag: the option name when it differs from `--field-name` (e.g. `--request-timeout` for
    `request_timeout_s`); parse: converts the option's text (raise ValueError with a message);
    hidden: left out of `--help` (test hooks); shown_default: the default as the flag spells it,
    when `parse` converts units; group: a `--help` section that begins at this field (it holds the
    fields that follow, up to the next one with a group), so a long flag list reads in parts.
    """
    metadata = {"help": help, "flag": flag, "parse": parse, "metavar": metavar, "hidden": hidden,
                "shown_default": shown_default, "group": group}
    if isinstance(default, (list, dict, set)):
        raise TypeError("mutable defaults: use a tuple")
    return dataclasses.field(default=default, metadata=metadata)


def flag_of(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


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


def _converter(parse: Callable[[str], Any], flag: str) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = flag  # argparse names the converter in "invalid ... value" messages
    return convert


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    hints = typing.get_type_hints(cls)
    target = parser
    for field in dataclasses.fields(cls):
        if field.metadata.get("group"):
            target = parser.add_argument_group(field.metadata["group"])
        if field.name in skip or not field.init:
            continue
        kind, choices = _base_type(hints[field.name])
        default = field.default if field.default is not dataclasses.MISSING else None
        help_text = field.metadata.get("help", "")
        flag = flag_of(field)
        if field.metadata.get("hidden"):
            help_text = argparse.SUPPRESS
        if kind is bool:
            target.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
            continue
        parse = field.metadata.get("parse")
        shown = field.metadata.get("shown_default") or default
        if isinstance(shown, tuple):
            shown = ",".join(str(v) for v in shown) or "none"
        if help_text and help_text is not argparse.SUPPRESS and shown != "":
            help_text = f"{help_text} (default: {shown})"
        target.add_argument(
            flag,
            dest=field.name,
            type=_converter(parse, flag) if parse else kind,
            choices=None if parse else choices,
            default=default,
            metavar=field.metadata.get("metavar") or (None if choices and not parse else field.name.upper()),
            help=help_text or None,
        )


def examples(*pairs: tuple[str, str]) -> dict[str, Any]:
    """`argparse.ArgumentParser` keywords for an epilog of (command, what it does) examples, printed
    as written after the options."""
    lines = [f"  {what}:\n    {command}" for command, what in pairs]
    return {"epilog": "examples:\n" + "\n".join(lines), "formatter_class": argparse.RawDescriptionHelpFormatter}


def dataclass_from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    return cls(**values)
