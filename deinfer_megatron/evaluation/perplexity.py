"""Perplexity of a (decomposed) model over non-overlapping windows of a text, computed by the
Megatron model in the chosen layout, parallel sizes and precision.

Every rank tokenises the same text and runs the same windows; the last pipeline stage turns
the logits into summed negative log-likelihoods and the result is broadcast, so that global
rank 0 reports it whatever the pipeline layout. In bfloat16 the model (weights, factors,
activations, logits) runs in bfloat16, but the loss is not: each window's logits are taken to
float32 for the log-softmax and the negative log-likelihoods are summed in float64, as in
float32, so that the sum over thousands of tokens adds no rounding of its own.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from deinfer_megatron.arch.model import ModelArch
from deinfer_megatron.files.text import read_text
from deinfer_megatron.models.pipeline import broadcast_from_last_stage, stage_forward
from deinfer_megatron.planning.pricing import Workload
from deinfer_megatron.planning.preflight import Footprint
from deinfer_megatron.planning.request import LayoutRequest
from deinfer_megatron.runtime.job import RankContext, run_job
from deinfer_megatron.runtime.options import DType, Engine, Parallelism
from deinfer_megatron.specs.layout import Layout, LayoutPlan
from deinfer_megatron.specs.rank_config import RankConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PerplexityJob:
    """Perplexity of ``model`` over the first ``max_tokens`` tokens of ``text``, cut into windows
    and forwarded ``batch`` windows at a time (``runtime.job.JobSpec``).

    ``layout`` is parsed on construction (``LayoutRequest.parse``), so a job built in Python may
    name it; ``"auto"`` is priced by the cost model for a forward of ``batch`` windows.
    """

    model: Path
    text: Path
    max_tokens: int = 4096
    window: int = 512
    tp: int = 1
    pp: int = 1
    layout: LayoutRequest = LayoutRequest(Layout.DEINFER)
    batch: int = 4
    verify: bool = True  # False: a decomposed folder without its manifest (--no-verify)
    dtype: DType = DType.FLOAT32
    engine = Engine.MEGATRON

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", LayoutRequest.parse(self.layout))
        object.__setattr__(self, "dtype", DType.parse(self.dtype))

    @property
    def parallel(self) -> Parallelism:
        return Parallelism(self.tp, self.pp, self.layout)

    def check(self, arch: ModelArch, rank_config: RankConfig) -> None:
        if self.window > arch.max_positions:
            raise ValueError(f"--window {self.window} is longer than the model's context of "
                             f"{arch.max_positions} tokens; use --window {arch.max_positions} or less")
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be at least 1, got {self.max_tokens}")
        if self.batch < 1:
            raise ValueError(f"--batch must be at least 1 window per forward, got {self.batch}")
        token_windows(self.model, self.text, self.max_tokens, self.window)

    def workload(self) -> Workload:
        """A pass is one forward of batch × window tokens: priced as that many tokens through the
        weights, each attending to about a window of context."""
        return Workload(tp=self.tp, batch=self.batch * self.window, context=self.window, dtype=self.dtype.value)

    def footprint(self, arch: ModelArch) -> Footprint:
        """A pass's forward: ``batch`` windows, each its own context; the logits of every row, and
        the loss's float32 logits of one window beside them (the loss is taken a window at a time).

        The logits are counted in the job's dtype, two copies a row (``plan.logit_elements``);
        the loss's window in float32 holds its log-softmax, and in bfloat16 also the float32 copy
        it is taken from: 4 and 8 bytes a logit, counted as one and two more windows of logits
        (8 and 8 bytes a logit: the float32 count is more than it holds)."""
        rows = self.batch * self.window
        loss_windows = max(1, 4 // self.dtype.itemsize)  # float32: 1, bfloat16: 2
        return Footprint(prefill_rows=rows, context=self.window, logit_rows=rows + loss_windows * self.window,
                         rows_option="--batch")

    def check_plan(self, plan: LayoutPlan) -> None:
        """Any plan computes a perplexity."""


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


def _perplexity_on_rank(ctx: RankContext) -> dict:
    """One rank of the job: the summed NLL of every window, broadcast from the last stage."""
    job, stage = ctx.spec, ctx.stage
    windows = token_windows(job.model, job.text, job.max_tokens, job.window)
    device = stage.device  # the windows go where the stage lives
    total = torch.zeros(2, dtype=torch.float64, device=device)  # summed NLL, predicted tokens
    for batch in windows.to(device).split(job.batch):
        pos = torch.arange(batch.shape[1], device=device).expand_as(batch)
        logits = stage_forward(stage, batch, pos)
        if logits is not None:
            # One window at a time: its slice is contiguous, so only its log-softmax (and, from
            # bfloat16 logits, its float32 copy) is new memory (a window × vocab), not a copy of
            # the whole batch's logits and another for their log-softmax (``footprint``).
            nll = sum(F.cross_entropy(row[:-1].float(), ids[1:], reduction="sum").item()
                      for row, ids in zip(logits, batch))
            total += torch.tensor([nll, batch[:, 1:].numel()], dtype=torch.float64, device=device)
    total = broadcast_from_last_stage(stage, total if ctx.groups.is_last_stage else None, total)
    nll, count = total.tolist()
    plan = {"block_layouts": ctx.plan.to_json()} if job.layout.is_auto else {}
    return {"ppl": math.exp(nll / count), "tokens": int(count), "windows": int(windows.shape[0]),
            "layout": ctx.plan.name, **plan,  # the layout the ranks built (a launched auto: agreed there)
            "dtype": job.dtype.value}


def evaluate(job: PerplexityJob) -> dict | None:
    """Perplexity of ``job.model`` on ``job.text``; None on ranks that do not report. Everything
    is checked before the ranks start, and before ``--layout auto`` is priced (``runtime.job``)."""
    result = run_job(job, _perplexity_on_rank)
    if result is None:
        return None
    return {**result, "model": str(job.model), "tp": job.tp, "pp": job.pp}
