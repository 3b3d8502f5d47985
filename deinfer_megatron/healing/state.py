"""A heal run's resumable state, kept beside ``--out`` until the healed folder is published.

``.<out name>.heal-state/`` holds ``job.json`` (the settings that must not change on a
resume), ``data.pt`` (the pooled token windows, so a resume never re-samples the teacher), the
last complete checkpoint ``checkpoint/`` (the student's files, whatever they are, and
``meta.pt``) and, at the end, ``final/`` (the healed weights, read by the command's process).
Files are written to a temporary name and renamed; a checkpoint is staged whole in
``checkpoint.tmp/``, ``meta.pt`` last, and swapped in by two renames — so a kill at any moment
leaves the previous complete checkpoint (as ``checkpoint.old/`` between the two renames). The
folder is removed once the healed model is published.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from deinfer_megatron.files import failpoints

CHECKPOINT = "checkpoint"  # the last complete checkpoint, inside the state folder
FINAL = "final"  # the healed weights, written by the student, read by the command's process
STAGED = f"{CHECKPOINT}.tmp"  # a checkpoint being written
META = "meta.pt"  # a checkpoint's step, log so far, elapsed time and schedule length


def state_dir(out: Path) -> Path:
    return Path(out).with_name(f".{Path(out).name}.heal-state")


def _atomic(path: Path, write: Any) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_torch(path: Path, payload: Any) -> None:
    _atomic(path, lambda tmp: torch.save(payload, tmp))


def save_json(path: Path, payload: Any) -> None:
    _atomic(path, lambda tmp: tmp.write_text(json.dumps(payload, indent=1)))


def load_torch(path: Path) -> Any:
    if not path.is_file():
        raise ValueError(f"{path} is missing; the heal state is incomplete — remove "
                         f"{path.parent} and start again without --resume")
    return torch.load(path, weights_only=True)


def check_same_job(folder: Path, settings: dict[str, Any], defaults: dict[str, Any] | None = None) -> None:
    """A resume must continue the same run: name the first setting that changed. ``defaults``
    are the settings ``job.json`` leaves out at their default value (so that runs made before
    an option existed still resume): a missing one reads as its default on either side, and a
    run saved with another value is refused though this run's settings omit the key."""
    saved = json.loads((folder / "job.json").read_text())
    defaults = defaults or {}
    for key in [*settings, *(k for k in defaults if k not in settings)]:
        value, used = settings.get(key, defaults.get(key)), saved.get(key, defaults.get(key))
        if used != value:
            raise ValueError(f"--resume with a different {key} ({value!r}; the killed run used "
                             f"{used!r}); give the same settings, or remove {folder} to start over")


def checkpoint_dir(folder: Path) -> Path | None:
    """The complete checkpoint to resume from (``meta.pt`` present), or None."""
    for name in (CHECKPOINT, f"{CHECKPOINT}.old"):
        if (folder / name / META).is_file():
            return folder / name
    return None


def stage_checkpoint(folder: Path) -> None:
    """An empty ``checkpoint.tmp/`` to stage into (a half-staged one of a killed run removed)."""
    tmp = folder / STAGED
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)


def publish_checkpoint(folder: Path, meta: dict[str, Any]) -> None:
    """Write ``meta`` into the staged checkpoint (last: its presence means complete) and swap
    the staged folder in for the previous checkpoint."""
    tmp, current, old = folder / STAGED, folder / CHECKPOINT, folder / f"{CHECKPOINT}.old"
    torch.save(meta, tmp / META)
    shutil.rmtree(old, ignore_errors=True)
    if current.exists():
        current.rename(old)
    tmp.rename(current)
    shutil.rmtree(old, ignore_errors=True)
    failpoints.point("heal.after-checkpoint")


def remove(folder: Path) -> None:
    """Remove a state folder this command made (only after the healed model is published)."""
    shutil.rmtree(folder, ignore_errors=True)
