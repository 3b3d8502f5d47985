"""Megatron ``torch_dist`` checkpoints of (decomposed) models: saving and loading a stage with
Megatron's own ``dist_checkpointing``, and the checkpoint folder this project writes.

Every tensor is saved under its *global* shape, independent of the TP×PP size and of the
layout (``layers.sharded_state`` for the factors, Megatron's own ``sharded_state_dict`` for the
rest), so a checkpoint saved at TP=2 under ``deinfer`` loads at TP=3 under ``naive``: each rank
reads only its own slices. Under ``dense`` a decomposed checkpoint is what a user means by
"serve it as a dense model": its factors are read whole and multiplied out (``W = U·V``), as
``dense`` does for a decomposed folder.

A checkpoint *folder* (``convert --to megatron``) is a Megatron-LM checkpoint root plus what
serving needs, and is verified like a decomposed folder:

    OUT/latest_checkpointed_iteration.txt   "release"
    OUT/release/                            dist_checkpointing.save: metadata.json, common.pt,
                                            .metadata, *.distcp
    OUT/config.json, rank_config.json       the Hugging Face config and the ranks
    OUT/tokenizer files                     so that OUT is also the tokenizer's folder
    OUT/deinfer_manifest.json               format, where it came from, SHA-256 of every file

Loading checks the manifest (every file, ``verify=False`` to skip) before a tensor is read.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from deinfer_megatron.arch.model import ModelArch, load_arch
from deinfer_megatron.checkpoints.dcp import read_dcp_tensors
from deinfer_megatron.checkpoints.dist_names import dist_to_hf
from deinfer_megatron.checkpoints.loader import MultipliedOut, load_stage
from deinfer_megatron.checkpoints.manifest import MANIFEST, RANK_CONFIG, folder_files, verify_manifest
from deinfer_megatron.specs.layout import as_plan
from deinfer_megatron.specs.rank_config import RankConfig

FORMAT = "deinfer-megatron-dist/1"
TRACKER = "latest_checkpointed_iteration.txt"
ITERATION = "release"
# Per-layer keys: decomposed layers have per-layer ranks, which cannot share a stacked tensor.
METADATA = {"non_homogeneous_layers": True}
_MODEL_KEYS = ("embedding.", "decoder.", "output_layer.")


def is_dist_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a checkpoint folder written by this project (its manifest says so)."""
    try:
        return json.loads((Path(path) / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def sharded_model_state(stage: Any) -> dict[str, Any]:
    """The stage's ``sharded_state_dict`` with per-layer keys. A tied output layer that a
    pipeline stage keeps as its own copy is read from the embedding and never saved, as
    Megatron does for tied weights."""
    sd = stage.model.sharded_state_dict(metadata=dict(METADATA))
    head = sd.get("output_layer.weight")
    if stage.arch.tied_embeddings and head is not None:
        head.key = "embedding.word_embeddings.weight"
        head.replica_id = (1, *tuple(head.replica_id)[1:])
    return sd


def _in_process_results_queue() -> None:
    """Give Megatron's writer an in-process results queue instead of a ``multiprocessing``
    manager's.

    A synchronous save puts its write results and reads them back in the calling process, so a
    plain ``queue.Queue`` carries them. The manager Megatron would start is a server process of
    its own: it survives a killed command (nothing ties it to its parent), and its socket under
    a deep ``$TMPDIR`` (a test's, a job scheduler's) is longer than a Unix socket path may be,
    so it dies at start.
    """
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


@contextlib.contextmanager
def _megatron_io() -> Iterator[None]:
    """What ``dist_checkpointing.save``/``load`` need on this machine.

    Megatron's ``torch_dist`` writer forks one writer process per bucket and joins them before
    ``save`` returns; the project's ranks are daemonic (they die with the command), and a
    daemonic process may not start children, so the flag is lifted while Megatron runs. (The
    CUDA calls of the writer have CPU stand-ins: ``patches.megatron_cpu`` covers save/load.)
    Megatron's reader calls a name DCP deprecates; that one warning is silenced.
    """
    process = multiprocessing.current_process()
    daemon = process.daemon
    if daemon:
        process.daemon = False
    try:
        _in_process_results_queue()
        with warnings.catch_warnings():  # Megatron-Core 0.16.1 still calls DCP's deprecated name
            warnings.filterwarnings("ignore", message="`load_state_dict` is deprecated", category=FutureWarning)
            yield
    finally:
        if daemon:
            process.daemon = True


def save_model_state(stage: Any, folder: str | Path) -> None:
    """Save ``stage`` into the empty, existing ``folder`` (collective: every rank calls it)."""
    from megatron.core import dist_checkpointing

    with _megatron_io():
        dist_checkpointing.save({"model": sharded_model_state(stage)}, str(folder))


def load_model_state(stage: Any, folder: str | Path, source_ranks: RankConfig) -> None:
    """Fill ``stage`` from the dist checkpoint in ``folder`` (collective), whose model is
    decomposed as ``source_ranks`` says.

    Raises:
        ValueError: the stage was built with other ranks than the checkpoint's.
    """

    # Blocks built dense (all under the dense layout, some under ``auto``) take U·V.
    dense = as_plan(stage.layout, stage.arch.num_layers).dense_modules(stage.arch) & set(source_ranks.modules)
    if dense:
        tensors = read_hf_tensors(folder, stage.arch, source_ranks)
        multiplied = RankConfig.from_mapping({n: source_ranks.modules[n] for n in dense}, stage.arch)
        load_stage(stage.model, MultipliedOut(tensors, multiplied), stage.arch, stage.rank_config,
                   layer_offset=stage.layer_offset, num_local_layers=stage.num_local_layers)
        return
    if dict(source_ranks.modules) != dict(stage.rank_config.modules):
        raise ValueError("the checkpoint's rank config differs from the one the model was built with")
    from megatron.core import dist_checkpointing

    from megatron.core.dist_checkpointing.core import CheckpointingException

    try:
        with _megatron_io():
            loaded = dist_checkpointing.load({"model": sharded_model_state(stage)}, str(folder))
    except CheckpointingException as err:  # e.g. a tensor of another shape than the model's
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"{folder} does not load into this model ({message}); check that its "
                         "config.json and rank_config.json are the ones it was saved with") from None
    with torch.no_grad():
        stage.model.load_state_dict(loaded["model"], strict=True)
    bad = next((n for n, p in stage.model.named_parameters() if not torch.isfinite(p).all()), None)
    if bad is not None:
        raise ValueError(f"{folder}: parameter {bad} holds NaN or infinite values; the checkpoint is "
                         "corrupted — re-create it")


def read_hf_tensors(folder: str | Path, arch: ModelArch, rank_config: RankConfig) -> dict[str, torch.Tensor]:
    """Every tensor of the dist checkpoint in ``folder`` under its Hugging Face name, read in
    this process (no process group; ``dcp.read_dcp_tensors``)."""
    return dist_to_hf(read_dcp_tensors(Path(folder), _MODEL_KEYS), arch, rank_config)


# --- the checkpoint folder -------------------------------------------------------------------------

def iteration_dir(root: str | Path) -> Path:
    return Path(root) / ITERATION


def finish_folder(root: Path, *, config: Mapping[str, Any], rank_config: RankConfig,
                  tokenizer_files: list[Path], metadata: Mapping[str, Any]) -> None:
    """Write what serving needs beside ``root/release`` and, last, the manifest."""
    import shutil

    (root / "config.json").write_text(json.dumps(dict(config), indent=1))
    if rank_config.modules:
        rank_config.save(root / RANK_CONFIG)
    for f in tokenizer_files:
        shutil.copy2(f, root / f.name)
    (root / TRACKER).write_text(ITERATION)
    manifest = {"format": FORMAT, **dict(metadata), "files": folder_files(root)}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1))


def open_checkpoint(path: str | Path, *, verify: bool = True, weights: bool = True,
                    read: bool | None = None) -> tuple[ModelArch, RankConfig, dict, dict[str, torch.Tensor] | None]:
    """``(arch, rank_config, manifest, Hugging Face tensors or None)`` of a checkpoint folder.

    With ``verify`` every file's SHA-256 is checked against the manifest first (config and rank
    config only, without ``weights``), and every file under ``release/`` must be listed. The
    tensors are read (whole) when ``read`` (default: ``weights``); ranks that load their slices
    through Megatron pass ``read=False``.
    Raises:
        ValueError: a file missing, unlisted or corrupted; tensors that contradict the configs.
    """
    root = Path(path)
    manifest = json.loads((root / MANIFEST).read_text())
    arch = load_arch(root)
    rank_file = root / RANK_CONFIG
    configs = ["config.json", *([RANK_CONFIG] if rank_file.is_file() else [])]
    if verify:
        stored = [p.relative_to(root).as_posix() for p in sorted(iteration_dir(root).rglob("*")) if p.is_file()]
        if not stored:
            raise ValueError(f"{iteration_dir(root)} holds no checkpoint files; the checkpoint is incomplete")
        verify_manifest(root, manifest, [*configs, *stored], only=None if weights else configs)
    rank_config = RankConfig.load(rank_file, arch) if rank_file.is_file() else RankConfig.dense(arch)
    tensors = read_hf_tensors(iteration_dir(root), arch, rank_config) if (weights if read is None else read) else None
    return arch, rank_config, manifest, tensors
