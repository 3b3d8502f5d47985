"""The library versions a shim was written against, checked before it is applied.

A shim replaces named upstream functions; in another release they may have moved, changed or
stopped needing it, and a stale shim fails far from its cause. So applying one first checks
the installed distribution against the version its code was read from.
"""

from __future__ import annotations

from importlib import metadata


def require_version(distribution: str, pinned: str) -> None:
    """Raise unless ``distribution`` is installed at exactly ``pinned``.

    Raises:
        RuntimeError: one line naming the version found and the fix.
    """
    try:
        found = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        found = None
    if found != pinned:
        have = f"{distribution} {found} is installed" if found else f"{distribution} is not installed"
        raise RuntimeError(
            f"the CPU shims are written for {distribution} {pinned}, but {have}; "
            f"install the pinned version with `make install` (or pip install {distribution}=={pinned})"
        )
