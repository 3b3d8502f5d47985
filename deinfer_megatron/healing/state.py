"""A heal run's resumable state, kept beside ``--out`` until the healed folder is published.

``.<out name>.heal-state/`` holds ``job.json`` (the settings that must not change on a
resume), ``data.pt`` (the pooled token windows, so a resume never re-samples the teacher) and
``state.pt`` (step, trainable weights, AdamW moments, the log so far). Each file is written to
a temporary name and renamed over the old one, so a kill at any moment leaves the previous
complete checkpoint. The folder is removed once the healed model is published.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from deinfer_megatron.files import failpoints


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


def check_same_job(folder: Path, settings: dict[str, Any]) -> None:
    """A resume must continue the same run: name the first setting that changed."""
    saved = json.loads((folder / "job.json").read_text())
    for key, value in settings.items():
        if saved.get(key) != value:
            raise ValueError(f"--resume with a different {key} ({value!r}; the killed run used "
                             f"{saved.get(key)!r}); give the same settings, or remove {folder} to start over")


def save_checkpoint(folder: Path, step: int, params: dict[str, torch.Tensor], optim: Any,
                    records: list[dict[str, Any]], elapsed: float) -> None:
    save_torch(folder / "state.pt", {"step": step, "params": params, "optim": optim,
                                     "records": records, "elapsed": elapsed})
    failpoints.point("heal.after-checkpoint")


def remove(folder: Path) -> None:
    """Remove a state folder this command made (only after the healed model is published)."""
    shutil.rmtree(folder, ignore_errors=True)
