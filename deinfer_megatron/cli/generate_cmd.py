"""``deinfer-megatron generate``: text generation on TP×PP ranks, in any layout and KV cache."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from deinfer_megatron.generation.job import ENGINES, GenerateJob, run_generate
from deinfer_megatron.generation.sampling import SamplingParams
from deinfer_megatron.specs.layout import Layout


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from prompts")
    p.add_argument("--model", type=Path, required=True, help="model folder (dense or decomposed)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", type=Path, help='JSON lines, each {"prompt": "..."}')
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (the default without --temperature)")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--layout", choices=[m.value for m in Layout], default="deinfer")
    p.add_argument("--kv-cache", choices=("full", "latent"), default="full")
    p.add_argument("--no-absorb", dest="absorb", action="store_false",
                   help="latent cache: rebuild V instead of absorbing U_v after attention")
    p.add_argument("--kv-budget-gb", type=float, help="KV-cache memory per rank; sizes the slots")
    p.add_argument("--engine", choices=ENGINES, default="megatron")
    p.add_argument("--own-loop", action="store_true", help="use the project's loop, not Megatron's engine")
    p.add_argument("--launcher", choices=("auto", "torchrun", "deepspeed"), default="auto",
                   help="auto: join the launcher that started us, or start the ranks ourselves")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--json", action="store_true")
    p.set_defaults(make_config=lambda a: a, run=main)


def _prompts(args: argparse.Namespace) -> tuple[str, ...]:
    prompts = list(args.prompt)
    if args.prompts_file is not None:
        if not args.prompts_file.is_file():
            raise FileNotFoundError(f"prompts file {args.prompts_file} does not exist")
        for n, line in enumerate(args.prompts_file.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                prompts.append(json.loads(line)["prompt"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{args.prompts_file}:{n}: expected a JSON object with a \"prompt\"") from None
    return tuple(prompts)


def job_from_args(args: argparse.Namespace) -> GenerateJob:
    sampling_wanted = args.temperature is not None or args.top_k or args.top_p < 1.0
    if args.greedy and sampling_wanted:
        raise ValueError("--greedy cannot be combined with --temperature/--top-k/--top-p")
    sampling = SamplingParams(
        greedy=not sampling_wanted, temperature=args.temperature or 1.0,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    prompts = _prompts(args)
    return GenerateJob(
        model=args.model, prompts=prompts, max_new_tokens=args.max_new_tokens, sampling=sampling,
        tp=args.tp, pp=args.pp, layout=args.layout, kv_cache=args.kv_cache, absorb_values=args.absorb,
        engine=args.engine, own_loop=args.own_loop, kv_budget_gb=args.kv_budget_gb,
        stop=tuple(args.stop), chat=args.chat, stream=len(prompts) == 1 and not args.json,
        dtype=args.dtype)


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


def relaunch(args: argparse.Namespace, argv: list[str]) -> int:
    """Re-run this same command as ``tp×pp`` ranks under torchrun or the DeepSpeed launcher
    (each rank then finds the launcher's variables and joins)."""
    world = args.tp * args.pp
    rest = _without_launcher(argv)
    if args.launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
               "--max-restarts=0", "-m", "deinfer_megatron.cli.main", *rest]
    else:
        exe = shutil.which("deepspeed") or str(Path(sys.executable).with_name("deepspeed"))
        cli = shutil.which("deinfer-megatron") or str(Path(sys.executable).with_name("deinfer-megatron"))
        cmd = [exe, f"--num_gpus={world}", "--no_local_rank", cli, *rest]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached: the launcher replaces this process


def main(args: argparse.Namespace) -> int:
    from deinfer_megatron.launch.env import detect

    job = job_from_args(args)
    if args.launcher != "auto" and detect() is None:
        return relaunch(args, sys.argv[1:])
    result = run_generate(job)
    if result is None:  # a non-reporting rank inside a launcher
        return 0
    if args.json:
        print(json.dumps(result))
    elif not job.stream:
        for out in result["outputs"]:
            print(f"### {out['prompt']}\n{out['text']}\n")
    return 0
