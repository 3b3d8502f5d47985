"""``deinfer-megatron decompose``: a dense model in, a decomposed model folder out."""

from __future__ import annotations

import argparse
from pathlib import Path

from deinfer_megatron.decompose.calibration import ANSWERS, SELF_TEMPERATURE
from deinfer_megatron.decompose.job import ALLOCATIONS, METHODS, DecomposeJob, run_decompose
from deinfer_megatron.decompose.update import UPDATE_DAMP, UPDATES


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("decompose", help="factorise a dense model into W ≈ U·V")
    p.add_argument("--model", type=Path, required=True, help="Hugging Face folder or Megatron checkpoint")
    p.add_argument("--method", choices=METHODS, required=True)
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--ratio", type=float, help="fraction of the linear parameters kept, in (0, 1]")
    budget.add_argument("--rank-config", type=Path, help="explicit ranks (JSON: module → rank)")
    p.add_argument("--allocation", choices=ALLOCATIONS, default="uniform",
                   help="ranks under --ratio: uniform; variadic (by truncation loss, per kind of matrix); "
                        "fisher (truncation loss × measured end-to-end sensitivity, one budget)")
    p.add_argument("--update", choices=UPDATES, default="none",
                   help="sequential: refit U, then V, to the dense model's outputs on the calibration data")
    p.add_argument("--update-damp", type=float, default=UPDATE_DAMP, metavar="D",
                   help="the update's pull towards the dense matrix: λ = D · mean(diag(XᵀX)) (default %(default)s)")
    calib = p.add_mutually_exclusive_group()
    calib.add_argument("--calib-text", type=Path, nargs="+", metavar="FILE",
                       help="calibration text files (several share --calib-tokens equally, each from its start)")
    calib.add_argument("--calib-self", type=int, metavar="N", help="calibrate on N self-sampled sequences")
    p.add_argument("--calib-temperature", type=float, metavar="T",
                   help="sampling temperature of the --calib-self text (default %s)" % SELF_TEMPERATURE)
    p.add_argument("--calib-answers", choices=ANSWERS, default="sampled",
                   help="how a chat model answers its own --calib-self questions: sampled at the temperature, "
                        "or greedy (what it says when served with greedy decoding)")
    p.add_argument("--calib-tokens", type=int, default=4096, help="calibration tokens (text)")
    p.add_argument("--calib-seq-len", type=int, default=256, help="tokens per calibration sequence")
    p.add_argument("--layers", help="layers to decompose, e.g. '0-9,12' (default: all)")
    p.add_argument("--no-sequential", dest="sequential", action="store_false",
                   help="take every statistic from the dense model (one-shot)")
    p.add_argument("--out", type=Path, help="output folder (default: beside the model); must not exist or be empty")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out if it is a model folder made by deinfer-megatron (never anything else)")
    p.add_argument("--tokenizer", type=Path, help="tokenizer folder (needed for Megatron checkpoints)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--asvd-alpha", type=float, default=1.0, help="asvd: exponent of the channel scaling")
    p.set_defaults(make_config=lambda a: DecomposeJob(
        a.model, a.method, a.ratio, a.rank_config, a.allocation, tuple(a.calib_text) if a.calib_text else None,
        a.calib_self, a.calib_tokens, a.calib_seq_len, a.layers, a.sequential, a.out, a.tokenizer, a.seed,
        a.asvd_alpha, a.overwrite, a.update, a.update_damp, a.calib_temperature, a.calib_answers), run=main)


def main(job: DecomposeJob) -> int:
    out = run_decompose(job)
    print(out)
    return 0
