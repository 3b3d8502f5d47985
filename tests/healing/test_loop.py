"""The healing loop's contract, driven by a scripted student with no model: which steps of
which kind run, what each record holds, when the schedule's length is fixed, when the
held-out probe and the checkpoints run, and that a run resumed after a crash ends with the
records, log and weights of the uninterrupted run. The expected values are written out here
from docs/HEALING.md, not computed by the loop's own helpers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from deinfer_megatron.healing.loop import LoopSettings, train
from deinfer_megatron.healing.state import CHECKPOINT, FINAL, STAGED
from deinfer_megatron.healing.student import StepOutcome

B, S = 2, 3  # windows per step, tokens per window


class Steps:
    """Step ``k``'s batch is all ``k + 1``: a skipped or repeated step changes the weight."""

    def batch(self, step: int, batch: int, seed: int) -> torch.Tensor:
        return torch.full((batch, S), step + 1 + seed, dtype=torch.long)


class Crash(Exception):
    pass


class Scripted:
    """A student whose one weight is the sum of every batch it stepped on; each step "takes"
    ``seconds`` on rank 0's clock (a list: step k takes its k-th entry, the last one after)."""

    reports = True

    def __init__(self, seconds: float | list[float] = 0.25, crash_at: int | None = None) -> None:
        self.weight, self.seconds, self.crash_at = 0.0, seconds, crash_at
        self.planned: list[tuple[int, int]] = []  # (schedule length, steps taken when it was set)
        self.taken = 0

    def plan(self, total_steps: int) -> None:
        self.planned.append((total_steps, self.taken))

    def step(self, ids: torch.Tensor, kind: str) -> StepOutcome:
        self.taken += 1
        if self.taken == self.crash_at:
            raise Crash
        self.weight += float(ids.sum())
        return StepOutcome(loss=self.weight, grad_norm=1.0, lr=0.5, teacher_s=0.01, parts={"kl": self.weight / 2})

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.full((*ids.shape, 3), self.weight)

    def teacher_logits(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.full((*ids.shape, 3), -1.0)

    def agreed(self, seconds: float) -> float:
        if isinstance(self.seconds, list):
            return self.seconds[min(self.taken, len(self.seconds)) - 1]
        return self.seconds

    def barrier(self) -> None:
        pass

    def save(self, folder: Path) -> None:
        (folder / "weight.json").write_text(json.dumps(self.weight))

    def load(self, folder: Path) -> None:
        self.weight = json.loads((folder / "weight.json").read_text())

    def save_final(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "weight.json").write_text(json.dumps(self.weight))


class Probe:
    """A held-out "perplexity": the first logit the model gives."""

    def perplexity_of(self, logits_fn) -> dict[str, float]:
        return {"probe": float(logits_fn(torch.zeros(1, 2, dtype=torch.long))[0, 0, 0])}


def _settings(**kw) -> LoopSettings:
    return LoopSettings(**{"lr": 1e-3, "warmup": 2, "batch": B, "seq_len": S, "steps": 6, "seconds": None, **kw})


def _weight_after(steps: int, seed: int = 0) -> float:
    return float(sum(B * S * (k + 1 + seed) for k in range(steps)))


def test_a_token_budget_runs_its_steps_with_the_documented_records(tmp_path) -> None:
    student, log = Scripted(), tmp_path / "log.jsonl"
    healed = train(student, Steps(), _settings(eval_every=4, save_every=4), state_folder=tmp_path, log=log,
                   held_out=Probe())
    assert student.planned == [(6, 0)] and healed.teacher_eval == {"probe": -1.0}
    assert healed.records[0] == {"step": 0, "tokens": 0, "elapsed_s": 0.0, "eval": {"probe": 0.0}}
    steps = healed.records[1:]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert list(steps[0]) == ["step", "kind", "tokens", "loss", "kl", "lr", "grad_norm", "tokens_per_s",
                              "teacher_s", "elapsed_s"]
    for k, r in enumerate(steps, start=1):
        assert r["kind"] == "logits" and r["tokens"] == k * B * S and r["loss"] == _weight_after(k)
        assert r["kl"] == _weight_after(k) / 2 and r["tokens_per_s"] == B * S / 0.25
        assert r["elapsed_s"] == 0.25 * k and r["teacher_s"] == 0.01
    assert [r["step"] for r in steps if "eval" in r] == [4, 6]  # every 4 steps, and after the last
    assert steps[3]["eval"] == {"probe": _weight_after(4)}
    assert [json.loads(line) for line in log.read_text().splitlines()] == healed.records
    meta = torch.load(tmp_path / CHECKPOINT / "meta.pt", weights_only=True)
    assert (meta["step"], meta["planned"], meta["elapsed"]) == (4, 6, 1.0)
    assert json.loads((tmp_path / CHECKPOINT / "weight.json").read_text()) == _weight_after(4)
    assert not (tmp_path / STAGED).exists()
    assert json.loads((tmp_path / FINAL / "weight.json").read_text()) == _weight_after(6)


def test_a_time_budget_sets_the_schedule_from_the_first_step_and_splits_blocks_then_logits(tmp_path) -> None:
    student = Scripted(seconds=0.3)
    healed = train(student, Steps(), _settings(steps=None, seconds=1.0, warmup=1, distill="blocks-then-logits"),
                   state_folder=tmp_path)
    assert [r["elapsed_s"] for r in healed.records] == [0.3, 0.6, 0.9, 1.2]  # checked before each step
    assert student.planned == [(math.ceil(1.0 / 0.3), 1)]  # once, after the first step (a warm-up of one)
    # the budget spent before each step: 0, 0.3, 0.6, 0.9 — block-wise below half of it
    assert [r["kind"] for r in healed.records] == ["blocks", "blocks", "logits", "logits"]
    slow = Scripted(seconds=5.0)  # one step overruns the budget: the warm-up still fits the schedule
    train(slow, Steps(), _settings(steps=None, seconds=1.0, warmup=3), state_folder=tmp_path / "slow")
    assert slow.planned == [(4, 1)]


def test_a_slow_first_step_does_not_end_the_cosine_early(tmp_path) -> None:
    """The first step takes 3 s, every later one 1 s, the budget is 10 s: 8 steps fit (3 + 7).
    Set from the first step alone the cosine would end at step 4 (10 / 3), and half the run
    would be at the floor; set again after each warm-up step from the steps after the first,
    it ends at the budget's last step: 2 + (10 - 4) / 1 = 8 after step 2, 3 + (10 - 5) / 1 = 8
    after step 3 (unchanged, so not set again), and left alone after the warm-up."""
    student = Scripted(seconds=[3.0, 1.0])
    healed = train(student, Steps(), _settings(steps=None, seconds=10.0, warmup=3), state_folder=tmp_path)
    assert len(healed.records) == 8 and healed.records[-1]["elapsed_s"] == 10.0
    assert student.planned == [(4, 1), (8, 2)]
    uneven = Scripted(seconds=[3.0, 1.0, 2.0, 1.0])  # step 3 takes 2 s: the steps after the first, 1.5 s each
    healed = train(uneven, Steps(), _settings(steps=None, seconds=10.0, warmup=3), state_folder=tmp_path / "uneven")
    assert uneven.planned == [(4, 1), (8, 2), (6, 3)]  # 3 + ceil((10 - 6) / 1.5); then fixed
    assert len(healed.records) == 7  # 3 + 1 + 2 + 1 + 1 + 1 + 1 = 10


@pytest.mark.parametrize("seconds,warmup,crash_at", [(None, 2, 5), (1.5, 2, 5), (1.5, 4, 3)])
def test_a_resumed_run_ends_like_the_uninterrupted_one(tmp_path, seconds, warmup, crash_at) -> None:
    """Killed in step 5 (after the checkpoint of step 4), or in step 3 of a time budget still
    warming up (after the checkpoint of step 2: the resumed run sets the length again from the
    first step's time in the restored records)."""
    kw = dict(save_every=2, eval_every=3, warmup=warmup, **({"steps": None, "seconds": seconds} if seconds else {}))
    whole = Scripted()
    expected = train(whole, Steps(), _settings(**kw), state_folder=tmp_path / "whole", log=tmp_path / "whole.jsonl",
                     held_out=Probe())
    folder, log = tmp_path / "run", tmp_path / "run.jsonl"
    with pytest.raises(Crash):  # the step never finishes: the checkpoint before it is the last
        train(Scripted(crash_at=crash_at), Steps(), _settings(**kw), state_folder=folder, log=log, held_out=Probe())
    assert torch.load(folder / CHECKPOINT / "meta.pt", weights_only=True)["step"] == crash_at - 1
    resumed = Scripted()
    got = train(resumed, Steps(), _settings(**kw), state_folder=folder, resume=True, log=log, held_out=Probe())
    assert got.records == expected.records and resumed.weight == whole.weight == _weight_after(6)
    assert log.read_text() == (tmp_path / "whole.jsonl").read_text()
    assert resumed.planned == [(6, 0)]  # the killed run's schedule, from its checkpoint, before any step
