"""What runs inside a peer's processes: build the peer's model, generate ``repeats + 1`` times,
measure exactly as a cell's ranks do (``measure``).

The loop is the project's, written over a Hugging Face forward: one prefill forward over the
prompts, then one forward per new token, greedy (argmax), no EOS stop, the rows sharing positions.
The KV cache is transformers' default ``DynamicCache`` (what ``generate`` uses). Timestamps are
taken where the project's ``on_token`` marks a step (the step's tokens chosen and on the host),
so TTFT, prefill, TPOT and the decode steps mean what they mean in a cell; the first run is the
warm-up. Peak RSS is read after loading and, after a reset, over generation (``measure``).

- ``hf``: one process, ``threads`` torch threads on the cores the row's ranks use.
- ``deepspeed``: ``tp`` ranks of one thread, ``deepspeed.init_inference`` with AutoTP sharding the
  multiplied-out dense model (its shm all-reduce disabled first: ``patches.deepspeed_cpu``).

Both load the model in the job's ``dtype`` (cast once as each tensor is read: ``hf_model``), and
DeepSpeed is initialised in it.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deinfer_megatron import patches
from deinfer_megatron.bench.measure import peak_rss_bytes, reset_peak_rss
from deinfer_megatron.bench.records import PeerMeasurement, Sample
from deinfer_megatron.models.hf_factored import hf_model
from deinfer_megatron.runtime.options import DType


@dataclass(frozen=True)
class PeerJob:
    """One peer run, as handed to its processes (picklable)."""

    peer: str  # "hf" | "deepspeed"
    folder: Path  # hf: the decomposed folder; deepspeed: the dense (or multiplied-out) one
    tp: int  # deepspeed's ranks; 1 for hf
    threads: int  # torch threads per process
    cpus: tuple[int, ...]  # the parent's usable cores, for pinning
    batch: int
    prompt_len: int
    gen_len: int
    repeats: int
    prompts: tuple[tuple[int, ...], ...]  # the cells' prompts (``matrix.random_prompts``)
    dtype: DType = DType.FLOAT32  # the cells' precision (``bench --dtype``)


def _cache_keyword(model: nn.Module) -> str:
    """transformers ≥ 5 names the cache argument ``cache``; earlier releases ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def greedy_run(forward: Any, model: nn.Module, prompts: torch.Tensor,
               gen_len: int) -> tuple[Sample, list[list[int]]]:
    """One timed greedy generation of ``gen_len`` tokens per row through ``forward``
    (the model, or an engine around it); the sample and every row's tokens."""
    from transformers import DynamicCache

    batch = prompts.shape[0]
    cache_kw = _cache_keyword(model)
    tokens: list[torch.Tensor] = []
    marks: list[float] = []
    with torch.inference_mode():
        cache = DynamicCache()
        start = time.perf_counter()
        logits = forward(input_ids=prompts, use_cache=True, logits_to_keep=1, **{cache_kw: cache}).logits
        prefill_s = time.perf_counter() - start
        for step in range(gen_len):
            chosen = logits[:, -1].argmax(-1)
            chosen.tolist()  # on the host, as the project's loop has it when it marks the step
            marks.append(time.perf_counter())
            tokens.append(chosen)
            if step + 1 == gen_len:
                break
            logits = forward(input_ids=chosen[:, None], use_cache=True, logits_to_keep=1,
                             **{cache_kw: cache}).logits
    steps = [b - a for a, b in zip(marks, marks[1:])]
    sample = Sample(ttft_s=marks[0] - start, prefill_s=prefill_s, decode_s=marks[-1] - marks[0],
                    tpot_s=(marks[-1] - marks[0]) / len(steps), step_s=tuple(steps), new_tokens=batch * gen_len)
    return sample, torch.stack(tokens, 1).tolist()


def _pin(job: PeerJob, rank: int) -> None:
    """hf: its ``threads`` cores (the ranks of a cell hold one each); deepspeed: one per rank."""
    if hasattr(os, "sched_setaffinity") and job.cpus:
        first = rank * job.threads
        if first + job.threads <= len(job.cpus):
            os.sched_setaffinity(0, set(job.cpus[first:first + job.threads]))
    torch.set_num_threads(job.threads)


def _measure(job: PeerJob, rank: int, load: Any) -> PeerMeasurement:
    t0 = time.perf_counter()
    forward, model = load()
    load_s = time.perf_counter() - t0
    rss_after_load = peak_rss_bytes()
    reset = reset_peak_rss()
    prompts = torch.tensor(job.prompts, dtype=torch.long)
    warmup, tokens = greedy_run(forward, model, prompts, job.gen_len)
    samples = tuple(greedy_run(forward, model, prompts, job.gen_len)[0] for _ in range(job.repeats))
    rss_run = peak_rss_bytes() if reset else None
    return PeerMeasurement(rank=rank, threads=torch.get_num_threads(), load_s=load_s, warmup=warmup,
                           samples=samples, tokens=tuple(tuple(t) for t in tokens),
                           peak_rss_bytes=max(rss_after_load, rss_run or 0), peak_rss_generate_bytes=rss_run)


def hf_worker(job: PeerJob) -> PeerMeasurement:
    """The Hugging Face peer: factor pairs as ``nn.Linear``s, one process."""

    _pin(job, 0)

    def load() -> tuple[Any, nn.Module]:
        model = hf_model(job.folder, verify=False, dtype=job.dtype.torch)  # the parent verified it once
        return model, model

    return _measure(job, 0, load)


def deepspeed_worker(job: PeerJob) -> PeerMeasurement:
    """The DeepSpeed peer on this rank: AutoTP over ``tp`` gloo ranks, the dense model."""

    rank = int(os.environ.get("RANK", "0"))
    _pin(job, rank)
    patches.deepspeed_cpu.apply()  # before init_distributed: no shm all-reduce build on CPU
    import deepspeed
    import torch.distributed as dist

    def load() -> tuple[Any, nn.Module]:
        deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
        model = hf_model(job.folder, multiply_out=True, verify=False, dtype=job.dtype.torch)
        with contextlib.redirect_stdout(sys.stderr):  # AutoTP prints its policy; stdout is the bench's table
            engine = deepspeed.init_inference(model, dtype=job.dtype.torch, replace_with_kernel_inject=False,
                                              tensor_parallel={"tp_size": job.tp})
        return engine, engine.module

    try:
        return _measure(job, rank, load)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
