"""argparse types for the project's enums: a flag is parsed into its typed value where it is read.

argparse turns a ``type`` callable's ``ValueError`` into "invalid parse value: 'x'"; only an
``ArgumentTypeError`` keeps its text. ``parsed_by`` wraps an enum's ``parse`` so that the
message the enum writes (what was wrong, and the choices) is the one the user reads.
"""

from __future__ import annotations

import argparse
from enum import Enum
from typing import Callable, TypeVar

T = TypeVar("T")


def parsed_by(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse ``type`` that calls ``parse`` and keeps its one-line error."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def names(enum: type[Enum]) -> list[str]:
    """The values of ``enum``, for ``choices=`` (the help shows ``{a,b}``; a parsed member is
    equal to its value, so argparse's check of the choices still holds)."""
    return [m.value for m in enum]
