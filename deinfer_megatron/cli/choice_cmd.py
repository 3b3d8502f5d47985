"""``deinfer-megatron eval-choice``: zero-shot multiple-choice accuracy of a model (acc and
acc_norm, as lm-evaluation-harness scores them), in any layout and TP/PP."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from deinfer_megatron.cli.arguments import add_inference_layout
from deinfer_megatron.cli.output import emit_json
from deinfer_megatron.evaluation.choice import ChoiceJob, evaluate_choices
from deinfer_megatron.evaluation.items import SHIPPED_ITEMS


@dataclass(frozen=True)
class ChoiceConfig:
    """What ``eval-choice`` was asked for: the job, whether stdout is one JSON document, and
    whether that document lists every item's log-likelihoods."""

    job: ChoiceJob
    json: bool = False
    per_item: bool = False


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval-choice", help="zero-shot multiple-choice accuracy (acc, acc_norm)")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--items", type=Path, default=SHIPPED_ITEMS,
                   help="JSON lines of {context, choices, answer[, category]} (default: the set the "
                        "project ships, docs/EVALUATION.md)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--batch-tokens", type=int, default=ChoiceJob.batch_tokens,
                   help="padded token rows per forward (default %(default)s); lower it when the memory "
                        "check refuses")
    add_inference_layout(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("--per-item", action="store_true",
                   help="with --json: every item's log-likelihoods and predictions")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="load a decomposed folder made elsewhere, without its manifest")
    p.set_defaults(make_config=config_from_args, run=main)


def config_from_args(a: argparse.Namespace) -> ChoiceConfig:
    if a.per_item and not a.json:
        raise ValueError("--per-item applies to --json; add --json")
    job = ChoiceJob(a.model, a.items, a.tp, a.pp, a.layout, a.batch_tokens, verify=a.verify)
    return ChoiceConfig(job, a.json, a.per_item)


def format_result(result: dict) -> str:
    """The text ``eval-choice`` prints: the overall accuracy, then one line per category."""
    lines = [f"acc {result['acc']:.4f}  acc_norm {result['acc_norm']:.4f}  over {result['items']} items "
             f"(chance {result['chance']:.4f}; {result['layout']}, TP={result['tp']}, PP={result['pp']})"]
    width = max(len(name) for name in result["categories"])
    lines += [f"  {name:<{width}}  {c['items']:>4} items  acc {c['acc']:.4f}  acc_norm {c['acc_norm']:.4f}"
              for name, c in result["categories"].items()]
    return "\n".join(lines)


def main(cfg: ChoiceConfig) -> int:
    result = evaluate_choices(cfg.job)
    if result is None:  # a rank other than 0 inside a launcher: rank 0 reports
        return 0
    if not cfg.per_item:
        result.pop("per_item")
    if cfg.json:
        emit_json(result)
    else:
        print(format_result(result))
    return 0
