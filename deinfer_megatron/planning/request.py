"""What a user asks for with ``--layout``: one fixed layout for every block, or ``auto``.

A request is parsed once, where it enters (a command's flag, or a job built in Python), and is
resolved once into the ``LayoutPlan`` the model is built from (``planning.auto.resolve_layout``).
This module is the only one that knows the name ``auto``; below ``planning`` a layout is a
``Layout`` or a ``LayoutPlan``, never a string.
"""

from __future__ import annotations

from dataclasses import dataclass

from deinfer_megatron.specs.layout import Layout

AUTO = "auto"


@dataclass(frozen=True)
class LayoutRequest:
    """A fixed layout (``fixed``), or ``auto`` (``fixed`` is None): the cost model's choice per
    attention and MLP block, priced for the job's batch and context on this host."""

    fixed: Layout | None = None

    @classmethod
    def parse(cls, value: "str | Layout | LayoutRequest") -> "LayoutRequest":
        """``auto``, a layout's name or member, or a request (returned as it is)."""
        if isinstance(value, LayoutRequest):
            return value
        if isinstance(value, Layout):
            return cls(value)
        if value == AUTO:
            return cls(None)
        try:
            return cls(Layout(value))
        except ValueError:
            raise ValueError(f"unknown layout {value!r}; choose one of {', '.join(choices())}") from None

    @classmethod
    def auto(cls) -> "LayoutRequest":
        return cls(None)

    @property
    def is_auto(self) -> bool:
        return self.fixed is None

    @property
    def name(self) -> str:
        """How the request is shown and reported: ``auto`` or the fixed layout's name."""
        return AUTO if self.fixed is None else self.fixed.value

    def __str__(self) -> str:
        return self.name


def choices() -> list[str]:
    """The ``--layout`` values of the inference commands: ``auto`` and every fixed layout."""
    return [AUTO] + [layout.value for layout in Layout]


INFERENCE_DEFAULT = LayoutRequest.auto()  # generate, eval-ppl and bench price each job's own batch and context
