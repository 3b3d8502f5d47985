"""Zero-shot multiple-choice accuracy from the log-likelihood of each choice, as
lm-evaluation-harness scores its ``multiple_choice`` tasks (HellaSwag, ARC, PIQA, ...).

For an item with choices ``c_0 .. c_{n-1}`` and ``ll_k`` the summed log-likelihood of
choice ``k``'s tokens given the context:

- ``acc``: the item is right when ``argmax_k ll_k`` is its answer;
- ``acc_norm``: the same with ``ll_k / len(c_k)``, the choice's length in characters (the
  harness's ``completion_len``, the choice without its leading delimiter), so that a long
  choice is not penalised for having more tokens to pay for.

Ties go to the first choice (``argmax``'s rule). The standard errors are the harness's
``mean_stderr``: the sample standard deviation of the 0/1 scores over ``sqrt(n)``.
"""

from __future__ import annotations

import math
from typing import Sequence

from deinfer_megatron.evaluation.items import Item


def _argmax(values: Sequence[float]) -> int:
    best = 0
    for k, v in enumerate(values):
        if v > values[best]:
            best = k
    return best


def predictions(item: Item, loglikelihoods: Sequence[float]) -> tuple[int, int]:
    """(the raw prediction, the length-normalised prediction) for ``item``."""
    if len(loglikelihoods) != len(item.choices):
        raise ValueError(f"{len(loglikelihoods)} log-likelihoods for the {len(item.choices)} choices "
                         f"of the item on line {item.line}")
    norm = [ll / len(choice) for ll, choice in zip(loglikelihoods, item.choices)]
    return _argmax(loglikelihoods), _argmax(norm)


def _stderr(hits: int, n: int) -> float | None:
    if n < 2:
        return None
    p = hits / n
    return math.sqrt(p * (1.0 - p) / (n - 1))


def _summary(items: Sequence[Item], preds: Sequence[tuple[int, int]]) -> dict:
    n = len(items)
    acc = sum(p == it.answer for it, (p, _) in zip(items, preds))
    norm = sum(p == it.answer for it, (_, p) in zip(items, preds))
    return {"items": n, "acc": acc / n, "acc_norm": norm / n,
            "acc_stderr": _stderr(acc, n), "acc_norm_stderr": _stderr(norm, n),
            "chance": sum(1.0 / len(it.choices) for it in items) / n}


def score(items: Sequence[Item], loglikelihoods: Sequence[Sequence[float]]) -> dict:
    """Accuracy over ``items`` (``loglikelihoods[i][k]``: item ``i``'s choice ``k``): the
    overall summary (``items``, ``acc``, ``acc_norm``, their standard errors, ``chance``, the
    accuracy of guessing), ``categories`` (the same summary per category, in order of first
    appearance) and ``per_item`` (line, category, answer, log-likelihoods, both predictions)."""
    if not items:
        raise ValueError("no items to score")
    preds = [predictions(it, lls) for it, lls in zip(items, loglikelihoods, strict=True)]
    categories: dict[str, list[int]] = {}
    for i, it in enumerate(items):
        categories.setdefault(it.category, []).append(i)
    per_category = {name: _summary([items[i] for i in rows], [preds[i] for i in rows])
                    for name, rows in categories.items()}
    per_item = [{"line": it.line, "category": it.category, "answer": it.answer,
                 "loglikelihoods": [float(x) for x in lls], "pred": p, "pred_norm": q}
                for it, lls, (p, q) in zip(items, loglikelihoods, preds)]
    return {**_summary(items, preds), "categories": per_category, "per_item": per_item}
