#!/usr/bin/env python
"""A bare torch + gloo decode step of llama-1b-shaped layers in the three layouts, with none of
the project's layers or collectives (only its rank formula, so the shapes are those `bench`
times): the reference the `bench` numbers are judged against.

The issue that asked for the benchmark quoted "about 2.1x over naive and 1.5x over dense" for a
bare single-layer implementation; this script is how we checked what such an implementation
reaches on the machine at hand, so that a gap between `bench` and that figure can be told apart
from overhead in the project's layers (docs/bench/HISTORY.md reports both side by side).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bare_layer_bench.py [--layers 4] [--batch 8]
        [--ctx 128] [--tp 2] [--ratio 0.6] [--rounds 2]

Each layout runs in fresh processes (one thread, one core each), layouts are interleaved over
`--rounds`, and the median step time of each round is reported. Factors are stored input-major
(x @ W), as the project stores them. The gathered latents are sliced without re-ordering the
per-rank pieces: the shapes and the work are right, the numbers are not (timing only).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from deinfer_megatron.decompose.allocation import uniform_rank

H, INTER, HEADS, KV_HEADS, HEAD_DIM = 2048, 5632, 16, 8, 128
KV = KV_HEADS * HEAD_DIM
STEPS, WARMUP = 40, 10


def attend(q, k, v, cache_k, cache_v, heads: int, kv_heads: int) -> torch.Tensor:
    """Attention of one new token per sequence over a static cache whose last slot it fills
    (written in place, as an inference engine's static KV cache is)."""
    b = q.shape[0]
    cache_k[:, :, -1] = k.view(b, kv_heads, HEAD_DIM)
    cache_v[:, :, -1] = v.view(b, kv_heads, HEAD_DIM)
    out = F.scaled_dot_product_attention(q.view(b, heads, 1, HEAD_DIM), cache_k, cache_v, enable_gqa=True)
    return out.reshape(b, heads * HEAD_DIM)


def build_layer(layout: str, t: int, a: argparse.Namespace) -> dict[str, torch.Tensor]:
    """Per-rank weights of one layer (input-major) and its KV cache."""
    w = lambda i, o: torch.randn(i, o) * 0.02  # noqa: E731
    rq = ro = uniform_rank(H, H, a.ratio)
    rk, rg, rd = uniform_rank(KV, H, a.ratio), uniform_rank(INTER, H, a.ratio), uniform_rank(H, INTER, a.ratio)
    heads, kv_heads = HEADS // t, KV_HEADS // t
    if layout == "dense":
        L = dict(qkv=w(H, (H + 2 * KV) // t), o=w(H // t, H), gu=w(H, 2 * INTER // t), down=w(INTER // t, H))
    elif layout == "deinfer":
        L = dict(vqkv=w(H, (rq + 2 * rk) // t), uq=w(rq, H // t), uk=w(rk, KV // t), uv=w(rk, KV // t),
                 vo=w(H // t, ro), uo=w(ro, H), vgu=w(H, 2 * rg // t), ug=w(rg, INTER // t),
                 uu=w(rg, INTER // t), vd=w(INTER // t, rd), ud=w(rd, H))
    else:
        heads, kv_heads, L = HEADS, KV_HEADS, {}
        pairs = dict(q=(H, rq, H), k=(H, rk, KV), v=(H, rk, KV), o=(H, ro, H),
                     g=(H, rg, INTER), u=(H, rg, INTER), d=(INTER, rd, H))
        for name, (i, r, o) in pairs.items():
            L["v" + name], L["u" + name] = w(i, r // t), w(r // t, o)
    L["ck"] = torch.randn(a.batch, kv_heads, a.ctx + 1, HEAD_DIM)
    L["cv"] = torch.randn(a.batch, kv_heads, a.ctx + 1, HEAD_DIM)
    L["ranks"] = (rq, rk, rg)
    L["heads"] = (heads, kv_heads)
    return L


def worker(rank: int, t: int, layout: str, a: argparse.Namespace, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if os.cpu_count() >= t:
        os.sched_setaffinity(0, {rank})
    dist.init_process_group("gloo", rank=rank, world_size=t)
    torch.manual_seed(rank)

    def all_reduce(x):
        dist.all_reduce(x)
        return x

    def all_gather(x):
        parts = [torch.empty_like(x) for _ in range(t)]
        dist.all_gather(parts, x)
        return torch.cat(parts, -1)

    layers = [build_layer(layout, t, a) for _ in range(a.layers)]

    def step(x: torch.Tensor) -> torch.Tensor:
        for L in layers:
            (rq, rk, rg), (heads, kvh) = L["ranks"], L["heads"]
            if layout == "dense":
                q, k, v = (x @ L["qkv"]).split([H // t, KV // t, KV // t], -1)
                x = x + all_reduce(attend(q, k, v, L["ck"], L["cv"], heads, kvh) @ L["o"])
                g, u = (x @ L["gu"]).chunk(2, -1)
                x = x + all_reduce((F.silu(g) * u) @ L["down"])
            elif layout == "deinfer":
                cq, ck, cv = all_gather(x @ L["vqkv"]).split([rq, rk, rk], -1)
                att = attend(cq @ L["uq"], ck @ L["uk"], cv @ L["uv"], L["ck"], L["cv"], heads, kvh)
                x = x + all_reduce(att @ L["vo"]) @ L["uo"]
                cg, cu = all_gather(x @ L["vgu"]).chunk(2, -1)
                x = x + all_reduce((F.silu(cg @ L["ug"]) * (cu @ L["uu"])) @ L["vd"]) @ L["ud"]
            else:
                pair = lambda y, n: all_reduce(y @ L["v" + n] @ L["u" + n])  # noqa: E731
                att = attend(pair(x, "q"), pair(x, "k"), pair(x, "v"), L["ck"], L["cv"], heads, kvh)
                x = x + pair(att, "o")
                x = x + pair(F.silu(pair(x, "g")) * pair(x, "u"), "d")
        return x

    x0, times = torch.randn(a.batch, H), []
    with torch.inference_mode():
        for _ in range(STEPS):
            dist.barrier()
            start = time.perf_counter()
            step(x0)
            times.append(time.perf_counter() - start)
    if rank == 0:
        out[layout] = statistics.median(times[WARMUP:]) * 1e3
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--ratio", type=float, default=0.6)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    layouts, samples = ("dense", "naive", "deinfer"), {}
    result = mp.Manager().dict()
    for round_ in range(a.rounds):
        for i, layout in enumerate(layouts):
            mp.spawn(worker, args=(a.tp, layout, a, 29600 + 3 * round_ + i, result), nprocs=a.tp)
            samples.setdefault(layout, []).append(result[layout])
            print(f"round {round_}: {layout:8s} {result[layout]:7.2f} ms/step", flush=True)
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(f"median step ms: " + ", ".join(f"{k} {v:.2f}" for k, v in med.items()))
    print(f"deinfer speed-up: {med['naive'] / med['deinfer']:.2f}x vs naive, "
          f"{med['dense'] / med['deinfer']:.2f}x vs dense")


if __name__ == "__main__":
    main()
