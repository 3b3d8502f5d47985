"""The manifest a folder the project writes carries (``deinfer_manifest.json``): its format, what
made it, and the SHA-256 of every file, written last. Decomposed folders (``checkpoints.folder``)
and Megatron checkpoints (``checkpoints.dist_checkpoint``) are vouched for and verified the same
way: nothing a manifest does not list is loaded as verified."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from deinfer_megatron.files.checksums import sha256

MANIFEST = "deinfer_manifest.json"
RANK_CONFIG = "rank_config.json"


def folder_files(root: Path) -> dict[str, str]:
    """Relative path → SHA-256 of every file under ``root`` except the manifest."""
    return {p.relative_to(root).as_posix(): sha256(p) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != MANIFEST}


def verify_manifest(path: Path, manifest: Mapping[str, Any], required: Sequence[str] = (),
                    only: Sequence[str] | None = None) -> None:
    """Check every file's SHA-256 against the manifest (``only`` those named, when given);
    name the first that differs.

    ``required`` files must be listed: a manifest that vouches for nothing verifies nothing.
    """
    files = manifest.get("files")
    if not isinstance(files, Mapping) or not files:
        raise ValueError(f"{path / MANIFEST} lists no files, so nothing in {path} is verified; "
                         "re-create the folder (or pass --no-verify for a folder made elsewhere)")
    unlisted = [name for name in required if name not in files]
    if unlisted:
        raise ValueError(f"{path / MANIFEST} does not list {unlisted[0]}; re-create the folder "
                         "(or pass --no-verify for a folder made elsewhere)")
    for name, expected in files.items():
        if only is not None and name not in only:
            continue
        f = path / name
        if not f.is_file():
            raise ValueError(f"{f} is listed in {MANIFEST} but missing; the folder is incomplete")
        if sha256(f) != expected:
            raise ValueError(f"{f} is corrupted (SHA-256 differs from {MANIFEST}); re-create the folder")
