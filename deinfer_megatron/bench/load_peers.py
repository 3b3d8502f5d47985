"""``loadgen --peers``: the same seeded request set, run by what a CPU user would run instead of the
server, reported beside it.

- ``hf``: Hugging Face transformers on the same decomposed folder, every factor pair two
  ``nn.Linear``s (``models.hf_factored``), ``model.generate`` on static batches of the load's
  concurrency;
- ``ctranslate2``: CTranslate2 on the multiplied-out dense model in float32,
  ``Generator.generate_batch`` on static batches of the same size; ``ctranslate2-bfloat16`` the
  same in bfloat16 where CTranslate2 computes in it on this CPU.

Every peer runs in a process of its own (``launch.local.spawn_local``) with the thread count of
the server's ranks, one batch after another (``load_peer_worker``); its batches are then laid on
the request set's arrivals exactly as the project's static batches are (``serve_load.static_report``).
The multiplied-out model is converted for CTranslate2 once per decomposed folder (the folder's
manifest, with its files' checksums, is the key) into the project's cache, through a staged folder.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from enum import Enum
from pathlib import Path
from typing import Any

from deinfer_megatron.bench.load_peer_worker import LoadPeerJob, load_peer_worker
from deinfer_megatron.bench.serve_load import LoadRequest, encode_requests, static_report
from deinfer_megatron.checkpoints.embedded import cache_dir
from deinfer_megatron.checkpoints.manifest import MANIFEST
from deinfer_megatron.files.staging import staged_folder
from deinfer_megatron.launch.local import spawn_local
from deinfer_megatron.models.hf_factored import hf_model

PEER_TIMEOUT_S = 4 * 3600.0  # a peer slower than this on a load is a failed peer
INSTALL = "pip install ctranslate2 (CPU wheels on PyPI; or pip install 'deinfer-megatron[test]')"


class LoadPeer(str, Enum):
    """An implementation the request set also runs on."""

    HF = "hf"
    CTRANSLATE2 = "ctranslate2"
    CTRANSLATE2_BF16 = "ctranslate2-bfloat16"

    @property
    def compute_type(self) -> str:
        return "bfloat16" if self is LoadPeer.CTRANSLATE2_BF16 else "float32"

    @property
    def uses_ctranslate2(self) -> bool:
        return self is not LoadPeer.HF


def ctranslate2_compute_types() -> set[str]:
    """What CTranslate2 computes in on this machine's CPU (raises ImportError without it)."""
    import ctranslate2

    return set(ctranslate2.get_supported_compute_types("cpu"))


def parse_peers(text: str) -> tuple[LoadPeer, ...]:
    """``--peers`` (comma-separated) into peers, each usable here; a one-line ``ValueError`` naming
    the bad value and the fix otherwise."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    choices = ",".join(p.value for p in LoadPeer)
    if not names:
        raise ValueError(f"--peers needs at least one of {choices}")
    peers = []
    for name in names:
        try:
            peer = LoadPeer(name)
        except ValueError:
            raise ValueError(f"--peers: unknown peer {name!r}; choose from {choices}") from None
        if peer in peers:
            raise ValueError(f"--peers names {name} twice; name each peer once")
        peers.append(peer)
    if any(p.uses_ctranslate2 for p in peers):
        try:
            offered = ctranslate2_compute_types()
        except ImportError:
            raise ValueError(f"--peers {names[[p.uses_ctranslate2 for p in peers].index(True)]} needs the "
                             f"ctranslate2 package: {INSTALL}") from None
        for peer in peers:
            if peer.uses_ctranslate2 and peer.compute_type not in offered:
                raise ValueError(f"--peers {peer.value}: CTranslate2 does not compute in {peer.compute_type} on "
                                 f"this CPU (it offers {', '.join(sorted(offered))}); use --peers ctranslate2")
    return tuple(peers)


def folder_key(folder: Path) -> str:
    """What identifies a folder's weights: its manifest (the files' checksums) where it has one,
    else its config and its weight files' sizes and modification times."""
    folder = Path(folder)
    digest = hashlib.sha256()
    if (folder / MANIFEST).is_file():
        digest.update((folder / MANIFEST).read_bytes())
    else:
        digest.update((folder / "config.json").read_bytes())
        for f in sorted(folder.glob("*.safetensors")):
            digest.update(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def _convert(folder: Path, out: Path) -> None:
    """The multiplied-out model of ``folder`` as a CTranslate2 model at ``out`` (a new folder)."""
    import ctranslate2

    model = hf_model(folder, multiply_out=True, verify=False)
    dense = out / "hf"
    model.save_pretrained(dense, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (folder / name).is_file():
            shutil.copy2(folder / name, dense / name)
    ctranslate2.converters.TransformersConverter(str(dense)).convert(str(out / "ct2"), force=True)
    shutil.rmtree(dense)


def ctranslate2_model(folder: Path) -> Path:
    """The CTranslate2 model of ``folder``'s multiplied-out weights, converted once (in a process of
    its own, into a staged folder) and then taken from the cache."""
    out = cache_dir() / "ctranslate2" / f"{Path(folder).resolve().name}-{folder_key(folder)}"
    if not (out / "ct2" / "model.bin").is_file():
        with staged_folder(out) as tmp:
            spawn_local(1, _convert, Path(folder), tmp, timeout=PEER_TIMEOUT_S)
    return out / "ct2"


def peer_threads() -> int:
    """The threads of one of the server's ranks: ``OMP_NUM_THREADS``, else 1, as ``serve`` starts them."""
    text = os.environ.get("OMP_NUM_THREADS") or "1"
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"OMP_NUM_THREADS={text!r} is not a thread count; set it to a number or give "
                         "--peer-threads N") from None


def run_load_peer(peer: LoadPeer, folder: Path, requests: list[LoadRequest], concurrency: int,
                  threads: int) -> tuple[dict[str, Any], list[list[int]]]:
    """``requests`` as static batches of ``concurrency`` on ``peer`` (one process of ``threads``
    threads): the static batches' report (``static_report``) with the process's figures, and
    every request's tokens."""
    import transformers

    encoded, tokenizer = encode_requests(folder, requests)
    batches = tuple(tuple(encoded[i : i + concurrency]) for i in range(0, len(encoded), concurrency))
    eos = transformers.GenerationConfig.from_model_config(transformers.AutoConfig.from_pretrained(folder)).eos_token_id
    eos_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
    model = ctranslate2_model(folder) if peer.uses_ctranslate2 else Path(folder)
    cpus = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else ()
    job = LoadPeerJob(peer.value, model, Path(folder), peer.compute_type, threads, cpus, batches, eos_ids, pad)
    (result,) = spawn_local(1, load_peer_worker, job, timeout=PEER_TIMEOUT_S)
    report = static_report(requests, result["rows"], concurrency)
    report.update(peer=peer.value, dtype=peer.compute_type, threads=result["threads"], load_s=result["load_s"],
                  peak_rss_bytes=result["peak_rss_bytes"])
    return report, [r["token_ids"] for r in result["rows"]]
