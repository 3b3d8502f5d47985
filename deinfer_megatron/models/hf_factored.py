"""A model folder as a plain single-process Hugging Face model: what a user would write.

Every decomposed matrix becomes a :class:`FactorLinears` — two ``nn.Linear`` (``V`` then ``U``,
the bias on ``U``) — and every dense block stays the ``nn.Linear`` the model class makes, so
the model runs on transformers alone, nothing of this project in its forward. It is the
reference the project is measured against (``bench --peers hf``, ``scripts/heal_reference.py``)
and, with ``multiply_out``, the dense model DeepSpeed AutoTP shards (``bench --peers
deepspeed``): AutoTP knows ``nn.Linear`` but mis-shards a factor pair's second factor.

The model is made without initialising its weights (they are all loaded next; untouched pages
are never resident, so a dense matrix that a factor pair replaces costs no memory) and loaded
with ``assign``, in float32.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from deinfer_megatron.checkpoints.folder import ModelFolder, open_model


class FactorLinears(nn.Module):
    """``y = U (V x) + b`` as ``v`` (in → r, no bias) then ``u`` (r → out, with the bias)."""

    def __init__(self, u: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.v = nn.Linear(v.shape[1], v.shape[0], bias=False, device="meta")
        self.u = nn.Linear(u.shape[1], u.shape[0], bias=bias is not None, device="meta")
        self.v.weight = nn.Parameter(v.float().contiguous())
        self.u.weight = nn.Parameter(u.float().contiguous())
        if bias is not None:
            self.u.bias = nn.Parameter(bias.float().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.u(self.v(x))


@contextmanager
def _weights_not_initialised() -> Iterator[None]:
    """transformers' own switch (moved between releases); a plain init where neither exists."""
    try:
        from transformers.initialization import no_init_weights  # transformers ≥ 5
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights  # transformers 4.x
        except ImportError:
            no_init_weights = None
    if no_init_weights is None:
        yield
    else:
        with no_init_weights():
            yield


def _read(source: Any, name: str) -> torch.Tensor:
    item = source[name]
    return (item if isinstance(item, torch.Tensor) else item[:]).float()


def hf_model(folder: Path | ModelFolder, *, multiply_out: bool = False, verify: bool = True) -> nn.Module:
    """The folder as a float32 Hugging Face causal LM in eval mode, gradients off.

    Args:
        folder: a decomposed or dense model folder (path or opened).
        multiply_out: give each decomposed matrix as one ``nn.Linear`` of ``U·V`` (float32)
            instead of a :class:`FactorLinears`.
        verify: check the folder's manifest when it is opened here.
    """
    import transformers

    opened = folder if isinstance(folder, ModelFolder) else open_model(folder, verify=verify)
    config = transformers.AutoConfig.from_pretrained(opened.path)
    with _weights_not_initialised():
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    modules = dict(model.named_modules())
    source, state = opened.source, {}
    factored = set(opened.rank_config.modules)
    for name in factored:
        u, v = _read(source, f"{name}.u"), _read(source, f"{name}.v")
        bias = _read(source, f"{name}.bias") if f"{name}.bias" in source else None
        if multiply_out:
            state[f"{name}.weight"] = u @ v
            if bias is not None:
                state[f"{name}.bias"] = bias
        else:
            parent, _, leaf = name.rpartition(".")
            setattr(modules[parent], leaf, FactorLinears(u, v, bias))
    state.update((k, _read(source, k)) for k in source if k.rpartition(".")[0] not in factored)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    tied = opened.arch.tied_embeddings
    missing = [k for k in missing if not (tied and k == "lm_head.weight")
               and k.rpartition(".")[0].rpartition(".")[0] not in factored]  # FactorLinears hold theirs
    if missing or unexpected:
        raise ValueError(f"{opened.path}: its tensors do not fit {type(model).__name__} "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]}); re-create the folder")
    if tied:
        model.tie_weights()
    return model.eval().requires_grad_(False)
