"""``deinfer-megatron generate``: text generation on TP×PP ranks, in any layout and KV cache."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from deinfer_megatron.cli.arguments import add_inference_layout, names, parsed_by
from deinfer_megatron.cli.output import emit_json
from deinfer_megatron.files.text import read_text
from deinfer_megatron.generation.job import GenerateJob, run_generate, validate
from deinfer_megatron.generation.options import CacheOptions
from deinfer_megatron.generation.prefill import DEFAULT_MAX_PREFILL_TOKENS
from deinfer_megatron.parallel.collectives import Collectives
from deinfer_megatron.generation.sampling import SamplingParams
from deinfer_megatron.launch.env import detect
from deinfer_megatron.launch.external import LAUNCHERS, run_under_launcher
from deinfer_megatron.launch.report import send_report
from deinfer_megatron.layers.kv_cache import CacheKind
from deinfer_megatron.runtime.options import DType, Engine, Parallelism


@dataclass(frozen=True)
class GenerateConfig:
    """What ``generate`` was asked for: the job, and how this process takes part in it."""

    job: GenerateJob
    launcher: str = "auto"  # "auto": join the launcher that started us, or start the ranks ourselves
    json: bool = False  # stdout is the one JSON document
    rerun_argv: tuple[str, ...] = ()  # this command's own arguments, for the ranks a launcher starts


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from prompts")
    p.add_argument("--model", type=Path, required=True, help="model folder (dense or decomposed)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", type=Path, help='JSON lines, each {"prompt": "..."}')
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (the default without --temperature)")
    p.add_argument("--temperature", type=float, help="sampling temperature; 0 means greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    add_inference_layout(p)
    p.add_argument("--collectives", type=parsed_by(Collectives.parse), choices=names(Collectives),
                   default=Collectives.AUTO,
                   help="auto: shared memory between the CPU ranks of a node, the process group beyond; "
                        "process-group: torch.distributed (gloo/NCCL) only")
    p.add_argument("--kv-cache", type=parsed_by(CacheKind.parse), choices=names(CacheKind), default=CacheKind.FULL)
    p.add_argument("--no-absorb", dest="absorb", action="store_false",
                   help="latent cache: rebuild V instead of absorbing U_v after attention")
    p.add_argument("--kv-budget-gb", type=float, help="KV-cache memory per rank; sizes the slots")
    p.add_argument("--engine", type=parsed_by(Engine.parse), choices=names(Engine), default=Engine.MEGATRON)
    p.add_argument("--max-prefill-tokens", type=int, default=DEFAULT_MAX_PREFILL_TOKENS,
                   help="most prompt tokens (prompts × positions) per prefill forward; longer prefills run "
                        f"in chunks of positions (default {DEFAULT_MAX_PREFILL_TOKENS})")
    p.add_argument("--own-loop", action="store_true", help="use the project's loop, not Megatron's engine")
    p.add_argument("--launcher", choices=("auto", *LAUNCHERS), default="auto",
                   help="auto: join the launcher that started us, or start the ranks ourselves")
    p.add_argument("--dtype", type=parsed_by(DType.parse), choices=names(DType), default=DType.FLOAT32)
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="load a decomposed folder made elsewhere, without its manifest (shapes and "
                        "non-finite values are still checked)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(make_config=config_from_args, run=main)


def _prompts(args: argparse.Namespace) -> tuple[str, ...]:
    prompts = list(args.prompt)
    if args.prompts_file is not None:
        text = read_text(args.prompts_file, "prompts file")
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                prompt = json.loads(line)["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{args.prompts_file}:{n}: expected a JSON object with a \"prompt\"") from None
            if not isinstance(prompt, str):
                raise ValueError(f"{args.prompts_file}:{n}: \"prompt\" must be a string, got {prompt!r}")
            prompts.append(prompt)
    return tuple(prompts)


def config_from_args(args: argparse.Namespace) -> GenerateConfig:
    """The parsed flags as a ``GenerateConfig`` (prompts files are read here)."""
    sampling = SamplingParams.from_options(temperature=args.temperature, top_k=args.top_k,
                                           top_p=args.top_p, seed=args.seed, greedy=args.greedy)
    prompts = _prompts(args)
    job = GenerateJob(
        model=args.model, prompts=prompts, max_new_tokens=args.max_new_tokens, sampling=sampling,
        stop=tuple(args.stop), chat=args.chat,
        parallel=Parallelism(tp=args.tp, pp=args.pp, layout=args.layout, collectives=args.collectives),
        cache=CacheOptions(kind=args.kv_cache, absorb_values=args.absorb, budget_gb=args.kv_budget_gb),
        engine=args.engine, own_loop=args.own_loop, dtype=args.dtype,
        stream=len(prompts) == 1 and not args.json, verify=args.verify, max_prefill_tokens=args.max_prefill_tokens)
    return GenerateConfig(job=job, launcher=args.launcher, json=args.json,
                          rerun_argv=tuple(_without_launcher(list(getattr(args, "argv", ())))))


def _without_launcher(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--launcher":
            skip = True
        elif not a.startswith("--launcher="):
            out.append(a)
    return out


def main(cfg: GenerateConfig) -> int:
    job = cfg.job
    if cfg.launcher != "auto" and detect() is None:
        validate(job)  # bad input fails here, in one line, before any launcher starts
        code, result = run_under_launcher(cfg.launcher, job.parallel.world, list(cfg.rerun_argv),
                                          report=cfg.json)
        if code != 0:
            raise RuntimeError(f"the {cfg.launcher} launcher exited with status {code}; its ranks' "
                               "messages are above")
        if cfg.json:
            if result is None:
                raise RuntimeError(f"the ranks under {cfg.launcher} finished without reporting a result")
            emit_json(result)
        return 0
    result = run_generate(job)
    if result is None or send_report(result):  # a non-reporting rank, or rank 0 under --launcher
        return 0
    if cfg.json:
        emit_json(result)
    elif not job.stream:
        for out in result["outputs"]:
            print(f"### {out['prompt']}\n{out['text']}\n")
    return 0
