"""Decompose a dense model into ``W ≈ U·V`` factors and write a decomposed model folder.

Order of work, per layer: (1) the statistics of the inputs of q/k/v, then o, then gate/up,
then down are collected *sequentially* — each from the layer with its earlier matrices already
replaced by their factor products, and from hidden states produced by the already-decomposed
earlier layers — so that errors do not compound unseen; (2) each matrix is factorised by the
chosen method at its rank; (3) the decomposed layer produces the next layer's input.
``sequential=False`` instead takes every statistic from the dense model (one-shot).

Ranks come from a rank config, or from ``ratio`` with the uniform, variadic or fisher rule;
the variadic and fisher rules first measure every matrix's truncation loss on the dense model
(fisher also each matrix's end-to-end sensitivity, decompose/sensitivity.py). Every rule may
keep whole blocks dense (decompose/allocation.py): their matrices are neither factorised nor
changed, and are written as their original ``.weight``.

``update="sequential"`` refits each matrix's factors after its truncation (U, then V: closed-form
least squares against the dense model's output, decompose/update.py). For that the dense model's
own stream of hidden states runs beside the decomposed one, layer by layer, and the inputs each
group of matrices reads there are kept for the layer's duration (one tensor per batch).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch
from torch import nn
from tqdm import tqdm

from deinfer_megatron.decompose.allocation import BREAK_EVEN_FRACTION, blocks, layer_of, uniform_allocation, variadic_ranks
from deinfer_megatron.decompose.calibration import InputStats, LayerRunner, capture, collect, record_inputs
from deinfer_megatron.decompose.fisher_allocation import fisher_ranks
from deinfer_megatron.decompose.factorize import ASVD_ALPHA, Scaling, prepare, scaling, spectrum, truncation_loss
from deinfer_megatron.decompose.sensitivity import output_fisher
from deinfer_megatron.decompose.update import UPDATE_DAMP, Regression
from deinfer_megatron.arch.model import ModelArch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """What to decompose and how."""

    method: str  # "svd" | "asvd" | "svd-llm"
    ranks: Mapping[str, int] | None  # explicit ranks, or None to allocate from ratio
    ratio: float | None
    allocation: str  # "uniform" | "variadic" | "fisher"
    layers: frozenset[int]  # layers whose matrices are decomposed (with ratio)
    sequential: bool = True
    asvd_alpha: float = ASVD_ALPHA
    update: str = "none"  # "none" | "sequential" (decompose/update.py)
    update_damp: float = UPDATE_DAMP  # the update's λ, a fraction of mean(diag(XᵀX))


def _groups(arch: ModelArch, layer: int) -> list[list[str]]:
    """Matrices of one layer that read the same input, in the order the layer runs them: q/k/v,
    o, the MLP's input projections (gate and up, or fc1), its output projection."""
    attn, mlp = arch.attention_modules(layer), list(arch.mlp_modules(layer).values())
    return [[attn["q"], attn["k"], attn["v"]], [attn["o"]], mlp[:-1], mlp[-1:]]


def _scaling(method: str, stats: InputStats | None, alpha: float = ASVD_ALPHA) -> Scaling:
    """The method's scaling of one group's input (asvd and svd-llm fail without statistics)."""
    if stats is None:
        return scaling(method, alpha=alpha)
    return scaling(method, gram=stats.gram, abs_mean=stats.abs_mean, alpha=alpha)


def _layer_stats(
    runner: LayerRunner, layer: int, hidden: list[torch.Tensor], groups: list[list[str]], modules: Mapping[str, nn.Module]
) -> tuple[dict[str, InputStats], list[torch.Tensor]]:
    """One pass of the (unchanged) layer: input statistics of every group, and its outputs."""
    firsts = {g[0]: modules[g[0]] for g in groups}
    outputs: list[torch.Tensor] = []
    with torch.no_grad(), capture(firsts) as stats:
        for h in hidden:
            outputs.append(runner.run_layer(layer, h))
    return {name: stats[g[0]] for g in groups for name in g}, outputs


@dataclass
class Curves:
    """Truncation-loss curves on the dense model (one-shot statistics): ``losses[name][k]`` the
    (scaled) output error of keeping rank k, ``energy[layer]`` the mean squared norm of the
    residual stream entering the layer (1 without data)."""

    losses: dict[str, torch.Tensor]
    energy: dict[int, float]


def measure_losses(
    model: nn.Module, arch: ModelArch, method: str, targets: Iterable[str], hidden: list[torch.Tensor] | None,
    alpha: float = ASVD_ALPHA,
) -> Curves:
    """Truncation-loss curves of every target matrix on the dense model (without data: the
    plain spectra), and the energy of the residual stream entering each layer."""
    modules = dict(model.named_modules())
    targets = set(targets)
    runner = LayerRunner(model) if hidden is not None else None
    curves = Curves({}, {})
    for layer in tqdm(range(arch.num_layers), desc="measuring spectra", leave=False):
        groups = [g for g in _groups(arch, layer) if g[0] in targets]
        stats: dict[str, InputStats] = {}
        curves.energy[layer] = 1.0
        if runner is not None and hidden is not None:
            tokens = sum(h[..., 0].numel() for h in hidden)
            curves.energy[layer] = sum(h.double().pow(2).sum().item() for h in hidden) / tokens
            stats, hidden = _layer_stats(runner, layer, hidden, _groups(arch, layer), modules)
        for group in groups:
            scale = _scaling(method, stats.get(group[0]), alpha)
            for name in group:
                curves.losses[name] = truncation_loss(spectrum(modules[name].weight, scale))
    return curves


def allocate(
    plan: Plan, arch: ModelArch, curves: Callable[[], Curves],
    sensitivity: Callable[[list[str]], dict[str, float]] | None = None,
) -> dict[str, int]:
    """The rank of every matrix to decompose; matrices of blocks kept dense are absent.

    ``variadic`` compares curves divided by their layer's residual energy, per kind of matrix;
    ``fisher`` the raw curves times each matrix's sensitivity (``sensitivity(names)``), in one
    budget. Explicit ranks (a rank config) are taken as given, even at break-even: the user
    chose them (a full-rank decomposition is how losslessness is checked)."""
    if plan.ranks is not None:
        return dict(plan.ranks)
    assert plan.ratio is not None, "a plan without ranks has a ratio"
    shapes = {n: s for n, s in arch.linear_shapes().items() if layer_of(arch, n) in plan.layers}
    groups = blocks(arch, shapes)
    if plan.allocation == "uniform":
        return uniform_allocation(shapes, groups, plan.ratio)
    measured = curves()
    if plan.allocation == "fisher":
        assert sensitivity is not None, "the fisher allocation needs calibration data (checked by the job)"
        return fisher_ranks(measured.losses, sensitivity(list(shapes)), shapes, plan.ratio, groups)
    scaled = {n: c / measured.energy[layer_of(arch, n)] for n, c in measured.losses.items()}
    return variadic_ranks(scaled, shapes, plan.ratio, groups)


def decompose_model(
    model: nn.Module, arch: ModelArch, plan: Plan, calib: torch.Tensor | None, *, batch: int = 8
) -> tuple[dict[str, int], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Factorise ``model`` in place (its weights become ``U·V``) and return ranks and factors.

    Args:
        calib: ``[n, seq]`` calibration token ids (None for plain ``svd`` with uniform ranks).
    """
    runner = LayerRunner(model) if calib is not None else None
    embed = (lambda: [runner.embed(c) for c in calib.split(batch)]) if runner else (lambda: None)
    sensitivity = (lambda names: output_fisher(model, calib, names)) if calib is not None else None
    with torch.no_grad():
        ranks = allocate(
            plan, arch,
            lambda: measure_losses(model, arch, plan.method, _targets(arch, plan), embed(), plan.asvd_alpha),
            sensitivity,
        )
        if not ranks:
            raise ValueError(nothing_to_decompose(plan.ratio))
        hidden = embed()
    if plan.update != "none" and hidden is None:
        raise ValueError(f"--update {plan.update} needs calibration data: pass --calib-text FILE or --calib-self N")
    # the dense model's stream beside the decomposed one: the update's targets (sequential only;
    # one-shot statistics come from the dense model already)
    reference = list(hidden) if plan.update != "none" and plan.sequential and hidden is not None else None
    modules = dict(model.named_modules())
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in tqdm(range(arch.num_layers), desc=f"decomposing ({plan.method})"):
        groups = [g for g in _groups(arch, layer) if g[0] in ranks]
        one_shot: dict[str, InputStats] = {}
        dense_inputs: dict[str, list[torch.Tensor]] = {}
        if runner is not None and hidden is not None and not plan.sequential:
            one_shot, next_hidden = _layer_stats(runner, layer, hidden, _groups(arch, layer), modules)
        if runner is not None and reference is not None:  # before the layer changes
            dense_inputs, reference = record_inputs(runner, layer, reference, {g[0]: modules[g[0]] for g in groups})
        for group in groups:
            stats = one_shot.get(group[0])
            if runner is not None and hidden is not None and plan.sequential:
                first = group[0]
                refs = {first: dense_inputs[first]} if dense_inputs else None
                stats = collect(runner, layer, hidden, {first: modules[first]}, stop_after=first, references=refs)[first]
            scale = _scaling(plan.method, stats, plan.asvd_alpha)
            regression = _regression(plan, scale, stats)
            for name in group:
                lin = modules[name]
                u, v = prepare(lin.weight, scale).factors(ranks[name], dtype=torch.float64)
                if regression is not None:
                    u, v = regression.sequential(lin.weight, u, v)
                u, v = u.to(lin.weight.dtype).contiguous(), v.to(lin.weight.dtype).contiguous()
                factors[name] = (u, v)
                with torch.no_grad():
                    lin.weight.copy_(u @ v)
        if runner is not None and hidden is not None:
            if plan.sequential:
                with torch.no_grad():
                    hidden = [runner.run_layer(layer, h) for h in hidden]
            else:
                hidden = next_hidden
    return ranks, factors


def _regression(plan: Plan, scale: Scaling, stats: InputStats | None) -> Regression | None:
    """The update's statistics of one input (None without ``--update``); undamped svd-llm reuses
    its own whitening, every other case whitens the damped Gram matrix for the update."""
    if plan.update == "none":
        return None
    assert stats is not None, "the update runs on calibration statistics (checked before)"
    if plan.method == "svd-llm" and plan.update_damp == 0:
        return Regression(scale, stats.cross)
    return Regression.of(stats.gram, stats.cross, plan.update_damp)


def nothing_to_decompose(ratio: float | None) -> str:
    return (f"--ratio {ratio:g} keeps every block dense (factors would hold at least "
            f"{BREAK_EVEN_FRACTION:.0%} of the dense parameters): nothing to decompose; use a lower --ratio")


def _targets(arch: ModelArch, plan: Plan) -> list[str]:
    prefix = len(arch.layer_prefix) + 1
    return [n for n in arch.linear_shapes() if int(n[prefix:].split(".")[0]) in plan.layers]


def decomposed_state(
    model: nn.Module, factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]], tied: bool
) -> dict[str, torch.Tensor]:
    """Hugging Face names: dense weights as they are, decomposed ones as ``.u``/``.v``."""
    out = {}
    for name, tensor in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if module in factors and leaf == "weight":
            out[f"{module}.u"], out[f"{module}.v"] = factors[module]
        elif not (tied and name == "lm_head.weight"):
            out[name] = tensor.detach().clone()
    return out
