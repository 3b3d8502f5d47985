"""``deinfer-megatron heal``: distil a decomposed model towards its dense teacher."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from deinfer_megatron.decompose.calibration import ANSWERS, SELF_TEMPERATURE
from deinfer_megatron.healing.job import DTYPES, LAYOUTS, TRAINABLE, HealJob, run_heal
from deinfer_megatron.healing.loop import DISTILL


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("heal", help="distil a decomposed model towards the dense model it came from")
    p.add_argument("--model", type=Path, required=True, help="decomposed folder (the student)")
    p.add_argument("--teacher", type=Path, required=True, help="the dense Hugging Face folder it was decomposed from")
    p.add_argument("--calib-text", type=Path, nargs="+", default=(), metavar="FILE", help="text files to heal on")
    p.add_argument("--calib-self", type=int, metavar="N",
                   help="also heal on N conversations the teacher writes itself (chat format)")
    p.add_argument("--calib-temperature", type=float, metavar="T",
                   help=f"sampling temperature of the --calib-self conversations (default {SELF_TEMPERATURE})")
    p.add_argument("--calib-answers", choices=ANSWERS, default="sampled",
                   help="how the teacher answers its own --calib-self questions: sampled at the temperature, or "
                        "greedy (what it says when served with greedy decoding: heal towards the served answers)")
    p.add_argument("--source-weights", type=float, nargs="+", default=(), metavar="W",
                   help="relative share of each source: one per --calib-text file in order, then one for the "
                        "--calib-self conversations (default: equal turns)")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--tokens", type=int, help="healing budget in tokens (a resumed run ends bitwise equal)")
    budget.add_argument("--minutes", type=float, help="healing budget in minutes of wall time")
    p.add_argument("--lr", type=float, default=1e-4, help="peak AdamW learning rate")
    p.add_argument("--warmup", type=int, default=10, help="warm-up steps before the cosine decay")
    p.add_argument("--batch", type=int, default=4, help="windows per step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per window")
    p.add_argument("--train", choices=TRAINABLE, default="factors",
                   help="what trains: both factors (default), only U or only V, every matrix of the blocks "
                        "(factors and those kept dense), or all parameters")
    p.add_argument("--ce-weight", type=float, default=0.0, help="weight of next-token cross-entropy beside the KL")
    p.add_argument("--distill", choices=DISTILL, default="logits",
                   help="KL of the logits, each layer's output on the teacher's input, or half then half")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="compute precision (weights stay float32)")
    p.add_argument("--save-every", type=int, default=50, help="checkpoint every S steps (0: never)")
    p.add_argument("--resume", action="store_true", help="continue a killed run into the same --out")
    p.add_argument("--out", type=Path, required=True, help="the healed decomposed folder (must not exist)")
    p.add_argument("--json", type=Path, dest="json_log", metavar="LOG", help="write every step as a JSON line to LOG")
    p.add_argument("--eval-text", type=Path, nargs="+", default=(), metavar="FILE",
                   help="held-out text: perplexity before, every --eval-every steps, and after (logged)")
    p.add_argument("--eval-every", type=int, default=0, help="steps between held-out evaluations")
    p.add_argument("--eval-tokens", type=int, default=2048, help="held-out tokens per --eval-text file")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the student and teacher")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--layout", choices=LAYOUTS, default="deinfer", help="the student's parallel layout")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(make_config=config_from_args, run=main)


def config_from_args(a: argparse.Namespace) -> HealJob:
    return HealJob(model=a.model, teacher=a.teacher, out=a.out, calib_text=tuple(a.calib_text),
                   calib_self=a.calib_self, source_weights=tuple(a.source_weights),
                   calib_temperature=a.calib_temperature, calib_answers=a.calib_answers, tokens=a.tokens,
                   minutes=a.minutes, lr=a.lr, warmup=a.warmup,
                   batch=a.batch, seq_len=a.seq_len, train=a.train, ce_weight=a.ce_weight, distill=a.distill,
                   dtype=a.dtype, save_every=a.save_every, resume=a.resume, json_log=a.json_log, seed=a.seed,
                   eval_text=tuple(a.eval_text), eval_every=a.eval_every, eval_tokens=a.eval_tokens,
                   tp=a.tp, pp=a.pp, layout=a.layout)


def main(job: HealJob) -> int:
    summary = run_heal(job)
    if summary is None:  # a rank other than 0 under a launcher: rank 0 reports
        return 0
    print(json.dumps({"out": str(job.out), "steps": summary["steps"], "tokens": summary["tokens"],
                      "first_kl": summary["first_kl"], "final_kl": summary["final_kl"],
                      "final_loss": summary["final_loss"], **({"eval": summary["eval"]} if "eval" in summary else {})}))
    return 0
