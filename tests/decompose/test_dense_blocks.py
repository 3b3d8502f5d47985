"""``decompose`` end to end on a model whose blocks differ: low-rank blocks are factored, blocks
with flat spectra (where factors at any useful rank would hold about the dense parameters) are
written as their original dense ``.weight`` and left out of the rank config — and the mixed
folder loads in every layout at TP=1 and TP=2 with the logits of a Hugging Face model built here
from the folder's tensors, factors multiplied out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from deinfer_megatron.checkpoints.folder import open_model
from deinfer_megatron.decompose.allocation import ALLOCATOR_VERSION, BREAK_EVEN_FRACTION, uniform_rank
from deinfer_megatron.decompose.job import DecomposeJob, run_decompose
from deinfer_megatron.specs.layout import Layout
from tests.helpers.distributed import run_ranks
from tests.helpers.text import real_text_file
from tests.helpers.tiny_models import save_tiny_folder

RATIO = 0.6
LAYOUTS = ("deinfer", "naive", "dense")
# which blocks get low-rank weights (the others keep their random, flat-spectrum ones)
LOW_RANK = {(0, "self_attn"), (0, "mlp"), (1, "self_attn"), (2, "mlp")}


def _low_rank_folder(path: Path) -> Any:
    """The tiny LLaMA of the parity tests with the LOW_RANK blocks' matrices made rank 3 (plus a
    little noise); returns the Hugging Face model holding exactly the saved weights."""
    hf = save_tiny_folder("llama", path)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, module in hf.named_modules():
            parts = name.split(".")
            if isinstance(module, torch.nn.Linear) and name.startswith("model.layers.") and \
                    (int(parts[2]), parts[3]) in LOW_RANK:
                m, n = module.weight.shape
                a, b = torch.randn(m, 3, generator=gen), torch.randn(3, n, generator=gen)
                module.weight.copy_(0.1 * a @ b / 3**0.5 + 1e-3 * torch.randn(m, n, generator=gen))
    hf.save_pretrained(path, safe_serialization=True)
    return hf


def _reference(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    """Hugging Face logits from the folder's raw tensors: each ``u``/``v`` pair multiplied out."""
    import transformers
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(f))
    state = {k: v for k, v in tensors.items() if not k.endswith((".u", ".v"))}
    for k in tensors:
        if k.endswith(".u"):
            state[k[:-2] + ".weight"] = tensors[k] @ tensors[k[:-2] + ".v"]
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(folder), attn_implementation="eager")
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        return model.eval()(ids).logits


def _logits_worker(tp: int, folder: Path, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    from deinfer_megatron.models.build import load_folder
    from deinfer_megatron.models.pipeline import stage_forward
    from deinfer_megatron.parallel.runtime import init_parallel, shutdown

    groups = init_parallel(tp, 1)
    try:
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        return {layout: stage_forward(load_folder(folder, Layout(layout), groups), ids, pos).cpu() for layout in LAYOUTS}
    finally:
        shutdown()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> tuple[Any, Path]:
    root = tmp_path_factory.mktemp("dense_blocks")
    hf = _low_rank_folder(root / "dense")
    calib = real_text_file(root, 20_000, "calibration")
    out = run_decompose(DecomposeJob(root / "dense", "svd-llm", ratio=RATIO, allocation="variadic",
                                     calib_text=calib, calib_tokens=512, calib_seq_len=128, out=root / "dec"))
    return hf, out


def test_flat_blocks_stay_dense_low_rank_blocks_are_factored(mixed) -> None:
    hf, out = mixed
    folder = open_model(out)
    shapes = folder.arch.linear_shapes()
    ranks = folder.rank_config.modules
    original = dict(hf.named_modules())
    for name, (m, n) in shapes.items():
        layer, block = int(name.split(".")[2]), name.split(".")[3]
        if name in ranks:
            assert ranks[name] * (m + n) < BREAK_EVEN_FRACTION * m * n, f"{name} factored at break-even"
            assert f"{name}.u" in folder.source and f"{name}.weight" not in folder.source
        else:  # kept dense: the original weight, untouched
            assert torch.equal(folder.source[f"{name}.weight"][:], original[name].weight), name
        assert (name in ranks) == ((layer, block) in LOW_RANK), f"{name}: ranks {ranks.get(name)}"
    layers = folder.rank_config.layers
    assert layers[1].attention is not None and layers[1].mlp is None  # mixed within one layer
    assert layers[2].attention is None and layers[2].mlp is not None
    manifest = json.loads((out / "deinfer_manifest.json").read_text())
    assert manifest["allocator"] == ALLOCATOR_VERSION and manifest["dense_matrices"] == 3 + 4 + 7
    # the dense blocks' m·n count in the budget: each kind spends at most its uniform share
    for kind in {n.split(".", 3)[3] for n in shapes}:
        mine = {n: s for n, s in shapes.items() if n.endswith(kind)}
        spent = sum(ranks[n] * sum(s) if n in ranks else s[0] * s[1] for n, s in mine.items())
        assert spent <= sum(uniform_rank(*s, RATIO) * sum(s) for s in mine.values()), kind
    total = sum(m * n for m, n in shapes.values())
    kept = sum(ranks[n] * sum(s) if n in ranks else s[0] * s[1] for n, s in shapes.items())
    assert manifest["kept_fraction"] == pytest.approx(kept / total, abs=1e-6)


@pytest.mark.parametrize("tp", [1, 2])
def test_the_mixed_folder_serves_in_every_layout(mixed, tp: int) -> None:
    _, out = mixed
    ids = torch.randint(0, 49152, (2, 11), generator=torch.Generator().manual_seed(5))
    ref = _reference(out, ids)
    scale = ref.abs().max().item()
    for rank, got in enumerate(run_ranks(tp, _logits_worker, tp, out, ids)):
        for layout in LAYOUTS:
            diff = (got[layout] - ref).abs().max().item()
            assert diff <= 1e-4 * max(scale, 1.0), f"TP={tp} rank {rank} {layout}: max |dlogit| {diff}"
            assert torch.equal(got[layout].argmax(-1), ref.argmax(-1)), f"TP={tp} rank {rank} {layout}"
