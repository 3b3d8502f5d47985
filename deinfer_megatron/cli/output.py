"""What a command prints on stdout when it was asked for JSON: the document, and nothing else.

Libraries print where they like — DeepSpeed's logger writes to stdout, and so do ranks and
launchers started below this process. With ``--json`` the command's file descriptor 1 is
pointed at stderr for the whole run (children inherit that), and the document goes to the
original stdout through ``emit_json``, so ``… --json | python -c 'json.load(sys.stdin)'`` holds
whatever launches the ranks.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import sys
from typing import Any, Iterator, TextIO

_DOCUMENT_STREAM: contextvars.ContextVar[TextIO | None] = contextvars.ContextVar(
    "deinfer_json_stdout", default=None)


@contextlib.contextmanager
def stdout_reserved_for_json(enabled: bool) -> Iterator[None]:
    """While active (and ``enabled``), fd 1 is stderr and ``emit_json`` writes the real stdout.

    When ``sys.stdout`` is not file descriptor 1 (a caller captured it: tests, an embedding
    program), the document goes to that ``sys.stdout`` and no descriptor is touched.
    """
    try:
        on_fd1 = sys.stdout.fileno() == 1
    except (AttributeError, OSError, ValueError):
        on_fd1 = False
    if not enabled or not on_fd1:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    stream = os.fdopen(os.dup(saved), "w")
    token = _DOCUMENT_STREAM.set(stream)
    try:
        yield
    finally:
        _DOCUMENT_STREAM.reset(token)
        sys.stdout.flush()
        stream.close()
        os.dup2(saved, 1)
        os.close(saved)


def emit_json(doc: Any, *, indent: int | None = None) -> None:
    """Write ``doc`` as one JSON document to the command's real stdout."""
    stream = _DOCUMENT_STREAM.get() or sys.stdout
    stream.write(json.dumps(doc, indent=indent) + "\n")
    stream.flush()
