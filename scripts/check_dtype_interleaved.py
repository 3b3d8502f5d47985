#!/usr/bin/env python
"""float32 against bfloat16 generation of one folder, interleaved round by round in one rank.

``bench --dtype`` times one dtype per run; on a shared host whose load moves by minutes, two runs
measured minutes apart compare the load as much as the dtype. This script loads the folder twice
in one TP=1 rank (DeInfer layout, full KV cache), once per dtype, and alternates them: each round
generates ``--gen-len`` greedy tokens after a random prompt of ``--prompt-len`` tokens for
``--batch`` rows in float32, then in bfloat16 (round 0 warms both up). It prints, per batch, the
medians of the rounds' TPOT (decode time ÷ steps) and prefill time, and float32 ÷ bfloat16.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python scripts/check_dtype_interleaved.py DIR \\
        [--batch 1 8] [--prompt-len 64] [--gen-len 32] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from deinfer_megatron.generation.context import GenerationContext
from deinfer_megatron.generation.loop import generate_tokens
from deinfer_megatron.generation.sampling import SamplingParams
from deinfer_megatron.launch.local import spawn_local
from deinfer_megatron.models.build import load_folder
from deinfer_megatron.parallel.runtime import init_parallel, shutdown
from deinfer_megatron.specs.layout import Layout

DTYPES = ("float32", "bfloat16")


def worker(folder: str, batch: int, prompt_len: int, gen_len: int, rounds: int) -> dict:
    """Medians over ``rounds`` of each dtype's TPOT and prefill seconds, alternating the dtypes."""
    torch.set_num_threads(1)
    groups = init_parallel(1, 1)
    try:
        stages = {dt: load_folder(Path(folder), Layout.DEINFER, groups, dtype=getattr(torch, dt)) for dt in DTYPES}
        vocab = stages["float32"].arch.vocab_size
        prompts = torch.randint(3, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
        times: dict[str, dict[str, list[float]]] = {dt: {"tpot_s": [], "prefill_s": []} for dt in DTYPES}
        for r in range(rounds + 1):
            for dt, stage in stages.items():
                context = GenerationContext(batch, prompt_len + gen_len)
                _, timing = generate_tokens(stage, prompts, max_new_tokens=gen_len, params=SamplingParams(),
                                            context=context)
                if r:  # round 0 warms up
                    times[dt]["tpot_s"].append(timing.decode_s / (gen_len - 1))
                    times[dt]["prefill_s"].append(timing.prefill_s)
        return {dt: {k: statistics.median(v) for k, v in t.items()} for dt, t in times.items()}
    finally:
        shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    for batch in a.batch:
        r = spawn_local(1, worker, str(a.model), batch, a.prompt_len, a.gen_len, a.rounds)[0]
        ratios = {f"{k}_float32_over_bfloat16": r["float32"][k] / r["bfloat16"][k] for k in ("tpot_s", "prefill_s")}
        print(json.dumps({"batch": batch, **r, **ratios}), flush=True)


if __name__ == "__main__":
    main()
