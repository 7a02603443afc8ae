"""Model version names, read the way TF Serving reads them: ASCII digits of a number that fits in
int64. `str.isdigit()` is not that test: it accepts `²` (which `int()` rejects) and `١٢` (which
`int()` reads as 12), and an unbounded number breaks every protocol that carries an int64."""

from __future__ import annotations

import re

MAX_VERSION = 2**63 - 1
_ASCII_DIGITS = re.compile(r"[0-9]+")


def version_number(name: str) -> int | None:
    """The version a directory name or URL segment stands for, or None if it is not one."""
    if not _ASCII_DIGITS.fullmatch(name):
        return None
    number = int(name)
    return number if number <= MAX_VERSION else None
