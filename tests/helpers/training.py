"""Gradient and training checks run inside each spawned rank, and their single-process
reference: a Hugging Face model whose decomposed matrices are ``nn.Linear`` factor pairs
(``V`` then ``U``), trained by plain PyTorch — nothing of deinfer_megatron in it.

The expected gradient of each local parameter is the reference's full gradient cut by that
parameter's own loader (``load_weights`` of a second stage from the gradients), the way the
parameter's weight was cut from the full weight: a slice's gradient is the slice of the
gradient, padding rows expect zero, replicated copies expect the whole.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deinfer_megatron.specs.layout import Layout
from tests.helpers.parity import DECOMPOSED_LAYERS
from tests.helpers.tiny_models import decompose_randomly, mixed_ranks, random_hf_model

BATCH, SEQ = 2, 9
# eps 1e-3: Adam's first update is sign(g) for |g| ≫ eps, which would turn the last-bit noise
# of gradients that are zero in exact maths (the K bias's) into whole steps that differ
# between two correct implementations.
STEPS = dict(lr=1e-2, warmup_steps=1, total_steps=4, clip_grad=0.5, weight_decay=0.1, eps=1e-3)


class FactorPair(nn.Module):
    """``U (V x) + b`` as two ``nn.Linear``s: what a user would write."""

    def __init__(self, u: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.v = nn.Linear(v.shape[1], v.shape[0], bias=False, dtype=v.dtype)
        self.u = nn.Linear(u.shape[1], u.shape[0], bias=bias is not None, dtype=u.dtype)
        with torch.no_grad():
            self.v.weight.copy_(v)
            self.u.weight.copy_(u)
            if bias is not None:
                self.u.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.u(self.v(x))


def kv_heads(family: str, hf: Any) -> int:
    return hf.config.num_key_value_heads if family != "opt" else hf.config.num_attention_heads


def case(family: str, tp: int) -> dict[str, Any]:
    """The tiny model of ``family`` (float64), its variadic ranks (layer 1 dense; every
    attention decomposed when there are fewer KV heads than ranks), the decomposed state, the
    dense state (``W = U·V``), the factor-pair reference and the token ids and labels."""
    hf = random_hf_model(family)
    ranks = mixed_ranks(hf, DECOMPOSED_LAYERS)
    if kv_heads(family, hf) < tp:
        ranks.update((n, r) for n, r in mixed_ranks(hf, list(range(hf.config.num_hidden_layers))).items()
                     if ".self_attn." in n)
    state = decompose_randomly(hf, ranks)  # hf now holds W = U·V
    hf = hf.double()
    hf.config._attn_implementation = "sdpa"  # eager attention runs its softmax in float32
    state = {k: v.double() for k, v in state.items()}
    dense_state = {k: v.clone() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        dense_state.pop("lm_head.weight", None)
    factored = copy.deepcopy(hf)
    modules = dict(factored.named_modules())
    for name in ranks:
        parent, _, child = name.rpartition(".")
        setattr(modules[parent], child,
                FactorPair(state[f"{name}.u"], state[f"{name}.v"], state.get(f"{name}.bias")))
    gen = torch.Generator().manual_seed(11)
    vocab = hf.config.vocab_size
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    return dict(ranks=ranks, state=state, dense_state=dense_state, dense=hf, factored=factored,
                ids=ids, labels=labels)


def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), labels.reshape(-1))


def reference_gradients(model: nn.Module, ranks: dict[str, int], ids: torch.Tensor,
                        labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Hugging Face-named full gradients (``<m>.u``/``<m>.v``/``<m>.bias`` for factor pairs)."""
    model = copy.deepcopy(model).train()
    model.zero_grad()
    loss_of(model(ids).logits, labels).backward()
    out = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        module, _, leaf = name.rpartition(".")
        owner, _, role = module.rpartition(".")
        if owner in ranks:  # <m>.u.weight → <m>.u ; <m>.v.weight → <m>.v ; <m>.u.bias → <m>.bias
            out[f"{owner}.{role}" if leaf == "weight" else f"{owner}.bias"] = g.clone()
        else:
            out[name] = g.clone()
    if model.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def cosine_lr(step: int, lr: float, warmup_steps: int, total_steps: int, min_lr: float = 0.0) -> float:
    """Linear warm-up then cosine, at optimizer step ``step`` (1-based)."""
    if warmup_steps and step <= warmup_steps:
        return lr * step / warmup_steps
    ratio = (step - warmup_steps) / (total_steps - warmup_steps)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (lr - min_lr)


def reference_steps(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, steps: int) -> list[tuple[float, float]]:
    """(loss, grad norm) of ``steps`` AdamW steps with clipping and the schedule, in plain torch."""
    model = copy.deepcopy(model).train()
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, lr=STEPS["lr"], weight_decay=STEPS["weight_decay"], eps=STEPS["eps"])
    out = []
    for n in range(1, steps + 1):
        opt.zero_grad()
        loss = loss_of(model(ids).logits, labels)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, STEPS["clip_grad"])
        for group in opt.param_groups:
            group["lr"] = cosine_lr(n, STEPS["lr"], STEPS["warmup_steps"], STEPS["total_steps"])
        opt.step()
        out.append((float(loss), float(norm)))
    return out


def _gradient_errors(grads: dict[str, torch.Tensor], expected: Any) -> dict[str, tuple[float, float]]:
    """Per parameter: (‖grad − expected‖, ‖expected‖)."""
    out = {}
    for name, p in expected.model.named_parameters():
        e = p.detach()
        out[name] = (float((grads[name] - e).norm()), float(e.norm()))
    return out


def _padding(stage: Any) -> list[float]:
    """Largest |value| in the zero-padding columns of every merged V on this rank."""
    from deinfer_megatron.layers.factors import GatheredDown

    out = []
    for module in stage.model.modules():
        if isinstance(module, GatheredDown):
            lo = module.tp.rank * module.chunk
            real = max(0, min(sum(module.section_ranks) - lo, module.chunk))
            if real < module.chunk:
                out.append(float(module.weight.detach()[:, real:].abs().max()))
    return out


def training_worker(sizes: list[tuple[int, int]], families: list[str], layouts: list[str],
                    steps: int) -> dict[tuple[int, int], dict[str, Any]]:
    """``_one_size`` for each (TP, PP) of ``sizes`` (all of this world's size) in turn: one
    launch serves several parallel shapes."""
    from deinfer_megatron.parallel.runtime import shutdown

    try:
        return {(tp, pp): _one_size(tp, pp, families, layouts, steps) for tp, pp in sizes}
    finally:
        shutdown()


def _one_size(tp: int, pp: int, families: list[str], layouts: list[str], steps: int) -> dict[str, Any]:
    """Per family and layout: gradient errors of every parameter, the ledger's backward
    collectives, and the losses and gradient norms of ``steps`` optimizer steps."""
    from deinfer_megatron.arch.model import arch_from_hf_config
    from deinfer_megatron.models.build import build_stage, load_weights
    from deinfer_megatron.parallel import comm
    from deinfer_megatron.parallel.runtime import init_parallel
    from deinfer_megatron.specs.rank_config import RankConfig
    from deinfer_megatron.training import OptimizerConfig, Trainer, select_parameters

    groups = init_parallel(tp, pp)  # Megatron's groups are rebuilt for each shape
    out: dict[str, Any] = {"tp_rank": groups.tp_rank, "pp_rank": groups.pp_rank, "results": {}}
    for family in families:
        c = case(family, tp)
        arch = arch_from_hf_config(c["dense"].config.to_dict())
        rank_config = RankConfig.from_mapping(c["ranks"], arch)
        batch = [{"input_ids": c["ids"], "labels": c["labels"]}]

        def loss_fn(logits: torch.Tensor, mb: dict) -> torch.Tensor:
            return loss_of(logits, mb["labels"].to(logits.device))

        for layout in layouts:
            if layout == "dense" and kv_heads(family, c["dense"]) < tp:
                continue
            dense = layout == "dense"
            ref_ranks = {} if dense else c["ranks"]
            ref = reference_gradients(c["dense"] if dense else c["factored"], ref_ranks, c["ids"], c["labels"])
            source_ranks = RankConfig.dense(arch) if dense else rank_config

            stage = build_stage(arch, rank_config, Layout(layout), groups, dtype=torch.float64)
            stage.model.double()  # Megatron's norms are built in float32 whatever the dtype
            load_weights(stage, c["dense_state"] if dense else c["state"], source_ranks)
            trainer = Trainer(stage, OptimizerConfig(**STEPS))
            with comm.recording() as ledger:
                loss = trainer.compute_gradients(batch, loss_fn)
            grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                     for n, p in stage.model.named_parameters()}
            norm, _ = trainer.optimizer_step()
            trajectory = [(loss, norm)]
            for _ in range(steps - 1):
                r = trainer.step(batch, loss_fn)
                trajectory.append((r.loss, r.grad_norm))
            padding = _padding(stage)
            load_weights(stage, ref, source_ranks)  # the expected gradients, cut like the weights
            errors = _gradient_errors(grads, stage)
            if dense:
                try:
                    Trainer(stage, OptimizerConfig(**STEPS), train="factors")
                    selection: Any = "accepted"
                except ValueError as err:
                    selection = str(err)
            else:
                selection = {w: [n for n, _ in select_parameters(stage.model, w)] for w in ("u", "v", "linear", "all")}
            out["results"][f"{family}/{layout}"] = {
                "ranks": c["ranks"],
                "errors": errors,
                "backward": [(r.layer, r.kind, r.elements_per_token, r.tokens)
                             for r in ledger.phase("backward")],
                "forward": [(r.layer, r.kind, r.elements_per_token) for r in ledger.phase("forward")],
                "weight_grad": len(ledger.phase("weight_grad")),
                "trajectory": trajectory,
                "padding": padding,
                "layer_offset": stage.layer_offset,
                "selection": selection,
            }
    return out
