"""Model folders on disk: a dense Hugging Face folder, or a decomposed one written by
``deinfer-megatron decompose``.

A decomposed folder is a Hugging Face folder (``config.json``, tokenizer files) plus
``rank_config.json``, factors in safetensors named ``<module>.u`` / ``<module>.v`` (dense
matrices keep ``<module>.weight``), and ``deinfer_manifest.json`` with a SHA-256 per file. It is
written to a temporary sibling folder and renamed into place, so a folder that exists is
complete. Opening it verifies the manifest and names the file that does not match.

Tensors are exposed as a lazy mapping (name → safetensors slice): a rank reads only the rows
and columns of its own shards.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deinfer_megatron.models.arch import ModelArch, load_arch
from deinfer_megatron.specs.rank_config import RankConfig

MANIFEST = "deinfer_manifest.json"
RANK_CONFIG = "rank_config.json"
FORMAT = "deinfer-megatron-decomposed/1"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "chat_template.jinja")
_SHARD_BYTES = 2 << 30


class SafetensorsSource(Mapping[str, Any]):
    """Tensor name → lazy ``safetensors`` slice, over one or more files."""

    def __init__(self, files: list[Path]) -> None:
        self._handles = [safe_open(str(f), framework="pt") for f in files]
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


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / f for f in files]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"{path} has no model.safetensors (or model.safetensors.index.json); convert the "
        "checkpoint to safetensors, e.g. with transformers' save_pretrained(safe_serialization=True)"
    )


def verify_manifest(path: Path, manifest: Mapping[str, Any]) -> None:
    """Check every file's SHA-256 against the manifest; name the first that differs."""
    for name, expected in manifest.get("files", {}).items():
        f = path / name
        if not f.is_file():
            raise ValueError(f"{f} is listed in {MANIFEST} but missing; the folder is incomplete")
        if sha256(f) != expected:
            raise ValueError(f"{f} is corrupted (SHA-256 differs from {MANIFEST}); re-create the folder")


def open_model(path: str | Path, *, verify: bool = True) -> ModelFolder:
    """Open a dense Hugging Face folder or a decomposed folder (manifest verified)."""
    path = Path(path)
    arch = load_arch(path)
    manifest = None
    if (path / MANIFEST).is_file():
        manifest = json.loads((path / MANIFEST).read_text())
        if verify:
            verify_manifest(path, manifest)
    rank_file = path / RANK_CONFIG
    rank_config = RankConfig.load(rank_file, arch) if rank_file.is_file() else RankConfig.dense(arch)
    source = SafetensorsSource(_weight_files(path))
    _check_factors(source, rank_config, path)
    return ModelFolder(path, arch, rank_config, source, manifest)


def _check_factors(source: Mapping[str, Any], rank_config: RankConfig, path: Path) -> None:
    """Every decomposed module has u and v of its configured rank, and nothing else disagrees."""
    for module, rank in rank_config.modules.items():
        for suffix, axis in (("u", 1), ("v", 0)):
            key = f"{module}.{suffix}"
            if key not in source:
                raise ValueError(f"{path}: {key} is missing but {RANK_CONFIG} decomposes {module}")
            shape = source[key].get_shape()
            if shape[axis] != rank:
                raise ValueError(
                    f"{path}: {key} has rank {shape[axis]} but {RANK_CONFIG} says {rank}; "
                    "the factors and the rank config disagree"
                )


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
) -> Path:
    """Write a decomposed folder atomically: temp sibling folder, manifest last, then rename."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        (tmp / "config.json").write_text(json.dumps(dict(config), indent=1))
        rank_config.save(tmp / RANK_CONFIG)
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                if (Path(tokenizer_dir) / name).is_file():
                    shutil.copy2(Path(tokenizer_dir) / name, tmp / name)
        shards = _shards(tensors)
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata={"format": "pt"})
                weight_map.update({k: fname for k in shard})
            (tmp / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        files = {p.name: sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        manifest = {"format": FORMAT, **dict(metadata), "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if out.exists():
            backup = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(backup)
            tmp.rename(out)
            shutil.rmtree(backup)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
