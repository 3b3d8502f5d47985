"""acc and acc_norm from per-choice log-likelihoods, against numbers worked out by hand and the
formulas of lm-evaluation-harness (``argmax(lls)``, ``argmax(lls / len(choice))``, the sample
standard error of the 0/1 scores)."""

from __future__ import annotations

import math
import statistics

import pytest

from deinfer_megatron.evaluation.accuracy import predictions, score
from deinfer_megatron.evaluation.items import Item


def test_length_normalisation_can_change_the_choice() -> None:
    # "cat." (4 characters) at -6 against "elephant." (9) at -9: raw prefers the short one,
    # per character (-1.5 against -1.0) the long one.
    item = Item(1, "I saw an", ("cat.", "elephant."), answer=1)
    assert predictions(item, [-6.0, -9.0]) == (0, 1)
    assert predictions(item, [-6.0, -5.0]) == (1, 1)
    tie = Item(2, "x", ("ab", "cd", "ef"), answer=2)
    assert predictions(tie, [-1.0, -1.0, -1.0]) == (0, 0), "ties go to the first choice, as argmax"


def test_summary_by_category_and_overall() -> None:
    items = [
        Item(1, "a", ("xx", "yyyy"), 0, "one"),        # raw -1 > -3: right; norm -0.5 > -0.75: right
        Item(2, "b", ("xx", "yyyy"), 1, "one"),        # raw -1 > -2 picks 0: wrong; norm -0.5 = -0.5 picks 0: wrong
        Item(3, "c", ("x", "yyyy", "z"), 1, "two"),    # raw -2 picks 1: right; norm -2/4 > -1 right
        Item(4, "d", ("xxxx", "y", "z"), 0, "two"),    # raw -4 < -2 picks 1: wrong; norm -1 vs -2, -3 picks 0: right
    ]
    lls = [[-1.0, -3.0], [-1.0, -2.0], [-3.0, -2.0, -4.0], [-4.0, -2.0, -3.0]]
    got = score(items, lls)
    raw, norm = [1, 0, 1, 0], [1, 0, 1, 1]
    assert got["items"] == 4 and got["acc"] == 0.5 and got["acc_norm"] == 0.75
    assert got["acc_stderr"] == pytest.approx(statistics.stdev(raw) / math.sqrt(4))
    assert got["acc_norm_stderr"] == pytest.approx(statistics.stdev(norm) / math.sqrt(4))
    assert got["chance"] == pytest.approx((0.5 + 0.5 + 1 / 3 + 1 / 3) / 4)
    assert list(got["categories"]) == ["one", "two"]
    assert got["categories"]["one"]["acc"] == 0.5 and got["categories"]["one"]["acc_norm"] == 0.5
    assert got["categories"]["two"]["acc"] == 0.5 and got["categories"]["two"]["acc_norm"] == 1.0
    assert [(r["line"], r["pred"], r["pred_norm"]) for r in got["per_item"]] == [
        (1, 0, 0), (2, 0, 0), (3, 1, 1), (4, 1, 0)]


def test_mismatched_log_likelihoods_are_refused() -> None:
    with pytest.raises(ValueError, match="3 log-likelihoods for the 2 choices of the item on line 7"):
        predictions(Item(7, "a", ("b", "c"), 0), [-1.0, -2.0, -3.0])
