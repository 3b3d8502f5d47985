"""The student (a decomposed folder as a trainable Hugging Face model) and the teacher.

Every decomposed matrix becomes a :class:`FactorPair` whose parameters are named ``u`` and
``v`` — the names the decomposed folder stores — so the folder's tensors load with one
``load_state_dict`` and the healed weights are written back under the same names, with no
conversion table to get wrong. Dense weights (embeddings, norms, matrices the allocator kept
dense) stay frozen: healing moves only the factors that lost information.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from deinfer_megatron.checkpoints.folder import ModelFolder
from deinfer_megatron.files.checksums import sha256

TRAINABLE = ("factors", "u", "v")


class FactorPair(nn.Module):
    """``y = U (V x) + b``: a decomposed linear, V of shape (r × in), U of shape (out × r)."""

    def __init__(self, u: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.u = nn.Parameter(u.detach().clone().float())
        self.v = nn.Parameter(v.detach().clone().float())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(nn.functional.linear(x, self.v), self.u)
        return y if self.bias is None else y + self.bias


def _hf_model(folder: Path) -> nn.Module:
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                         dtype=torch.float32)


def _read(source: Any, name: str) -> torch.Tensor:
    item = source[name]
    return item if isinstance(item, torch.Tensor) else item[:]


def load_student(folder: ModelFolder, train: str) -> tuple[nn.Module, list[str]]:
    """The decomposed model as a float32 Hugging Face model with :class:`FactorPair` modules;
    returns it and the names of the parameters ``train`` selects (requires_grad set)."""
    if train not in TRAINABLE:
        raise ValueError(f"unknown --train {train!r}; choose one of {', '.join(TRAINABLE)}")
    model = _hf_model(folder.path)
    modules = dict(model.named_modules())
    source = folder.source
    for name in folder.rank_config.modules:
        parent, _, leaf = name.rpartition(".")
        bias = _read(source, f"{name}.bias") if f"{name}.bias" in source else None
        setattr(modules[parent], leaf, FactorPair(_read(source, f"{name}.u"), _read(source, f"{name}.v"), bias))
    state = {k: _read(source, k).float() for k in source}
    tied = folder.arch.tied_embeddings
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    assert not missing and not unexpected, f"student state mismatch: {missing[:3]} {unexpected[:3]}"
    if tied:
        model.tie_weights()
    model.requires_grad_(False)
    chosen = []
    for pname, p in model.named_parameters():
        leaf = pname.rpartition(".")[2]
        if leaf in ("u", "v") and (train == "factors" or leaf == train):
            p.requires_grad_(True)
            chosen.append(pname)
    return model.train(), chosen


def load_teacher(path: Path) -> nn.Module:
    """The dense model in float32, frozen."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa",
                                                              dtype=torch.float32)
    return model.eval().requires_grad_(False)


def student_tensors(model: nn.Module, tied: bool) -> dict[str, torch.Tensor]:
    """The student's weights under the decomposed folder's names (a tied head left out)."""
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
            if not (tied and k == "lm_head.weight")}


def tokenizer_fingerprint(folder: Path) -> str | None:
    """What makes two tokenizers the same: the SHA-256 of ``tokenizer.json`` (None without one)."""
    f = Path(folder) / "tokenizer.json"
    return sha256(f) if f.is_file() else None
