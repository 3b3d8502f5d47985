"""``deinfer-megatron demo``: the three layouts side by side on a small decomposed model.

Starts TP local ranks, builds a randomly initialised LLaMA-shaped model (``llama-tiny``) with
uniform ranks in all but its last layer (a mixed model), runs one forward in every layout, and
prints the plan, the collectives each layout really issued, and the parity of its logits with a
single-process Hugging Face model whose weights are the factors multiplied out.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch

from deinfer_megatron.launch.local import spawn_local

DEMO_MODEL = "llama-tiny"
DEMO_RATIO = 0.6


@dataclass(frozen=True)
class DemoConfig:
    tp: int = 2
    seed: int = 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="compare the layouts on a small decomposed model")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(make_config=lambda a: DemoConfig(a.tp, a.seed), run=main)


def _setup(seed: int) -> tuple[Any, Any, dict, torch.Tensor]:
    from deinfer_megatron.decompose.allocation import uniform_ranks
    from deinfer_megatron.models.synthetic import random_state, synthetic_arch
    from deinfer_megatron.specs.rank_config import RankConfig

    arch = synthetic_arch(DEMO_MODEL)
    ranks = uniform_ranks(arch, DEMO_RATIO, layers=range(arch.num_layers - 1))
    rank_config = RankConfig.from_mapping(ranks, arch)
    state = random_state(arch, ranks, seed=seed)
    ids = torch.randint(0, arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    return arch, rank_config, state, ids


def _rank(tp: int, seed: int) -> dict[str, Any]:
    from deinfer_megatron.models.build import build_stage, load_weights
    from deinfer_megatron.parallel import comm
    from deinfer_megatron.parallel.pipeline import stage_forward
    from deinfer_megatron.parallel.runtime import init_parallel, shutdown
    from deinfer_megatron.specs.layout import Layout

    groups = init_parallel(tp, 1)
    arch, rank_config, state, ids = _setup(seed)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    out = {}
    try:
        for layout in Layout:
            stage = build_stage(arch, rank_config, layout, groups)
            load_weights(stage, state, rank_config)
            with comm.recording() as ledger:
                logits = stage_forward(stage, ids, pos)
            out[layout.value] = {
                "logits": logits if groups.tp_rank == 0 else None,
                "collectives": len(ledger.records),
                "elements_per_token": sum(r.elements_per_token for r in ledger.records),
            }
    finally:
        shutdown()
    return out


def _reference_logits(arch: Any, rank_config: Any, state: dict, ids: torch.Tensor) -> torch.Tensor:
    import transformers

    from deinfer_megatron.checkpoints.loader import MultipliedOut
    from deinfer_megatron.models.synthetic import synthetic_config

    cfg = transformers.AutoConfig.for_model(**synthetic_config(DEMO_MODEL))
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    dense = MultipliedOut(state, rank_config)
    model.load_state_dict({k: dense[k] for k in dense}, strict=True)
    with torch.no_grad():
        return model(ids).logits


def main(cfg: DemoConfig) -> int:
    from deinfer_megatron.planning.plan import make_plan
    from deinfer_megatron.planning.report import format_plans

    arch, rank_config, state, ids = _setup(cfg.seed)
    plans = [make_plan(arch, rank_config, layout, tp=cfg.tp) for layout in ("dense", "naive", "deinfer")]
    print(f"== {DEMO_MODEL}: {arch.num_layers} layers, hidden {arch.hidden_size}, "
          f"ratio {DEMO_RATIO} in layers 0..{arch.num_layers - 2}, TP={cfg.tp}\n")
    print(format_plans(plans))
    results = spawn_local(cfg.tp, _rank, cfg.tp, cfg.seed)[0]
    ref = _reference_logits(arch, rank_config, state, ids)
    scale = ref.abs().max().item()
    print(f"\n== one forward of {ids.shape[0]}x{ids.shape[1]} tokens on {cfg.tp} ranks "
          "vs the multiplied-out Hugging Face model (single process)")
    print(f"{'layout':<8} {'collectives':>11} {'plan':>5} {'elem/token':>10} {'plan':>6} "
          f"{'max|dlogit|':>12} {'greedy equal':>12}")
    ok = True
    for plan in plans:
        r = results[plan.layout]
        diff = (r["logits"] - ref).abs().max().item()
        same = bool((r["logits"].argmax(-1) == ref.argmax(-1)).all())
        ok &= diff <= 1e-4 * max(scale, 1.0) and same
        print(f"{plan.layout:<8} {r['collectives']:>11} {plan.totals['collectives_per_token']:>5} "
              f"{r['elements_per_token']:>10} {plan.totals['elements_per_token']:>6} "
              f"{diff:>12.2e} {str(same):>12}")
    print("\nparity " + ("OK" if ok else "FAILED") + f" (tolerance 1e-4 × logit scale {scale:.2f})")
    return 0 if ok else 1
