"""What runs inside a ``loadgen --peers`` process: load the peer's model, run the request set as
static batches back to back, and time every request's tokens.

Each batch is one call of what a user of that library would call — Hugging Face
``model.generate`` (greedy, left-padded prompts, ``max_new_tokens`` the batch's longest) on the
factor-pair model, or CTranslate2's ``Generator.generate_batch`` (``sampling_topk=1``,
``max_length`` the batch's longest, prompts given as token ids) on the multiplied-out dense model
— and returns when its last row is done, as a static batch does. A row stops at the
end-of-sequence token; each request counts its own tokens (at most its ``max_tokens``, the
end-of-sequence token included, as the server and the project's loop count it).

Timestamps: transformers calls the stopping criteria once per step, after the step's tokens are
chosen (every row of a left-padded batch gets a token each step); CTranslate2 calls the
``callback`` once per row and step with the token just chosen (a row with a shorter prompt starts
generating before a longer one has been read). So every row has the time of each of its tokens,
measured from its batch's start; the parent lays the batches on the arrivals (``serve_load``).

CPU seconds are the process's (every thread's) over the batches, not the loading; peak RSS is the
process's high-water mark, loading included.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deinfer_megatron.bench.measure import peak_rss_bytes
from deinfer_megatron.models.hf_factored import hf_model

Batch = tuple[tuple[tuple[int, ...], int], ...]  # (prompt ids, max tokens) per row


@dataclass(frozen=True)
class LoadPeerJob:
    """One peer's run, as handed to its process (picklable)."""

    peer: str  # "hf" | "ctranslate2"
    model: Path  # hf: the decomposed folder; ctranslate2: the converted model's folder
    tokenizer: Path  # the folder whose tokenizer encoded the prompts (CTranslate2 takes token strings)
    compute_type: str  # ctranslate2's compute type ("float32", "bfloat16"); "float32" for hf
    threads: int
    cpus: tuple[int, ...]  # the parent's usable cores
    batches: tuple[Batch, ...]
    eos_ids: tuple[int, ...]
    pad_id: int


def _pin(threads: int, cpus: tuple[int, ...]) -> None:
    """``threads`` torch threads on the first ``threads`` of the parent's cores (``spawn_local``
    pinned this process to the first one, as it pins a server's rank 0)."""
    if threads > 1 and len(cpus) >= threads and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(cpus[:threads]))
    torch.set_num_threads(threads)


def row_timing(marks: list[float], start: float, tokens: list[int], max_tokens: int,
               eos_ids: tuple[int, ...]) -> dict[str, Any]:
    """One row of a batch: its tokens (cut after the first end-of-sequence token and at
    ``max_tokens``), the times of its first and last token after ``start``."""
    kept: list[int] = []
    for token in tokens[:max_tokens]:
        kept.append(token)
        if token in eos_ids:
            break
    return {"ttft": marks[0] - start, "last": marks[len(kept) - 1] - start, "tokens": len(kept),
            "token_ids": kept}


def _hf_batches(job: LoadPeerJob) -> tuple[list[dict[str, Any]], float]:
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Marks(StoppingCriteria):
        """Never stops; notes when each step's tokens are chosen."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    t0 = time.perf_counter()
    model = hf_model(job.model, verify=False)  # the parent opened the folder
    load_s = time.perf_counter() - t0
    rows: list[dict[str, Any]] = []
    for batch in job.batches:
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([(job.pad_id,) * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        marks = Marks()
        start, cpu = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=max(m for _, m in batch), eos_token_id=list(job.eos_ids),
                                 pad_token_id=job.pad_id, stopping_criteria=StoppingCriteriaList([marks]))
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        new = out[:, width:].tolist()
        rows += [{**row_timing(marks.times, start, tokens, m, job.eos_ids), "batch_s": wall, "batch_cpu_s": cpu}
                 for tokens, (_, m) in zip(new, batch)]
    return rows, load_s


def _ctranslate2_batches(job: LoadPeerJob) -> tuple[list[dict[str, Any]], float]:
    import ctranslate2
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(job.tokenizer)
    t0 = time.perf_counter()
    generator = ctranslate2.Generator(str(job.model), device="cpu", compute_type=job.compute_type,
                                      inter_threads=1, intra_threads=job.threads)
    load_s = time.perf_counter() - t0
    rows: list[dict[str, Any]] = []
    for batch in job.batches:
        prompts = [tokenizer.convert_ids_to_tokens(list(p)) for p, _ in batch]
        times: list[list[float]] = [[] for _ in batch]

        def note(step: Any) -> bool:
            times[step.batch_id].append(time.perf_counter())
            return False  # never stop a row early: max_length and the end token do

        start, cpu = time.perf_counter(), time.process_time()
        results = generator.generate_batch(prompts, max_length=max(m for _, m in batch), sampling_topk=1,
                                           beam_size=1, include_prompt_in_result=False, return_end_token=True,
                                           callback=note)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        rows += [{**row_timing(marks, start, result.sequences_ids[0], m, job.eos_ids), "batch_s": wall,
                  "batch_cpu_s": cpu} for marks, result, (_, m) in zip(times, results, batch)]
    return rows, load_s


def load_peer_worker(job: LoadPeerJob) -> dict[str, Any]:
    """Run ``job`` in this process; every request's row (batch order) and the process's figures."""
    _pin(job.threads, job.cpus)
    rows, load_s = (_hf_batches if job.peer == "hf" else _ctranslate2_batches)(job)
    return {"rows": rows, "load_s": load_s, "threads": job.threads, "peak_rss_bytes": peak_rss_bytes()}
