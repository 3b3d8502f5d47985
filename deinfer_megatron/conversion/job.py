"""``deinfer-megatron convert``: a (decomposed or dense) model folder ↔ a Megatron ``torch_dist``
checkpoint, both ways, losslessly.

``--to megatron`` starts TP×PP ranks, each loads its stage from the folder and Megatron's
``dist_checkpointing.save`` writes the global tensors (``checkpoints.dist_checkpoint``); the
command then adds the config, the rank config, the tokenizer and the manifest. The TP/PP sizes
only choose how the writing is shared: the checkpoint loads at any size and layout.
``--to hf`` reads a checkpoint in this process and writes a model folder
(``folder.write_decomposed``). Neither direction computes anything — tensors are copied,
sliced and concatenated — so a round trip gives back the same bytes. Both write to a temporary
sibling renamed into place (``files.staging``), under the same ``--out`` rules as ``decompose``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from deinfer_megatron.arch.model import arch_from_hf_config
from deinfer_megatron.checkpoints.dist_checkpoint import (
    FORMAT,
    finish_folder,
    is_dist_checkpoint,
    iteration_dir,
    open_checkpoint,
    save_model_state,
)
from deinfer_megatron.checkpoints.folder import TOKENIZER_FILES, is_project_folder, open_model, write_decomposed
from deinfer_megatron.checkpoints.megatron_ckpt import detect_megatron_checkpoint, read_megatron_checkpoint
from deinfer_megatron.files.checksums import sha256
from deinfer_megatron.files.staging import claim_output, staged_folder
from deinfer_megatron.launch.run import run_on_ranks
from deinfer_megatron.models.build import load_folder
from deinfer_megatron.parallel.runtime import init_parallel, shutdown
from deinfer_megatron.parallel.topology import check_parallel_sizes
from deinfer_megatron.specs.layout import Layout
from deinfer_megatron.specs.rank_config import RankConfig

TARGETS = ("megatron", "hf")


@dataclass(frozen=True)
class ConvertJob:
    """What ``convert`` does: ``model`` (folder or checkpoint) → ``out`` in format ``to``."""

    model: Path
    to: str
    out: Path
    tp: int | None = None
    pp: int | None = None
    overwrite: bool = False
    verify: bool = True


def run_convert(job: ConvertJob) -> Path:
    """Convert as ``job`` says; return ``job.out``.

    Raises:
        ValueError: an unknown target, a source of the wrong kind for it, parallel sizes the
            model cannot be split into (or given with ``--to hf``), an ``--out`` that may not be
            written, or a source that fails verification.
    """
    if job.to not in TARGETS:
        raise ValueError(f"--to {job.to!r}: choose one of {', '.join(TARGETS)}")
    if job.to == "megatron":
        return _to_megatron(job)
    if job.tp is not None or job.pp is not None:
        raise ValueError("--tp/--pp choose how a Megatron checkpoint is written; they do not apply to --to hf")
    return _to_hf(job)


def _claim(job: ConvertJob) -> None:
    claim_output(job.out, overwrite=job.overwrite, is_ours=is_project_folder, inputs=(job.model,))


def _to_megatron(job: ConvertJob) -> Path:
    if is_dist_checkpoint(job.model) or detect_megatron_checkpoint(job.model) is not None:
        raise ValueError(f"{job.model} is a Megatron checkpoint already; it loads at any --tp/--pp as it is "
                         "(convert it with --to hf for a model folder)")
    folder = open_model(job.model, verify=job.verify)  # manifest and shapes, before any rank starts
    arch = folder.arch
    fam = arch.model_family
    if fam.position_offset:
        raise ValueError(f"{fam.title} models cannot be converted losslessly: Megatron's learned position table "
                         f"lacks the {fam.position_offset} offset rows Hugging Face keeps; serve the folder as it is")
    tp, pp = job.tp or 1, job.pp or 1
    check_parallel_sizes(arch, tp, pp)
    _claim(job)
    layout = Layout.DEINFER if folder.decomposed else Layout.DENSE
    tokenizer = [job.model / n for n in TOKENIZER_FILES if (job.model / n).is_file()]
    with staged_folder(job.out, before_publish=lambda: _claim(job)) as tmp:
        iteration_dir(tmp).mkdir()
        run_on_ranks(tp * pp, _save_on_rank, str(job.model), str(iteration_dir(tmp)), layout, tp, pp)
        config = json.loads((job.model / "config.json").read_text())
        finish_folder(tmp, config=config, rank_config=folder.rank_config, tokenizer_files=tokenizer, metadata={
            "converted_from": str(job.model),
            "source_manifest_sha256": _manifest_digest(job.model),
            "saved_with": {"tp": tp, "pp": pp, "layout": layout.value},
            "tokenizer": [f.name for f in tokenizer],
        })
    return job.out


def _manifest_digest(model: Path) -> str | None:
    manifest = model / "deinfer_manifest.json"
    return sha256(manifest) if manifest.is_file() else None


def _save_on_rank(model: str, folder: str, layout: Layout, tp: int, pp: int) -> None:
    """One rank: load its stage from the (already verified) folder and save it."""

    groups = init_parallel(tp, pp)
    try:
        save_model_state(load_folder(model, layout, groups, verify=False), folder)
    finally:
        shutdown()


def _to_hf(job: ConvertJob) -> Path:
    if is_dist_checkpoint(job.model):
        arch, rank_config, manifest, tensors = open_checkpoint(job.model, verify=job.verify)
        config = json.loads((job.model / "config.json").read_text())
        tokenizer_dir, source = job.model, manifest.get("converted_from")
    elif detect_megatron_checkpoint(job.model) is not None:  # a Megatron-LM run's own (dense) checkpoint

        config, tensors = read_megatron_checkpoint(job.model)
        rank_config, tokenizer_dir, source = RankConfig.dense(arch_from_hf_config(config)), None, None
    else:
        raise ValueError(f"{job.model} is not a Megatron checkpoint (expected one written by `convert --to "
                         "megatron`, or a Megatron-LM torch/torch_dist checkpoint)")
    metadata = {"converted_from": str(job.model), "original_source": source,
                "checkpoint_format": FORMAT if tokenizer_dir is not None else "megatron-lm"}
    return write_decomposed(job.out, config=config, tensors=tensors, rank_config=rank_config,
                            tokenizer_dir=tokenizer_dir, metadata=metadata, overwrite=job.overwrite,
                            inputs=(job.model,))
