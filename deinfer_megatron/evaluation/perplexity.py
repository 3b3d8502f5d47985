"""Perplexity of a (decomposed) model over non-overlapping windows of a text, computed by the
Megatron model in the chosen layout and parallel sizes.

Every rank tokenises the same text and runs the same windows; the last pipeline stage turns
the logits into summed negative log-likelihoods and the result is broadcast, so that global
rank 0 reports it whatever the pipeline layout.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from deinfer_megatron.files.text import read_text
from deinfer_megatron.launch.env import detect
from deinfer_megatron.launch.run import run_on_ranks
from deinfer_megatron.planning.agree import needs_agreement, plan_in_job, plan_on_rank0
from deinfer_megatron.specs.layout import AUTO, Layout, LayoutPlan, parse_layout_option

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PerplexityJob:
    """Perplexity of ``model`` over the first ``max_tokens`` tokens of ``text``, cut into windows.

    ``layout`` is parsed on construction (``parse_layout_option``; a ``Layout`` passes
    unchanged), so a job built in Python may name it; ``"auto"`` is resolved by the cost model
    for ``batch`` windows of ``window`` tokens before the ranks start (under a launcher: by
    global rank 0 for every rank, ``planning.agree``).
    """

    model: Path
    text: Path
    max_tokens: int = 4096
    window: int = 512
    tp: int = 1
    pp: int = 1
    layout: Layout | LayoutPlan | str = Layout.DEINFER
    batch: int = 4
    verify: bool = True  # False: a decomposed folder without its manifest (--no-verify)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", parse_layout_option(self.layout))


def token_windows(model: Path, text: Path, max_tokens: int, window: int) -> torch.Tensor:
    """``[n, window]`` token ids: the first ``max_tokens`` tokens of ``text``, cut evenly."""
    import transformers

    if window < 2:
        raise ValueError(f"--window must be at least 2 tokens, got {window}")
    content = read_text(Path(text), "text file", max_chars=max_tokens * 16)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    ids = tokenizer(content, add_special_tokens=False)["input_ids"][:max_tokens]
    n = len(ids) // window
    if n == 0:
        raise ValueError(
            f"{text} gives {len(ids)} tokens, fewer than one window of {window}; "
            "use a longer text or a smaller --window"
        )
    return torch.tensor(ids[: n * window]).view(n, window)


def _rank(job: PerplexityJob) -> dict:
    from deinfer_megatron.models.build import load_folder
    from deinfer_megatron.models.pipeline import broadcast_from_last_stage, stage_forward
    from deinfer_megatron.parallel.runtime import init_parallel, shutdown

    windows = token_windows(job.model, job.text, job.max_tokens, job.window)
    agree = needs_agreement(job.layout)  # launched with auto: rank 0's plan, for every rank
    mine = plan_on_rank0(lambda: auto_plan_for(job)) if agree else None
    groups = init_parallel(job.tp, job.pp)
    try:
        if agree:
            from deinfer_megatron.checkpoints.folder import open_config
            from deinfer_megatron.planning.preflight import check_fits

            job = replace(job, layout=plan_in_job(lambda link: auto_plan_for(job, link), mine, groups)[0])
            check_fits(*open_config(job.model, verify=False), job.layout, tp=job.tp, pp=job.pp, dtype_bytes=4,
                       **forward_sizes(job))
        stage = load_folder(job.model, job.layout, groups, verify=False)  # evaluate() verified it
        if stage.layout.value == AUTO:  # as generate's ranks: a command that fails earlier prints one line
            log.info("--layout auto: %s", stage.layout.describe())
        device = next(stage.model.parameters()).device  # the windows go where the stage lives
        total = torch.zeros(2, dtype=torch.float64, device=device)  # summed NLL, predicted tokens
        for batch in windows.to(device).split(job.batch):
            pos = torch.arange(batch.shape[1], device=device).expand_as(batch)
            logits = stage_forward(stage, batch, pos)
            if logits is not None:
                # One window at a time: its slice is contiguous, so only its log-softmax is new
                # memory (a window × vocab), not a copy of the whole batch's logits and another
                # for their log-softmax — the memory check counts one forward's logits only.
                nll = sum(F.cross_entropy(row[:-1].float(), ids[1:], reduction="sum").item()
                          for row, ids in zip(logits, batch))
                total += torch.tensor([nll, batch[:, 1:].numel()], dtype=torch.float64, device=device)
        total = broadcast_from_last_stage(stage, total if groups.is_last_stage else None, total)
    finally:
        shutdown()
    nll, count = total.tolist()
    plan = {"block_layouts": job.layout.to_json()} if isinstance(job.layout, LayoutPlan) else {}
    return {"ppl": math.exp(nll / count), "tokens": int(count), "windows": int(windows.shape[0]),
            "layout": job.layout.value, **plan}  # the layout the ranks built (a launched auto: agreed there)


def auto_plan_for(job: PerplexityJob, collectives: dict[str, list[float]] | None = None) -> LayoutPlan:
    """The cost model's plan for ``job`` from this host's cost table. A perplexity pass is one
    forward of batch × window tokens: priced as that many tokens through the weights, each
    attending to about a window of context; among the plans whose weights fit this machine
    where one does (``planning.auto.within_memory``)."""
    from deinfer_megatron.checkpoints.folder import open_config
    from deinfer_megatron.planning import preflight
    from deinfer_megatron.planning.auto import Workload, auto_plan

    arch, ranks = open_config(job.model, verify=False)  # evaluate() verifies
    work = Workload(tp=job.tp, batch=job.batch * job.window, context=job.window)
    return auto_plan(arch, ranks, work, collectives=collectives,
                     fits=lambda plan: preflight.fits(arch, ranks, plan, tp=job.tp, pp=job.pp, dtype_bytes=4,
                                                      **forward_sizes(job))).plan


def forward_sizes(job: PerplexityJob) -> dict[str, Any]:
    """A pass's forward for the memory check: ``batch`` windows, each its own context; the
    logits of every row, and one window's log-softmax beside them (the loss is taken a window
    at a time; counted as one more window of logits, which is more than it holds)."""
    rows = job.batch * job.window
    return {"prefill_rows": rows, "context": job.window, "logit_rows": rows + job.window,
            "rows_option": "--batch"}


def evaluate(job: PerplexityJob) -> dict | None:
    """Perplexity of ``job.model`` on ``job.text``; None on ranks that do not report.

    Everything is checked before the ranks start, and before ``--layout auto`` is priced (a
    first ``auto`` run calibrates the host and times the model's own shapes): the sizes against
    every candidate layout, the folder, the text; then the chosen plan's fit."""
    from deinfer_megatron.checkpoints.folder import open_config, open_model
    from deinfer_megatron.planning.preflight import check_fits

    arch, ranks = open_config(job.model, verify=job.verify)  # fail fast, before ranks start
    if job.window > arch.max_positions:
        raise ValueError(f"--window {job.window} is longer than the model's context of "
                         f"{arch.max_positions} tokens; use --window {arch.max_positions} or less")
    if job.max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {job.max_tokens}")
    if job.batch < 1:
        raise ValueError(f"--batch must be at least 1 window per forward, got {job.batch}")
    sizes = dict(tp=job.tp, pp=job.pp, dtype_bytes=4, **forward_sizes(job))
    check_fits(arch, ranks, job.layout, **sizes)  # auto: under some candidate, before it is priced
    open_model(job.model, verify=job.verify)
    token_windows(job.model, job.text, job.max_tokens, job.window)
    if job.layout == AUTO and detect() is None:  # under a launcher: resolved in the ranks (_rank)
        job = replace(job, layout=auto_plan_for(job))
        check_fits(arch, ranks, job.layout, **sizes)
    result = run_on_ranks(job.tp * job.pp, _rank, job)
    if result is None:
        return None
    return {**result, "model": str(job.model), "tp": job.tp, "pp": job.pp}
