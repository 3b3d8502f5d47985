"""Multiple-choice items for zero-shot evaluation (``eval-choice``): the file format, read
strictly, and the item set the project ships.

An items file is JSON lines, one item per line (blank lines are skipped)::

    {"context": "She was very", "choices": ["happy.", "table."], "answer": 0, "category": "novel-word"}

- ``context``: a non-empty string, the text the choices continue;
- ``choices``: at least two distinct non-empty strings; each is scored as the continuation
  ``" " + choice`` of the context (lm-evaluation-harness's default target delimiter);
- ``answer``: the index of the right choice;
- ``category``: optional, a non-empty string the accuracy is also reported by (default ``items``);
- ``id``, ``source``: optional notes the scorer ignores (the shipped set names each item's origin).

Any other key is refused, so that a misspelt ``answer`` cannot silently become a default. Each
bad line is one ``ValueError`` naming the file, the line and the fix.

``SHIPPED_ITEMS`` is the set made by ``scripts/make_choice_items.py`` from public-domain and
Python-documentation text (docs/EVALUATION.md says how); it installs with the package.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deinfer_megatron.files.text import read_text

SHIPPED_ITEMS = Path(__file__).resolve().parent / "items" / "zero_shot.jsonl"
DEFAULT_CATEGORY = "items"
DELIMITER = " "  # between a context and each choice, as lm-evaluation-harness's target_delimiter
_REQUIRED = ("context", "choices", "answer")
_OPTIONAL = ("category", "id", "source")


@dataclass(frozen=True)
class Item:
    """One multiple-choice item; ``line`` is its 1-based line in the file (for messages)."""

    line: int
    context: str
    choices: tuple[str, ...]
    answer: int
    category: str = DEFAULT_CATEGORY

    def continuation(self, choice: int) -> str:
        """The text scored after the context for choice ``choice``."""
        return DELIMITER + self.choices[choice]


def read_items(path: Path) -> list[Item]:
    """Every item of the JSON-lines file ``path``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: it is not UTF-8 text, holds no item, or a line is not a well-formed item
            (the message names the line).
    """
    path = Path(path)
    text = read_text(path, "items file")
    items = [parse_item(raw, path, number)
             for number, raw in enumerate(text.splitlines(), start=1) if raw.strip()]
    if not items:
        raise ValueError(f"items file {path} holds no items; write one JSON object per line "
                         '({"context": ..., "choices": [...], "answer": N})')
    return items


def parse_item(raw: str, path: Path, number: int) -> Item:
    """The item on line ``number`` of ``path`` (its text ``raw``); ValueError naming the line."""
    where = f"{path}:{number}"
    try:
        obj: Any = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not JSON ({err.msg} at column {err.colno}); "
                         "write one JSON object per line") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: an item must be a JSON object, got {type(obj).__name__}")
    missing = [k for k in _REQUIRED if k not in obj]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(repr(k) for k in missing)}; an item needs "
                         '"context", "choices" and "answer"')
    unknown = sorted(set(obj) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; the keys are "
                         + ", ".join(repr(k) for k in _REQUIRED + _OPTIONAL))
    context, choices, answer = obj["context"], obj["choices"], obj["answer"]
    if not isinstance(context, str) or not context.strip():
        raise ValueError(f'{where}: "context" must be a non-empty string')
    if not isinstance(choices, list) or len(choices) < 2:
        raise ValueError(f'{where}: "choices" must be a list of at least 2 strings')
    for k, choice in enumerate(choices):
        if not isinstance(choice, str) or not choice.strip():
            raise ValueError(f'{where}: choice {k} must be a non-empty string')
    if len(set(choices)) != len(choices):
        raise ValueError(f'{where}: "choices" holds the same text twice; every choice must differ')
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
        raise ValueError(f'{where}: "answer" must be the index of a choice, 0..{len(choices) - 1}, '
                         f"got {answer!r}")
    category = obj.get("category", DEFAULT_CATEGORY)
    if not isinstance(category, str) or not category.strip():
        raise ValueError(f'{where}: "category" must be a non-empty string')
    return Item(number, context, tuple(choices), answer, category)
