"""argparse types for the project's enums: a flag is parsed into its typed value where it is read.

argparse turns a ``type`` callable's ``ValueError`` into "invalid parse value: 'x'"; only an
``ArgumentTypeError`` keeps its text. ``parsed_by`` wraps an enum's ``parse`` so that the
message the enum writes (what was wrong, and the choices) is the one the user reads.

``add_inference_layout`` is the one ``--layout`` of the inference commands (``generate``,
``eval-ppl``), so that their default and its help are written once.
"""

from __future__ import annotations

import argparse
from enum import Enum
from typing import Callable, TypeVar

from deinfer_megatron.planning.request import INFERENCE_DEFAULT, LayoutRequest, choices

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


def add_inference_layout(parser: argparse.ArgumentParser) -> None:
    """``--layout`` of ``generate`` and ``eval-ppl``: ``auto`` or a fixed layout, parsed into a
    ``LayoutRequest``, default ``planning.request.INFERENCE_DEFAULT``."""
    parser.add_argument(
        "--layout", type=parsed_by(LayoutRequest.parse), metavar="{" + ",".join(choices()) + "}",
        default=INFERENCE_DEFAULT,
        help="auto: the fastest layout per attention and MLP block by this host's cost model (measured "
             "once on first use, tens of seconds, then cached; docs/INFERENCE.md); deinfer, naive or "
             "dense: that layout for every block (default: %(default)s)")
