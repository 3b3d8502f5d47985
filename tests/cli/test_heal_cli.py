"""``deinfer-megatron heal`` as a user runs it: killed and resumed it ends with the weights of
an uninterrupted run, bit for bit — with either student (``logits``: the Megatron stage;
``blocks-then-logits``: the Hugging Face model, both of its step kinds); bad input is one line
and leaves nothing behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from deinfer_megatron.cli.main import run
from deinfer_megatron.files.failpoints import ENV
from deinfer_megatron.healing.state import state_dir
from tests.helpers.healing import HealPair, heal_pair
from tests.robustness.harness import run_cli


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> HealPair:
    return heal_pair(tmp_path_factory.mktemp("heal-pair"))


def _heal_args(pair, out: Path, *extra: str) -> list[str]:
    return ["heal", "--model", str(pair.dec), "--teacher", str(pair.dense), "--calib-text", str(pair.heal_text),
            "--tokens", str(6 * 2 * 32), "--batch", "2", "--seq-len", "32", "--lr", "3e-3", "--warmup", "2",
            "--save-every", "2", "--out", str(out), *extra]


@pytest.mark.parametrize("distill", ["logits", "blocks-then-logits"])
def test_resume_after_a_kill_ends_with_the_uninterrupted_weights(pair, tmp_path, distill) -> None:
    whole = run_cli(*_heal_args(pair, tmp_path / "whole", "--distill", distill), tmp=tmp_path)
    assert whole.code == 0, whole.stderr[-2000:]
    out, log = tmp_path / "resumed", tmp_path / "log.jsonl"
    killed = run_cli(*_heal_args(pair, out, "--distill", distill, "--json", str(log)), tmp=tmp_path,
                     env={ENV: "heal.after-checkpoint"})
    assert killed.code == -9, killed.stderr[-2000:]
    assert not out.exists() and (state_dir(out) / "checkpoint" / "meta.pt").is_file()  # nothing published, state kept
    resumed = run_cli(*_heal_args(pair, out, "--distill", distill, "--json", str(log), "--resume"), tmp=tmp_path)
    assert resumed.code == 0, resumed.stderr[-2000:]
    a, b = load_file(str(tmp_path / "whole" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(a[k].equal(b[k]) for k in a), [k for k in a if not a[k].equal(b[k])][:5]
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == list(range(1, 7))
    assert not state_dir(out).exists()  # removed once the healed folder is published


def _one_line_error(capsys, args: list[str], *needles: str) -> None:
    assert run(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "error:" in err[0], err
    for needle in needles:
        assert needle in err[0], (needle, err[0])


def test_bad_inputs_are_one_line_and_write_nothing(pair, tmp_path, capsys) -> None:
    from tests.helpers.tiny_models import save_tiny_folder

    out = tmp_path / "out"
    other_arch = tmp_path / "wider"
    save_tiny_folder("llama", other_arch, num_hidden_layers=3)
    other_tok = tmp_path / "other-tokenizer"
    shutil.copytree(pair.dense, other_tok)
    tok = json.loads((other_tok / "tokenizer.json").read_text())
    tok["added_tokens"] = tok["added_tokens"][:-1]
    (other_tok / "tokenizer.json").write_text(json.dumps(tok))
    base = _heal_args(pair, out)

    def with_(flag: str, value: str | None) -> list[str]:
        args = list(base)
        i = args.index(flag)
        return args[:i] + args[i + 2:] + ([flag, value] if value is not None else [])

    _one_line_error(capsys, with_("--teacher", str(pair.dec)), "--teacher", "itself decomposed")
    _one_line_error(capsys, with_("--teacher", str(other_arch)), "different architectures", "num_layers")
    _one_line_error(capsys, with_("--teacher", str(other_tok)), "different tokenizers")
    _one_line_error(capsys, with_("--model", str(pair.dense)), "is not decomposed")
    _one_line_error(capsys, with_("--tokens", "0"), "--tokens must be a positive")
    _one_line_error(capsys, [*base, "--source-weights", "1", "2"], "--source-weights gives 2 weights for 1 sources")
    _one_line_error(capsys, [*base, "--source-weights", "0"], "--source-weights must be positive finite")
    _one_line_error(capsys, [*base, "--source-weights", "nan"], "--source-weights must be positive finite")
    _one_line_error(capsys, [*base, "--calib-temperature", "0.5"], "--calib-temperature sets how", "--calib-self")
    _one_line_error(capsys, [*base, "--calib-answers", "greedy"], "--calib-answers sets how", "--calib-self")
    _one_line_error(capsys, [*base, "--resume"], "--resume", "no killed run")
    out.mkdir()
    _one_line_error(capsys, base, "--out", "exists")
    out.rmdir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-tokenizer", "wider"]  # nothing written


def test_source_weights_are_saved_for_a_resume(pair, tmp_path) -> None:
    """The job saves the weights with the windows (``data.pt``) and records them per source, so a
    resumed run (which reads only ``data.pt``) takes the same weighted turns."""
    from deinfer_megatron.healing.job import HealJob, _data, _saved_data

    other = tmp_path / "other.txt"
    shutil.copy(pair.heal_text, other)
    job = HealJob(model=pair.dec, teacher=pair.dense, out=tmp_path / "out", calib_text=(pair.heal_text, other),
                  source_weights=(3.0, 1.0), tokens=64, seq_len=32)
    folder = tmp_path / "state"
    built = _data(job, folder)
    saved = _saved_data(folder)
    assert built.weights == saved.weights == [3.0, 1.0]
    assert [s["weight"] for s in saved.sources] == [3.0, 1.0]
    assert json.loads((folder / "job.json").read_text())["source_weights"] == [3.0, 1.0]
    turns = [saved.turn(k)[0] for k in range(8)]
    assert turns.count(0) == 6 and turns.count(1) == 2


def test_greedy_answers_are_the_windows_healed_on_and_a_resume_must_repeat_them(pair, tmp_path) -> None:
    """``--calib-answers greedy``: the conversation windows are the teacher's greedy answers to
    its sampled questions (the stream ``self_conversations(answer_temperature=0)`` renders),
    recorded per source and in ``job.json``; a resume asking for sampled answers is refused."""
    import transformers

    from deinfer_megatron.decompose.calibration import self_conversations
    from deinfer_megatron.healing.job import HealJob, _data, _saved_data
    from deinfer_megatron.healing.state import check_same_job

    job = HealJob(model=pair.dec, teacher=pair.dense, out=tmp_path / "out", calib_self=2, calib_temperature=0.7,
                  calib_answers="greedy", tokens=192, seq_len=96, seed=3)  # windows long enough to answer
    folder = tmp_path / "state"
    _data(job, folder)
    saved = _saved_data(folder)
    tok = transformers.AutoTokenizer.from_pretrained(pair.dense)
    teacher = transformers.AutoModelForCausalLM.from_pretrained(pair.dense).eval()

    def stream(answers: float | None) -> list[int]:
        texts = self_conversations(teacher, tok, tokens=192, rows=2, seq_len=96, seed=3, temperature=0.7,
                                   answer_temperature=answers)
        return [t for text in texts for t in tok(text, add_special_tokens=False)["input_ids"]][:192]

    assert len(saved.windows) == 1 and saved.windows[0].flatten().tolist() == stream(0)
    assert stream(0) != stream(None)  # the sampled answers are other windows
    assert saved.sources == [{"self_dialogues": 2, "tokens": 192, "temperature": 0.7, "answers": "greedy"}]
    assert json.loads((folder / "job.json").read_text())["calib_answers"] == "greedy"
    sampled = HealJob(**{**job.__dict__, "calib_answers": "sampled", "resume": True})
    with pytest.raises(ValueError, match=r"--resume with a different calib_answers \('sampled'; the killed run used "
                                         r"'greedy'\)"):
        check_same_job(folder, sampled.settings(), sampled.omitted_settings())
    check_same_job(folder, job.settings(), job.omitted_settings())  # the same run resumes
