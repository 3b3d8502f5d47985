"""A model folder as a plain single-process Hugging Face model: what a user would write.

Every decomposed matrix becomes a :class:`FactorLinears` — two ``nn.Linear`` (``V`` then ``U``,
the bias on ``U``) — and every dense block stays the ``nn.Linear`` the model class makes, so
the model runs on transformers alone, nothing of this project in its forward. One builder,
three users:

- the reference the project is measured against (``bench --peers hf``,
  ``scripts/heal_reference.py``): the factors frozen, eval mode;
- the one-process ``heal`` student (``healing.hf_student``): ``trainable`` picks what trains
  (factors, every block matrix, or everything), and :func:`folder_tensors` gives the healed
  weights back under the folder's names;
- with ``multiply_out``, the dense model DeepSpeed AutoTP shards (``bench --peers deepspeed``):
  AutoTP knows ``nn.Linear`` but mis-shards a factor pair's second factor.

The factors are ``nn.Linear`` rather than bare ``u``/``v`` parameters because the peer is the
model a user of transformers would write (and the bench reports it as such); the folder's names
and the model's differ only inside a factor pair, in one table (``_FACTOR_NAMES``), read both
ways. The model is made without initialising its weights (they are all loaded next; untouched
pages are never resident, so a dense matrix that a factor pair replaces costs no memory) and
loaded with ``assign``, in float32 unless a ``dtype`` is asked for (the bench's bfloat16 peers):
each tensor is cast once as it is read, as ``from_pretrained(dtype=...)`` casts, and a
multiplied-out ``U·V`` is formed in float32 before its cast. Transformers keeps its rotary
frequencies in float32 either way.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from deinfer_megatron.checkpoints.folder import ModelFolder, open_model

TRAINABLE = ("all", "linear", "factors", "u", "v")  # what a trainable model trains
# A factor pair's tensors: the folder's leaf name → the parameter of FactorLinears that holds it.
_FACTOR_NAMES = {"u": "u.weight", "v": "v.weight", "bias": "u.bias"}
_CHOSEN = {"factors": ("u.weight", "v.weight"), "u": ("u.weight",), "v": ("v.weight",)}


class FactorLinears(nn.Module):
    """``y = U (V x) + b`` as ``v`` (in → r, no bias) then ``u`` (r → out, with the bias).

    Made on the meta device (shapes only); its weights are loaded with ``assign``."""

    def __init__(self, in_features: int, rank: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.v = nn.Linear(in_features, rank, bias=False, device="meta")
        self.u = nn.Linear(rank, out_features, bias=bias, device="meta")

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


def _read(source: Any, name: str, own: bool = False, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor of the folder in ``dtype``; ``own``: never the source's own tensor object (a
    Megatron checkpoint's source holds whole tensors, which training in place would change)."""
    item = source[name]
    if isinstance(item, torch.Tensor):
        return item.to(dtype, copy=own)
    return item[:].to(dtype)  # a lazy safetensors slice reads into new memory


def _model_name(name: str, factored: set[str]) -> str:
    """The model's parameter for the folder's tensor ``name``."""
    module, _, leaf = name.rpartition(".")
    return f"{module}.{_FACTOR_NAMES[leaf]}" if module in factored else name


def hf_model(folder: Path | ModelFolder, *, multiply_out: bool = False, verify: bool = True,
             trainable: str | None = None, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The folder as a Hugging Face causal LM in ``dtype`` (float32 by default).

    Args:
        folder: a decomposed or dense model folder (path or opened).
        multiply_out: give each decomposed matrix as one ``nn.Linear`` of ``U·V`` (the product
            in float32, then cast to ``dtype``) instead of a :class:`FactorLinears`.
        verify: check the folder's manifest when it is opened here.
        trainable: None — eval mode, every gradient off (a model to run); otherwise train mode
            with gradients on for: ``"all"`` every parameter; ``"linear"`` every matrix of the
            decoder layers, factors and matrices kept dense, with their biases (embeddings, head
            and norms frozen); ``"factors"``, ``"u"`` or ``"v"`` the weights of both factors of
            every pair, only the ``U``s or only the ``V``s (biases, embeddings, norms and the
            matrices kept dense frozen). Each factor is the model's own copy.
        dtype: what every parameter is cast to, once, as it is read (``torch.float32`` or
            ``torch.bfloat16``).

    Raises:
        ValueError: an unknown ``trainable``, or one with ``multiply_out`` (nothing left to train);
            the folder's tensors do not fit the model class.
    """
    import transformers

    if trainable is not None and trainable not in TRAINABLE:
        raise ValueError(f"unknown trainable selection {trainable!r}; choose one of {', '.join(TRAINABLE)}")
    if trainable is not None and multiply_out:
        raise ValueError("multiply_out leaves no factors to train; build the model without it to train them")
    opened = folder if isinstance(folder, ModelFolder) else open_model(folder, verify=verify)
    config = transformers.AutoConfig.from_pretrained(opened.path)
    with _weights_not_initialised():
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    modules = dict(model.named_modules())
    source, factored = opened.source, set(opened.rank_config.modules)
    state = {}
    for name in factored:
        u, v = _read(source, f"{name}.u", trainable is not None), _read(source, f"{name}.v", trainable is not None)
        if multiply_out:
            state[f"{name}.weight"] = (u @ v).to(dtype)
        else:
            u, v = u.to(dtype), v.to(dtype)
            parent, _, leaf = name.rpartition(".")
            setattr(modules[parent], leaf, FactorLinears(v.shape[1], v.shape[0], u.shape[0], f"{name}.bias" in source))
            state[_model_name(f"{name}.u", factored)], state[_model_name(f"{name}.v", factored)] = u, v
    factors = {f"{name}.{leaf}" for name in factored for leaf in ("u", "v")}
    renamed = set() if multiply_out else factored  # a multiplied-out matrix keeps its bias's own name
    state.update((_model_name(k, renamed), _read(source, k, dtype=dtype)) for k in source if k not in factors)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    tied = opened.arch.tied_embeddings
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{opened.path}: its tensors do not fit {type(model).__name__} "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]}); re-create the folder")
    if tied:
        model.tie_weights()
    model.requires_grad_(trainable == "all")
    if trainable is None:
        return model.eval()
    if trainable == "linear":  # a factor pair's two halves are nn.Linear too
        for module in model.model.layers.modules():
            if isinstance(module, nn.Linear):
                module.requires_grad_(True)
    elif trainable in _CHOSEN:
        for module in model.modules():
            if isinstance(module, FactorLinears):
                for pname, param in module.named_parameters():
                    param.requires_grad_(pname in _CHOSEN[trainable])
    return model.train()


def folder_tensors(model: nn.Module, folder: ModelFolder) -> dict[str, torch.Tensor]:
    """Every tensor of ``folder`` taken from ``model`` (built from it by :func:`hf_model`, without
    ``multiply_out``), under the folder's names: what a healed folder is written from."""
    held = model.state_dict(keep_vars=True)
    factored = set(folder.rank_config.modules)
    return {name: held[_model_name(name, factored)].detach().clone().contiguous() for name in folder.source}
