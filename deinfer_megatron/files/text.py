"""Reading text a user hands the project (prompts, calibration and evaluation corpora).

A tokenizer accepts any bytes decoded with replacement characters, so a binary file or a
file in the wrong encoding would silently become garbage tokens: this reads UTF-8 strictly and
names the file and the offending byte offset when it is not text.
"""

from __future__ import annotations

from pathlib import Path


def read_text(path: Path, what: str, *, max_chars: int | None = None) -> str:
    """The UTF-8 text of ``path`` (at most ``max_chars`` characters).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: it is a folder, holds NUL bytes (binary), or is not valid UTF-8.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} {path} does not exist")
    if not path.is_file():
        raise ValueError(f"{what} {path} is not a file")
    limit = -1 if max_chars is None else 4 * max_chars + 4
    with open(path, "rb") as f:
        raw = f.read(limit)
    if b"\x00" in raw:
        raise ValueError(f"{what} {path} is a binary file, not text; give a UTF-8 text file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        if max_chars is not None and err.start >= len(raw) - 4:  # a character cut by the limit
            text = raw[: err.start].decode("utf-8")
        else:
            raise ValueError(f"{what} {path} is not UTF-8 text (invalid byte at offset {err.start}); "
                             "convert it to UTF-8") from None
    return text if max_chars is None else text[:max_chars]
