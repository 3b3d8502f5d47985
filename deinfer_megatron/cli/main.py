"""The ``deinfer-megatron`` command: parse into a config dataclass, then call ``main(cfg)``.

User errors (bad flags, bad files, impossible parallel sizes) end the command with one line on
stderr and exit status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from typing import Sequence

# Megatron-Core warns at import time about optional GPU packages (Apex, Transformer Engine);
# on a CPU machine they are expected to be absent. Its logits gather still calls a torch
# collective that torch 2.13 deprecates. Spawned ranks inherit PYTHONWARNINGS.
_QUIET = ("ignore::UserWarning:megatron,"
          "ignore:`torch.distributed.all_gather_into_tensor` is deprecated:FutureWarning")
os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), _QUIET]))
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron(\.|$)")

from deinfer_megatron.cli import (  # noqa: E402
    bench_cmd,
    decompose_cmd,
    demo_cmd,
    eval_cmd,
    fetch_cmd,
    generate_cmd,
    plan_cmd,
)

COMMANDS = (fetch_cmd, decompose_cmd, plan_cmd, eval_cmd, generate_cmd, demo_cmd, bench_cmd)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deinfer-megatron",
        description="DeInfer parallel inference for low-rank decomposed LLMs on Megatron-Core",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def setup_logging(verbose: bool) -> None:
    """Rank 0 logs at INFO; other ranks only warnings, so multi-rank output stays readable."""
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    level = logging.DEBUG if verbose else (logging.INFO if rank == 0 else logging.WARNING)
    logging.basicConfig(level=level, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    try:
        return args.run(args.make_config(args))
    except (ValueError, FileNotFoundError, RuntimeError, TimeoutError) as err:
        if args.verbose:
            raise
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        print(f"deinfer-megatron {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(run())
