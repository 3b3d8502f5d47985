"""``deinfer-megatron serve``: an OpenAI-compatible HTTP server with continuous batching on TP×PP ranks."""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deinfer_megatron.cli.arguments import names, parsed_by
from deinfer_megatron.cli.generate_cmd import _without_launcher as without_launcher
from deinfer_megatron.generation.options import CacheOptions
from deinfer_megatron.launch.env import detect
from deinfer_megatron.launch.external import LAUNCHERS, run_under_launcher
from deinfer_megatron.layers.kv_cache import CacheKind
from deinfer_megatron.planning.request import LayoutRequest
from deinfer_megatron.runtime.options import DType, Engine, Parallelism
from deinfer_megatron.serving.blocks import DEFAULT_BLOCK_SIZE
from deinfer_megatron.serving.scheduler import DEFAULT_PREFILL_CHUNK
from deinfer_megatron.serving.server import ServeJob, run_serve, validate
from deinfer_megatron.specs.layout import Layout

API_KEY_ENV = "DEINFER_API_KEY"


@dataclass(frozen=True)
class ServeConfig:
    """What ``serve`` was asked for: the server, and how this process takes part in it."""

    job: ServeJob
    launcher: str = "auto"
    rerun_argv: tuple[str, ...] = ()


def _served_layout(text: str) -> LayoutRequest:
    """A fixed ``--layout``: ``auto`` prices one batch and context, the server's change every step."""
    request = LayoutRequest.parse(text)
    if request.is_auto:
        raise ValueError(f"serve takes a fixed layout ({', '.join(names(Layout))}), not auto: it prices one "
                         "batch and context, and the server's change every step")
    return request


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model (decomposed or dense) over an OpenAI-compatible HTTP API")
    p.add_argument("--model", type=Path, required=True, help="model folder (decomposed, or dense)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--layout", type=parsed_by(_served_layout), default=LayoutRequest(Layout.DEINFER),
                   metavar="{" + ",".join(names(Layout)) + "}",
                   help="deinfer (default), naive or dense (the factors multiplied out) for every block; not auto, "
                        "which prices one batch and context while the server's batch changes every step")
    p.add_argument("--kv-cache", type=parsed_by(CacheKind.parse), choices=names(CacheKind), default=CacheKind.FULL)
    p.add_argument("--no-absorb", dest="absorb", action="store_false",
                   help="latent cache: rebuild V instead of absorbing U_v after attention")
    p.add_argument("--engine", type=parsed_by(Engine.parse), choices=names(Engine), default=Engine.MEGATRON)
    p.add_argument("--dtype", type=parsed_by(DType.parse), choices=names(DType), default=DType.FLOAT32)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=16, help="the most sequences running at once")
    p.add_argument("--kv-budget-gb", type=float,
                   help="KV-cache memory per rank: sizes the block pool (default: --max-batch sequences of "
                        "--max-seq-len tokens)")
    p.add_argument("--max-seq-len", type=int,
                   help="the most tokens of one sequence, prompt + max_tokens (default: the model's context, "
                        "at most 2048)")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block")
    p.add_argument("--no-prefix-cache", dest="prefix_caching", action="store_false",
                   help="do not share the KV blocks of equal prompt prefixes between requests")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait to be admitted; more get 429")
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                   help="the most prompt tokens fed in one step, over all arriving requests")
    p.add_argument("--served-model-name", help="the model name clients send (default: the folder's name)")
    p.add_argument("--api-key", help=f"require Authorization: Bearer KEY (or set {API_KEY_ENV})")
    p.add_argument("--launcher", choices=("auto", *LAUNCHERS), default="auto",
                   help="auto: join the launcher that started us, or start the ranks ourselves")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="load a decomposed folder made elsewhere, without its manifest")
    p.set_defaults(make_config=config_from_args, run=main)


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    job = ServeJob(
        model=args.model, parallel=Parallelism(tp=args.tp, pp=args.pp, layout=args.layout),
        cache=CacheOptions(kind=args.kv_cache, absorb_values=args.absorb, budget_gb=args.kv_budget_gb),
        engine=args.engine, dtype=args.dtype, host=args.host, port=args.port, max_batch=args.max_batch,
        max_queue=args.max_queue, max_seq_len=args.max_seq_len, block_size=args.block_size,
        prefix_caching=args.prefix_caching, served_model_name=args.served_model_name,
        api_key=api_key, prefill_chunk=args.prefill_chunk, verify=args.verify)
    return ServeConfig(job=job, launcher=args.launcher,
                       rerun_argv=tuple(without_launcher(list(getattr(args, "argv", ())))))


def _forward_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM to the ranks this command started: rank 0 drains, then every rank returns."""
    for child in multiprocessing.active_children():
        if child.pid is not None:
            os.kill(child.pid, signal.SIGTERM)


def main(cfg: ServeConfig) -> int:
    job = cfg.job
    if cfg.launcher != "auto" and detect() is None:
        validate(job)  # bad input fails here, in one line, before any launcher starts
        code, _ = run_under_launcher(cfg.launcher, job.parallel.world, list(cfg.rerun_argv), report=False)
        if code != 0:
            raise RuntimeError(f"the {cfg.launcher} launcher exited with status {code}; its ranks' messages are above")
        return 0
    previous = None
    if detect() is None and job.parallel.world > 1:  # the ranks are ours: they hear SIGTERM from us
        previous = signal.signal(signal.SIGTERM, _forward_sigterm)
    try:
        run_serve(job)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0
