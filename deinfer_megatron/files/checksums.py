"""SHA-256 of files, as recorded in and checked against the project's manifests."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256(path: Path) -> str:
    """Hex SHA-256 of ``path``, read in 4 MiB blocks (never the whole file at once)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()
