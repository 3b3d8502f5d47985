"""The one-process student against references written here with torch and transformers alone:
its steps are a plain AdamW loop (textbook KL, ``clip_grad_norm_``, the warm-up + cosine
written out) on a plain factor-pair model; and ``models.hf_factored``, its builder (also the
bench's Hugging Face peer), trains only the factors asked for and gives the folder's tensors
back under the folder's names, biases and tied embeddings included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from torch import nn

from deinfer_megatron.checkpoints.folder import open_model
from deinfer_megatron.healing.hf_student import HFStudent, load_teacher, read_final
from deinfer_megatron.healing.loop import LoopSettings, train
from deinfer_megatron.healing.state import FINAL
from deinfer_megatron.models.hf_factored import folder_tensors, hf_model
from tests.healing.test_heal import _ids, _multiplied_out, schedule

STEPS, WARMUP, LR, BATCH, SEQ = 5, 2, 3e-3, 2, 32


def _lr(n: int) -> float:
    return schedule(n, lr=LR, warmup=WARMUP, steps=STEPS)


class _Pair(nn.Module):
    def __init__(self, u: torch.Tensor, v: torch.Tensor) -> None:
        super().__init__()
        self.u, self.v = nn.Parameter(u.clone()), nn.Parameter(v.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.v.T) @ self.u.T


def _plain_student(folder: Path) -> tuple[nn.Module, dict[str, nn.Parameter]]:
    """transformers' model with every decomposed matrix a plain (u, v) pair; the factors trainable."""
    state = load_file(str(folder / "model.safetensors"))
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
    modules = dict(model.named_modules())
    for name in [k[:-2] for k in state if k.endswith(".u")]:
        parent, _, leaf = name.rpartition(".")
        setattr(modules[parent], leaf, _Pair(state.pop(f"{name}.u"), state.pop(f"{name}.v")))
    model.load_state_dict(state, strict=False)
    model.requires_grad_(False)
    factors = {n: p for n, p in model.named_parameters() if n.endswith((".u", ".v"))}
    for p in factors.values():
        p.requires_grad_(True)
    return model, factors


class _Windows:
    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def batch(self, step: int, batch: int, seed: int) -> torch.Tensor:
        return self.ids[step * batch:(step + 1) * batch]


def test_the_student_steps_like_a_plain_torch_loop(pair, tmp_path) -> None:
    data = _Windows(_ids(pair.dense, pair.heal_text, STEPS * BATCH, SEQ))
    settings = LoopSettings(lr=LR, warmup=WARMUP, batch=BATCH, seq_len=SEQ, steps=STEPS, seconds=None)
    student = HFStudent(open_model(pair.dec), load_teacher(pair.dense), train="factors", optimizer=settings.optimizer())
    records = train(student, data, settings, state_folder=tmp_path).records
    healed = read_final(tmp_path / FINAL)

    teacher = transformers.AutoModelForCausalLM.from_pretrained(pair.dense).eval()
    model, factors = _plain_student(pair.dec)
    optim = torch.optim.AdamW(factors.values(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    for n in range(1, STEPS + 1):
        ids = data.batch(n - 1, BATCH, 0)
        with torch.no_grad():
            p = teacher(ids).logits.log_softmax(-1)
        q = model(ids).logits.log_softmax(-1)
        loss = (p.exp() * (p - q)).sum(-1).mean()
        optim.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(list(factors.values()), 1.0)
        for group in optim.param_groups:
            group["lr"] = _lr(n)
        optim.step()
        record = records[n - 1]
        assert record["step"] == n and record["kind"] == "logits"
        assert record["lr"] == pytest.approx(_lr(n), rel=1e-12), (n, record["lr"], _lr(n))
        assert record["loss"] == pytest.approx(loss.item(), rel=1e-5) and record["kl"] == record["loss"]
        assert record["grad_norm"] == pytest.approx(norm.item(), rel=1e-4)
    original = load_file(str(pair.dec / "model.safetensors"))
    assert healed.keys() == original.keys()
    for name, tensor in healed.items():
        want = factors[name].detach() if name in factors else original[name]
        rel = ((tensor - want).norm() / want.norm()).item()
        assert rel <= 1e-5, (name, rel)
    assert all(not healed[k].equal(original[k]) for k in factors)


@pytest.fixture(scope="module")
def biased(tmp_path_factory) -> Path:
    """A tiny Qwen2 (biases on q, k, v; tied embeddings) with its first layer decomposed."""
    from deinfer_megatron.decompose.job import DecomposeJob, run_decompose
    from tests.helpers.tiny_models import save_tiny_folder

    root = tmp_path_factory.mktemp("biased")
    hf = save_tiny_folder("qwen2", root / "dense", num_hidden_layers=2)
    ranks = {n: min(m.weight.shape) // 2 for n, m in hf.named_modules()
             if isinstance(m, nn.Linear) and n.startswith("model.layers.0.")}
    (root / "ranks.json").write_text(json.dumps(ranks))
    return run_decompose(DecomposeJob(root / "dense", "svd", rank_config=root / "ranks.json", out=root / "dec"))


def test_the_builder_trains_what_it_is_asked_and_gives_the_folders_tensors_back(biased) -> None:
    folder = open_model(biased)
    factored = set(folder.rank_config.modules)
    assert any(f"{m}.bias" in folder.source for m in factored)  # the bias of a factor pair is covered
    for trainable, leaves in (("factors", ("u.weight", "v.weight")), ("u", ("u.weight",)), ("v", ("v.weight",))):
        model = hf_model(folder, trainable=trainable)
        assert model.training
        assert {n for n, p in model.named_parameters() if p.requires_grad} == {
            f"{m}.{leaf}" for m in factored for leaf in leaves}
    everything = {n for n, _ in model.named_parameters()}
    assert {n for n, p in hf_model(folder, trainable="all").named_parameters() if p.requires_grad} == everything
    linear = {n for n, p in hf_model(folder, trainable="linear").named_parameters() if p.requires_grad}
    frozen = {n for n in everything if "norm" in n or "embed_tokens" in n or "lm_head" in n}
    assert frozen and linear == everything - frozen  # factors, biases and the matrices kept dense
    pairs = {n for n in everything if n.rsplit(".", 2)[-2] in ("u", "v")}  # every factor's weight and bias
    assert pairs and pairs < linear  # and the matrices kept dense besides
    on_disk = load_file(str(biased / "model.safetensors"))
    back = folder_tensors(model, folder)
    assert back.keys() == on_disk.keys() and all(back[k].equal(on_disk[k]) for k in on_disk)
    frozen = hf_model(folder)
    assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())
    ids = torch.arange(40).view(2, 20) * 7
    with torch.no_grad():
        want = _multiplied_out(biased)(ids).logits
        assert torch.allclose(frozen(ids).logits, want, atol=1e-4 * want.abs().max().item())
    with pytest.raises(ValueError, match="unknown trainable selection 'w'"):
        hf_model(folder, trainable="w")
    with pytest.raises(ValueError, match="multiply_out leaves no factors to train"):
        hf_model(folder, trainable="u", multiply_out=True)
