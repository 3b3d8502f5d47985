"""``heal`` lowers the KL to the teacher on held-out text, measured independently of the
project: both models are plain transformers models (the student's factors multiplied out
from the written safetensors) and the KL is the textbook sum ``Σ p (log p − log q)``. Both
students (the Megatron stage for logits, the Hugging Face model for blocks) follow the one
learning-rate schedule, written out here."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from deinfer_megatron.checkpoints.folder import MANIFEST, open_model
from deinfer_megatron.healing.job import HealJob, run_heal
from deinfer_megatron.healing.loss import token_kl


def schedule(n: int, *, lr: float, warmup: int, steps: int) -> float:
    """The learning rate of step n (1-based): linear warm-up to ``lr`` over ``warmup`` steps,
    then a cosine to ``lr / 10`` at step ``steps`` (docs/HEALING.md)."""
    if n <= warmup:
        return lr * n / warmup
    return lr / 10 + (lr - lr / 10) * 0.5 * (1 + math.cos(math.pi * (n - warmup) / (steps - warmup)))


def _multiplied_out(folder: Path) -> torch.nn.Module:
    """The decomposed folder as an ordinary dense transformers model (W = U·V)."""
    state = load_file(str(folder / "model.safetensors"))
    dense = {}
    for name, t in state.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "u":
            dense[f"{module}.weight"] = t @ state[f"{module}.v"]
        elif leaf != "v":
            dense[name] = t
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
    missing, unexpected = model.load_state_dict(dense, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model.eval()


def _ids(teacher: Path, text: Path, n: int, seq: int) -> torch.Tensor:
    tok = transformers.AutoTokenizer.from_pretrained(teacher)
    return torch.tensor(tok(text.read_text(), add_special_tokens=False)["input_ids"][:n * seq]).view(n, seq)


def _reference_ppl(model: torch.nn.Module, ids: torch.Tensor) -> float:
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[:, :-1].double(), -1)
    return float(torch.exp(-logp.gather(-1, ids[:, 1:, None]).mean()))


def _reference_kl(teacher: Path, student: Path, text: Path) -> float:
    ids = _ids(teacher, text, 4, 64)
    t_model = transformers.AutoModelForCausalLM.from_pretrained(teacher).eval()
    with torch.no_grad():
        p = torch.softmax(t_model(ids).logits.double(), -1)
        q = torch.softmax(_multiplied_out(student)(ids).logits.double(), -1)
    return float((p * (p.log() - q.log())).sum(-1).mean())


def test_token_kl_is_the_textbook_formula() -> None:
    gen = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 5, 11, generator=gen), torch.randn(2, 5, 11, generator=gen)
    p, q = t.softmax(-1), s.softmax(-1)
    assert torch.allclose(token_kl(s, t), (p * (p.log() - q.log())).sum(-1).mean(), atol=1e-6)


@pytest.mark.parametrize("distill", ["logits", "blocks"])
def test_heal_lowers_the_kl_on_held_out_text(pair, tmp_path, distill) -> None:
    out, log = tmp_path / "healed", tmp_path / "log.jsonl"
    summary = run_heal(HealJob(model=pair.dec, teacher=pair.dense, out=out, calib_text=(pair.heal_text,),
                               tokens=24 * 2 * 32, batch=2, seq_len=32, lr=3e-3, warmup=2, distill=distill,
                               eval_text=(pair.held_out,), eval_every=12, eval_tokens=256, json_log=log))
    before = _reference_kl(pair.dense, pair.dec, pair.held_out)
    after = _reference_kl(pair.dense, out, pair.held_out)
    assert after < 0.8 * before, (before, after)
    # the held-out curve (--eval-text) is the perplexity transformers computes on the same windows
    ids, name = _ids(pair.dense, pair.held_out, 8, 32), pair.held_out.name
    expected = {"teacher": _reference_ppl(transformers.AutoModelForCausalLM.from_pretrained(pair.dense).eval(), ids),
                "before": _reference_ppl(_multiplied_out(pair.dec), ids),
                "after": _reference_ppl(_multiplied_out(out), ids)}
    for key, value in expected.items():
        assert abs(summary["eval"][key][name] - value) <= 1e-4 * value, (key, summary["eval"], expected)
    # the folder is a decomposed folder like decompose writes: verified, same ranks, healing recorded
    healed, original = open_model(out), open_model(pair.dec)
    assert dict(healed.rank_config.modules) == dict(original.rank_config.modules)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["method"] == "svd" and manifest["healing"]["teacher"] == str(pair.dense)
    assert manifest["healing"]["steps"] == 24 and manifest["healing"]["tokens"] == 24 * 2 * 32
    if distill == "logits":
        assert manifest["healing"]["final_kl"] < manifest["healing"]["first_kl"]
    steps = [r for r in map(json.loads, log.read_text().splitlines()) if r["step"] > 0]
    assert [r["kind"] for r in steps] == [distill] * 24
    assert [r["lr"] for r in steps] == pytest.approx([schedule(n, lr=3e-3, warmup=2, steps=24) for n in range(1, 25)],
                                                     rel=1e-12)


def test_a_run_checkpointed_by_the_earlier_format_is_not_resumed_silently(pair, tmp_path) -> None:
    """A killed one-process run of the previous version left ``state.pt`` and no ``checkpoint/``:
    ``--resume`` says it cannot continue it, rather than starting again from step 0."""
    from deinfer_megatron.healing import state as run_state

    job = HealJob(model=pair.dec, teacher=pair.dense, out=tmp_path / "healed", calib_text=(pair.heal_text,),
                  tokens=2 * 2 * 32, batch=2, seq_len=32, distill="blocks", resume=True)
    folder = run_state.state_dir(job.out)
    folder.mkdir(parents=True)
    run_state.save_json(folder / "job.json", job.settings())
    torch.save({"step": 3}, folder / "state.pt")
    with pytest.raises(ValueError, match=r"checkpointed by an earlier version of heal \(state\.pt\).*without --resume"):
        run_heal(job)
    assert not job.out.exists() and (folder / "state.pt").is_file(), "nothing written, nothing removed"
