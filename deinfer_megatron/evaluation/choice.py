"""Zero-shot multiple-choice accuracy of a (decomposed) model, computed by the Megatron model in
the chosen layout and parallel sizes (``eval-choice``).

Every choice of every item is one request, scored as lm-evaluation-harness scores a
``loglikelihood`` request: the context and the continuation (``" " + choice``) are tokenised
as the harness's ``_encode_pair`` does — trailing whitespace of the context moved to the
continuation, the context tokenised alone, the continuation's tokens taken as what the whole
text adds after them — and the model reads ``context + continuation`` without its last token;
the request's log-likelihood is the sum of ``log p(token | everything before it)`` over the
continuation's tokens. ``evaluation.accuracy`` turns them into ``acc`` and ``acc_norm``.

Requests are forwarded longest first, as many per forward as fit ``batch_tokens`` padded token
rows (each padded at its end: under causal attention a row's padding is never attended to by
its real tokens). Every rank tokenises the same items and runs the same forwards; the last
pipeline stage computes the log-likelihoods, which are broadcast so that global rank 0 reports
whatever the pipeline layout.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deinfer_megatron.arch.model import ModelArch
from deinfer_megatron.evaluation.accuracy import score
from deinfer_megatron.evaluation.items import SHIPPED_ITEMS, Item, read_items
from deinfer_megatron.models.pipeline import broadcast_from_last_stage, stage_forward
from deinfer_megatron.planning.pricing import Workload
from deinfer_megatron.planning.preflight import Footprint
from deinfer_megatron.planning.request import LayoutRequest
from deinfer_megatron.runtime.job import RankContext, run_job
from deinfer_megatron.runtime.options import DType, Engine, Parallelism
from deinfer_megatron.specs.layout import Layout, LayoutPlan
from deinfer_megatron.specs.rank_config import RankConfig


@dataclass(frozen=True)
class Request:
    """One choice of one item, tokenised: ``item`` indexes the items, ``choice`` its choices."""

    item: int
    choice: int
    context: tuple[int, ...]
    continuation: tuple[int, ...]

    @property
    def tokens(self) -> tuple[int, ...]:
        """What the model reads: context and continuation without the last token."""
        return (self.context + self.continuation)[:-1]


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-evaluation-harness's ``_encode_pair``: trailing
    whitespace of the context goes to the continuation, and the continuation's ids are the ids
    of ``context + continuation`` past the context's own (no special tokens added)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    return list(ctx), list(whole[len(ctx):])


def tokenise(tokenizer: Any, items: list[Item], where: Path) -> list[Request]:
    """Every request of ``items`` in item order, then choice order."""
    requests = []
    for i, item in enumerate(items):
        for k in range(len(item.choices)):
            ctx, cont = encode_pair(tokenizer, item.context, item.continuation(k))
            if not ctx or not cont:
                part = "context" if not ctx else f"choice {k}"
                raise ValueError(f"{where}:{item.line}: the {part} gives no tokens; give it some text")
            requests.append(Request(i, k, tuple(ctx), tuple(cont)))
    return requests


@functools.lru_cache(maxsize=4)
def _read_and_tokenise(model: str, items: str,
                       stamp: tuple[int, int] | None) -> tuple[tuple[Item, ...], tuple[Request, ...]]:
    import transformers

    parsed = read_items(Path(items))
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    return tuple(parsed), tuple(tokenise(tokenizer, parsed, Path(items)))


def load_requests(model: Path, items: Path) -> tuple[tuple[Item, ...], tuple[Request, ...]]:
    """The items of ``items`` and their requests under ``model``'s tokenizer; read once per
    process while the file is unchanged (the command checks them, then the ranks score them)."""
    try:
        st = Path(items).stat()
        stamp = (st.st_mtime_ns, st.st_size)
    except OSError:
        stamp = None  # read_items names the missing file
    return _read_and_tokenise(str(model), str(items), stamp)


def pack(requests: tuple[Request, ...], batch_tokens: int) -> list[list[int]]:
    """Request indices per forward: longest first (ties in request order), each forward as many
    requests as fit ``batch_tokens`` rows once padded to its first (longest) one."""
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i].tokens))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * len(requests[batches[-1][0]].tokens) <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


@dataclass(frozen=True)
class ChoiceJob:
    """Accuracy of ``model`` on the multiple-choice items of ``items`` (``runtime.job.JobSpec``).

    ``batch_tokens`` bounds the padded token rows of one forward (requests per forward × the
    longest of them). ``layout`` is parsed on construction (``LayoutRequest.parse``); ``"auto"``
    is priced by the cost model for a forward of ``batch_tokens`` rows.
    """

    model: Path
    items: Path = SHIPPED_ITEMS
    tp: int = 1
    pp: int = 1
    layout: LayoutRequest = LayoutRequest(Layout.DEINFER)
    batch_tokens: int = 2048
    verify: bool = True  # False: a decomposed folder without its manifest (--no-verify)
    dtype: DType = DType.FLOAT32
    engine = Engine.MEGATRON

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", LayoutRequest.parse(self.layout))
        object.__setattr__(self, "dtype", DType.parse(self.dtype))

    @property
    def parallel(self) -> Parallelism:
        return Parallelism(self.tp, self.pp, self.layout)

    def requests(self) -> tuple[tuple[Item, ...], tuple[Request, ...]]:
        return load_requests(self.model, self.items)

    def _longest(self) -> Request:
        return max(self.requests()[1], key=lambda r: len(r.tokens))

    def check(self, arch: ModelArch, rank_config: RankConfig) -> None:
        if self.batch_tokens < 1:
            raise ValueError(f"--batch-tokens must be at least 1, got {self.batch_tokens}")
        items, _ = self.requests()
        longest = self._longest()
        n, where = len(longest.tokens), f"{self.items}:{items[longest.item].line}"
        if n > arch.max_positions:
            raise ValueError(f"{where}: the context and choice {longest.choice} are {n} tokens, more than "
                             f"the model's context of {arch.max_positions}; shorten the item")
        if n > self.batch_tokens:
            raise ValueError(f"{where}: the context and choice {longest.choice} are {n} tokens, more than "
                             f"--batch-tokens {self.batch_tokens}; use --batch-tokens {n} or more")

    def workload(self) -> Workload:
        """A forward of ``batch_tokens`` rows, each attending to at most the longest request."""
        return Workload(tp=self.tp, batch=self.batch_tokens, context=len(self._longest().tokens),
                        dtype=self.dtype.value)

    def footprint(self, arch: ModelArch) -> Footprint:
        """A forward of ``batch_tokens`` rows and their logits, and one request's
        continuation log-softmax beside them (counted as the longest request's rows)."""
        longest = len(self._longest().tokens)
        return Footprint(prefill_rows=self.batch_tokens, context=longest,
                         logit_rows=self.batch_tokens + longest, rows_option="--batch-tokens")

    def check_plan(self, plan: LayoutPlan) -> None:
        """Any plan scores the items."""


def _score_on_rank(ctx: RankContext) -> dict:
    """One rank of the job: every request's log-likelihood, broadcast from the last stage."""
    job, stage = ctx.spec, ctx.stage
    _, requests = job.requests()
    device = stage.device
    lls = torch.zeros(len(requests), dtype=torch.float64, device=device)
    batches = pack(requests, job.batch_tokens)
    for batch in batches:
        width = len(requests[batch[0]].tokens)
        ids = torch.zeros(len(batch), width, dtype=torch.long)  # padding: token 0, never attended to
        for row, i in enumerate(batch):
            ids[row, : len(requests[i].tokens)] = torch.tensor(requests[i].tokens)
        logits = stage_forward(stage, ids, torch.arange(width).expand_as(ids))
        if logits is None:
            continue
        for row, i in enumerate(batch):
            r = requests[i]
            first = len(r.context) - 1  # the row that predicts the continuation's first token
            rows = logits[row, first: first + len(r.continuation)].double()
            target = torch.tensor(r.continuation, device=device).unsqueeze(1)
            lls[i] = torch.log_softmax(rows, dim=-1).gather(1, target).sum()
    lls = broadcast_from_last_stage(stage, lls if ctx.groups.is_last_stage else None, lls)
    plan = {"block_layouts": ctx.plan.to_json()} if job.layout.is_auto else {}
    return {"loglikelihoods": lls.tolist(), "forwards": len(batches),
            "layout": ctx.plan.name, **plan}  # the layout the ranks built (a launched auto: agreed there)


def evaluate_choices(job: ChoiceJob) -> dict | None:
    """Accuracy of ``job.model`` on ``job.items``; None on ranks that do not report.

    Everything is checked before the ranks start (``runtime.job``). The result is
    ``evaluation.accuracy.score``'s (``acc``, ``acc_norm``, ..., ``categories``, ``per_item``)
    with ``requests`` (choices scored), ``tokens`` (continuation tokens scored), ``forwards``,
    ``layout`` (``block_layouts`` under auto), ``model``, ``items_file``, ``tp`` and ``pp``."""
    result = run_job(job, _score_on_rank)
    if result is None:
        return None
    items, requests = job.requests()
    per_item: list[list[float]] = [[] for _ in items]
    for r, ll in zip(requests, result.pop("loglikelihoods")):
        per_item[r.item].append(ll)
    return {**score(items, per_item), "requests": len(requests),
            "tokens": sum(len(r.continuation) for r in requests), **result,
            "model": str(job.model), "items_file": str(job.items), "tp": job.tp, "pp": job.pp}
