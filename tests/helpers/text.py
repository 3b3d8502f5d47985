"""Real English text for calibration and perplexity tests, from what every Python install has.

The tests must pass on a user's clone, so they cannot rely on files beside the repository.
The Python standard library carries about 460k characters of English prose: the
documentation topics behind ``help()`` (``pydoc_data.topics``). They are real text written by
people — the statistics a decomposition's calibration and a perplexity measure depend on —
unlike random tokens or text a tiny random model writes.

The topics are split into two disjoint halves (alternating in sorted order, so both mix prose
and code examples the same way): ``"calibration"`` and ``"evaluation"``. A method calibrated on
one half is measured on the other, as with two different novels.

``../shared/data/text`` (the Austen novels and the Jargon File, present only in the
project's own workspace) is an optional extra: :func:`shared_text` returns ``None`` where it
is absent, and no test may depend on it.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

PARTS = ("calibration", "evaluation")
SHARED_TEXT = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "text"


@cache
def _halves() -> dict[str, str]:
    from pydoc_data.topics import topics

    keys = sorted(topics)
    return {part: "\n\n".join(topics[k].strip() for k in keys[i::2]) for i, part in enumerate(PARTS)}


def real_text(n_chars: int, part: str) -> str:
    """The first ``n_chars`` characters of one half of the standard library's documentation.

    Args:
        n_chars: how many characters (each half has about 230k).
        part: ``"calibration"`` or ``"evaluation"``; the two never share a topic.
    """
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    text = _halves()[part]
    if n_chars > len(text):
        raise ValueError(f"the {part} half has only {len(text)} characters, {n_chars} asked for")
    return text[:n_chars]


def real_text_file(directory: Path, n_chars: int, part: str) -> Path:
    """:func:`real_text` written to ``directory/<part>.txt`` (the jobs read text from files)."""
    path = Path(directory) / f"{part}.txt"
    path.write_text(real_text(n_chars, part), encoding="utf-8")
    return path


def shared_text(relative: str) -> str | None:
    """A file of ``../shared/data/text`` (e.g. ``"austen/emma.txt"``), or ``None`` if absent."""
    path = SHARED_TEXT / relative
    return path.read_text(encoding="utf-8") if path.is_file() else None
