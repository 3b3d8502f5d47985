"""The ``deinfer-megatron`` command: parse into a config dataclass, then call ``main(cfg)``.

User errors (bad flags, bad files, impossible parallel sizes) end the command with one line on
stderr and exit status 2; Ctrl-C (or SIGTERM) with one line and status 130 (143), after every
rank is stopped; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
import warnings
from typing import Any, Sequence

from deinfer_megatron.cli.output import stdout_reserved_for_json
from deinfer_megatron.launch import allocator
from deinfer_megatron.launch.env import detect

COMMANDS = ("fetch_cmd", "decompose_cmd", "plan_cmd", "eval_cmd", "choice_cmd", "generate_cmd", "demo_cmd",
            "bench_cmd", "convert_cmd", "serve_cmd", "loadgen_cmd",
            "heal_cmd")



class Terminated(Exception):
    """SIGTERM, turned into an exception so that the ranks are stopped on the way out."""


def _quiet_known_warnings() -> None:
    """Megatron-Core warns at import time about optional GPU packages (Apex, Transformer
    Engine), expected to be absent on a CPU machine, and its logits gather still calls a torch
    collective that torch 2.13 deprecates. Ranks this command spawns copy these filters
    (``launch.local``); ranks a launcher starts run this command themselves."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron(\.|$)")
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                            category=FutureWarning)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deinfer-megatron",
        description="DeInfer parallel inference for low-rank decomposed LLMs on Megatron-Core",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"deinfer_megatron.cli.{name}").add_parser(sub)
    return parser


def setup_logging(verbose: bool) -> None:
    """Rank 0 logs at INFO; other ranks only warnings, so multi-rank output stays readable."""
    launched = detect()
    rank = launched.rank if launched is not None else 0
    level = logging.DEBUG if verbose else (logging.INFO if rank == 0 else logging.WARNING)
    logging.basicConfig(level=level, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated()


def run(argv: Sequence[str] | None = None) -> int:
    command, args = "deinfer-megatron", None
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        _quiet_known_warnings()

        argv = list(sys.argv[1:] if argv is None else argv)
        args = build_parser().parse_args(argv)
        args.argv = argv  # the command line as given: what a launcher re-runs on every rank
        command = f"deinfer-megatron {args.command}"
        setup_logging(args.verbose)

        allocator.configure()  # before any tensor: every rank of every launcher runs this command
        with stdout_reserved_for_json(getattr(args, "json", None) is True):
            return args.run(args.make_config(args))
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print(f"{command}: terminated", file=sys.stderr)
        return 143
    except (ValueError, OSError, RuntimeError, TimeoutError) as err:
        if args is not None and args.verbose:
            raise
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        print(f"{command}: error: {message}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)  # a caller's own handling of SIGTERM comes back


if __name__ == "__main__":
    sys.exit(run())
