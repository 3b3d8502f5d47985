"""Model folders on disk: a dense Hugging Face folder, or a decomposed one written by
``deinfer-megatron decompose``.

A decomposed folder is a Hugging Face folder (``config.json``, tokenizer files) plus
``rank_config.json``, factors in safetensors named ``<module>.u`` / ``<module>.v`` (dense
matrices keep ``<module>.weight``), and ``deinfer_manifest.json`` with a SHA-256 per file. It is
written to a temporary sibling folder and renamed into place (``files.staging``), so a folder
that exists is complete.

What loading checks — weights that were not verified are never served:

* a decomposed folder needs its manifest, listing at least the config, the rank config and
  every weight file, each with the SHA-256 it was written with (``verify=False``, the CLI's
  ``--no-verify``, accepts a folder made elsewhere);
* a folder converted by ``fetch-model`` is checked against its own manifest the same way;
* always: every tensor's shape against what ``config.json`` and the rank config imply
  (``hf_names.expected_shapes``), readable safetensors headers, and — when the weights are
  loaded — finite values (``checkpoints.loader``);
* the temporary folder of an unfinished run is never a model.

Tensors are exposed as a lazy mapping (name → safetensors slice): a rank reads only the rows
and columns of its own shards.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from deinfer_megatron.checkpoints.gguf import MANIFEST_NAME as CONVERTED_MANIFEST
from deinfer_megatron.checkpoints.gguf import converted_by_us
from deinfer_megatron.checkpoints.hf_names import expected_shapes
from deinfer_megatron.files import failpoints
from deinfer_megatron.checkpoints.dist_checkpoint import is_dist_checkpoint, open_checkpoint
from deinfer_megatron.checkpoints.manifest import MANIFEST, RANK_CONFIG, verify_manifest
from deinfer_megatron.files.checksums import sha256
from deinfer_megatron.files.staging import claim_output, is_temporary, staged_folder
from deinfer_megatron.arch.model import ModelArch, load_arch
from deinfer_megatron.specs.rank_config import RankConfig

FORMAT = "deinfer-megatron-decomposed/1"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "chat_template.jinja")
_SHARD_BYTES = 2 << 30


class SafetensorsSource(Mapping[str, Any]):
    """Tensor name → lazy ``safetensors`` slice, over one or more files."""

    def __init__(self, files: list[Path]) -> None:
        self._handles = []
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"weight file {f} is missing; the folder is incomplete")
            try:
                self._handles.append(safe_open(str(f), framework="pt"))
            except SafetensorError as err:
                raise ValueError(f"{f} is not a readable safetensors file ({err}); it is truncated "
                                 "or corrupted — re-create or re-download it") from None
        self._where = {name: h for h in self._handles for name in h.keys()}

    def __getitem__(self, name: str) -> Any:
        return self._where[name].get_slice(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


@dataclass
class ModelFolder:
    """An opened model folder."""

    path: Path
    arch: ModelArch
    rank_config: RankConfig
    source: Mapping[str, Any]
    manifest: dict[str, Any] | None

    @property
    def decomposed(self) -> bool:
        return bool(self.rank_config.modules)


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({what}): {err}") from None


def is_project_folder(path: Path) -> bool:
    """Whether ``path`` is a model folder this project wrote (decomposed, or converted by
    ``fetch-model``): the only kind ``--overwrite`` may replace."""
    path = Path(path)
    try:
        ours = json.loads((path / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        ours = False
    return ours or converted_by_us(path) or is_dist_checkpoint(path)


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index, "safetensors index").get("weight_map", {})
        return [path / f for f in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"{path} has no model.safetensors (or model.safetensors.index.json); convert the "
        "checkpoint to safetensors, e.g. with transformers' save_pretrained(safe_serialization=True)"
    )


def _verify_conversion(path: Path, only: Sequence[str] | None = None) -> None:
    """A ``fetch-model`` folder against its own manifest (sizes, and SHA-256 where recorded)."""
    manifest = _read_json(path / CONVERTED_MANIFEST, "fetch-model manifest")
    for name, entry in manifest.get("files", {}).items():
        if only is not None and name not in only:
            continue
        f = path / name
        size, digest = (entry, None) if isinstance(entry, int) else (entry.get("size"), entry.get("sha256"))
        if not f.is_file() or f.stat().st_size != size or (digest is not None and sha256(f) != digest):
            raise ValueError(f"{f} is missing or corrupted (it differs from {CONVERTED_MANIFEST}); "
                             "re-create the folder with `deinfer-megatron fetch-model --overwrite`")


def _open_checked(path: Path, verify: bool, *, weights: bool) -> tuple[ModelArch, RankConfig, Any, list[Path]]:
    """(arch, rank config, manifest, weight files) of a folder, with the manifest checked as
    the module says — of every file with ``weights``, else of config and rank config only."""
    if is_temporary(path):
        raise ValueError(f"{path} is the temporary folder of a run that did not finish; it is never "
                         "loaded (rerun the command that writes it; the next run removes it)")
    arch = load_arch(path)
    rank_file = path / RANK_CONFIG
    manifest = _read_json(path / MANIFEST, "manifest") if (path / MANIFEST).is_file() else None
    files = _weight_files(path) if weights else []
    configs = ["config.json", *([RANK_CONFIG] if rank_file.is_file() else [])]
    if verify and (rank_file.is_file() or manifest is not None):
        if manifest is None:
            raise ValueError(
                f"{path} has {RANK_CONFIG} but no {MANIFEST}, so it cannot be verified; re-create it "
                "with `deinfer-megatron decompose` (or pass --no-verify for a folder made elsewhere)"
            )
        required = [*configs, *(f.name for f in files)]
        verify_manifest(path, manifest, required, only=None if weights else configs)
    elif verify and (path / CONVERTED_MANIFEST).is_file():
        _verify_conversion(path, only=None if weights else configs)
    rank_config = RankConfig.load(rank_file, arch) if rank_file.is_file() else RankConfig.dense(arch)
    return arch, rank_config, manifest, files


def open_model(path: str | Path, *, verify: bool = True) -> ModelFolder:
    """Open a dense Hugging Face folder or a decomposed folder, checked as the module says —
    or a Megatron checkpoint written by ``convert --to megatron`` (its manifest checked the
    same way; its tensors read whole, under Hugging Face names: ``checkpoints.dist_checkpoint``).

    ``verify=False`` skips the manifest (a decomposed folder made elsewhere); shapes are
    always checked.
    """
    path = Path(path)
    if is_dist_checkpoint(path):  # a Megatron checkpoint of `convert --to megatron`
        arch, rank_config, manifest, tensors = open_checkpoint(path, verify=verify)
        _check_tensors(tensors, arch, rank_config, path)
        return ModelFolder(path, arch, rank_config, tensors, manifest)
    arch, rank_config, manifest, files = _open_checked(path, verify, weights=True)
    source = SafetensorsSource(files)
    _check_tensors(source, arch, rank_config, path)
    return ModelFolder(path, arch, rank_config, source, manifest)


def open_config(path: str | Path, *, verify: bool = True) -> tuple[ModelArch, RankConfig]:
    """A folder's architecture and rank config (verified like ``open_model``, weights unread):
    what ``plan`` needs. Also of a Megatron checkpoint written by ``convert --to megatron``."""
    if is_dist_checkpoint(path):
        arch, rank_config, _, _ = open_checkpoint(path, verify=verify, weights=False)
        return arch, rank_config
    arch, rank_config, _, _ = _open_checked(Path(path), verify, weights=False)
    return arch, rank_config


def _shape(source: Mapping[str, Any], name: str) -> tuple[int, ...]:
    item = source[name]
    return tuple(item.shape if isinstance(item, torch.Tensor) else item.get_shape())


def _check_tensors(source: Mapping[str, Any], arch: ModelArch, rank_config: RankConfig, path: Path) -> None:
    """Every tensor the model needs is there, with the shape config.json and the rank config
    imply; factors of a matrix the rank config keeps dense (or the reverse) are named."""
    expected = expected_shapes(arch, rank_config)
    for name, (shape, required) in expected.items():
        if name not in source:
            if not required:
                continue
            module, _, suffix = name.rpartition(".")
            if suffix in ("u", "v") and f"{module}.weight" in source:
                raise ValueError(f"{path}: {name} is missing but {RANK_CONFIG} decomposes {module}")
            if suffix == "weight" and f"{module}.u" in source:
                raise ValueError(f"{path}: {module} is stored as factors but {RANK_CONFIG} does not "
                                 "list it; the factors and the rank config disagree")
            raise ValueError(f"{path}: tensor {name} is missing from the weights")
        got = _shape(source, name)
        if got == shape:
            continue
        module, _, suffix = name.rpartition(".")
        axis = {"u": 1, "v": 0}.get(suffix)
        if axis is not None and len(got) == 2 and got[1 - axis] == shape[1 - axis]:
            raise ValueError(f"{path}: {name} has rank {got[axis]} but {RANK_CONFIG} says "
                             f"{shape[axis]}; the factors and the rank config disagree")
        raise ValueError(f"{path}: tensor {name} has shape {list(got)} but config.json implies "
                         f"{list(shape)}; the weights and config.json disagree")


def _shards(tensors: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > _SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    return shards


def write_decomposed(
    out: str | Path,
    *,
    config: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    rank_config: RankConfig,
    tokenizer_dir: str | Path | None,
    metadata: Mapping[str, Any],
    overwrite: bool = False,
    inputs: tuple[Path, ...] = (),
) -> Path:
    """Write a decomposed folder atomically: temporary sibling, manifest last, then one rename.

    ``out`` must not exist, be empty, or — with ``overwrite`` — be a folder this project wrote
    (``files.staging.claim_output``); it is checked again just before the rename.
    """
    out = Path(out)

    def claim() -> None:
        claim_output(out, overwrite=overwrite, is_ours=is_project_folder, inputs=inputs)

    claim()
    with staged_folder(out, before_publish=claim) as tmp:
        (tmp / "config.json").write_text(json.dumps(dict(config), indent=1))
        rank_config.save(tmp / RANK_CONFIG)
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                if (Path(tokenizer_dir) / name).is_file():
                    shutil.copy2(Path(tokenizer_dir) / name, tmp / name)
        shards = _shards(tensors)
        names = (["model.safetensors"] if len(shards) == 1 else
                 [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
        for fname, shard in zip(names, shards):
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            failpoints.point("decompose.after-weights")
        if len(shards) > 1:
            weight_map = {k: fname for fname, shard in zip(names, shards) for k in shard}
            (tmp / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        files = {p.name: sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        manifest = {"format": FORMAT, **dict(metadata), "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return out
