"""``deinfer-megatron eval-ppl``: perplexity of a model over a text, in any layout and TP/PP."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from deinfer_megatron.cli.arguments import add_inference_layout, names, parsed_by
from deinfer_megatron.cli.output import emit_json
from deinfer_megatron.evaluation.perplexity import PerplexityJob, evaluate
from deinfer_megatron.runtime.options import DType


@dataclass(frozen=True)
class EvalConfig:
    """What ``eval-ppl`` was asked for: the job, and whether stdout is one JSON document."""

    job: PerplexityJob
    json: bool = False


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval-ppl", help="perplexity over non-overlapping windows of a text")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--text", type=Path, required=True)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--batch", type=int, default=PerplexityJob.batch,
                   help="windows per forward (default %(default)s); lower it when the memory check refuses")
    add_inference_layout(p)
    p.add_argument("--dtype", type=parsed_by(DType.parse), choices=names(DType), default=DType.FLOAT32,
                   help="precision of the weights, factors and activations; the loss is taken in float32 "
                        "and summed in float64 either way (default float32)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="load a decomposed folder made elsewhere, without its manifest")
    p.set_defaults(make_config=lambda a: EvalConfig(PerplexityJob(
        a.model, a.text, a.max_tokens, a.window, a.tp, a.pp, a.layout, a.batch, verify=a.verify,
        dtype=a.dtype), a.json),
        run=main)


def main(cfg: EvalConfig) -> int:
    job = cfg.job
    result = evaluate(job)
    if result is None:  # a rank other than 0 inside a launcher: rank 0 reports
        return 0
    if cfg.json:
        emit_json(result)
    else:
        print(f"perplexity {result['ppl']:.4f} over {result['tokens']} tokens in {result['windows']} "
              f"windows ({result['layout']}, TP={job.tp}, PP={job.pp}, {job.dtype.value})")
    return 0
