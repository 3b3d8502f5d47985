"""Bad input a user can give, each answered by one line on stderr and exit status 2.

These fail before any rank starts, so they run the CLI's ``run()`` in this process (a second
each instead of a fresh interpreter's start-up); the cases that start ranks, kill processes or
write folders run as real processes in the other modules. A traceback would surface here as
an exception out of ``run()``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from deinfer_megatron.cli.main import run


def cli_error(capfd, *argv: str) -> str:
    code = run([str(a) for a in argv])
    out, err = capfd.readouterr()
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err[-3000:])
    return lines[0]


def _copy(src: Path, dst: Path, **config_changes) -> Path:
    shutil.copytree(src, dst)
    if config_changes:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **config_changes}))
    return dst


def gen(model: Path, *extra: str) -> list[str]:
    return ["generate", "--model", str(model), "--max-new-tokens", "2", *extra]


def test_missing_or_broken_config(models, tmp_path, capfd) -> None:
    line = cli_error(capfd, *gen(tmp_path / "nonexistent", "--prompt", "Hi"))
    assert "no config.json in" in line and "does not exist" in line
    broken = _copy(models.dense, tmp_path / "broken")
    (broken / "config.json").write_text("{not json")
    assert f"{broken / 'config.json'} is not valid JSON" in cli_error(capfd, *gen(broken, "--prompt", "Hi"))
    (broken / "config.json").write_text("[1, 2]")
    assert "must hold a JSON object" in cli_error(capfd, "plan", "--model", broken)


def test_sizes_that_do_not_match(models, tmp_path, capfd) -> None:
    huge = _copy(models.dense, tmp_path / "huge", hidden_size=10**9)
    line = cli_error(capfd, *gen(huge, "--prompt", "Hi"))
    assert "GiB is available" in line and "hidden_size 1000000000" in line
    wrong = _copy(models.dense, tmp_path / "wrong", intermediate_size=100)
    line = cli_error(capfd, *gen(wrong, "--prompt", "Hi"))
    assert "model.layers.0.mlp.gate_proj.weight has shape [96, 64] but config.json implies [100, 64]" in line
    assert "4 layers do not split evenly over --pp 3" in cli_error(capfd, *gen(models.dense, "--prompt", "Hi", "--pp", "3"))
    assert "valid TP sizes: 1, 2, 4, 8" in cli_error(capfd, *gen(models.dense, "--prompt", "Hi", "--tp", "3"))
    assert "exceeds the model's context of 4096" in cli_error(capfd, *gen(models.dense, "--prompt", "word " * 5000))


def test_auto_is_priced_only_after_the_input_is_checked(models, tmp_path, capfd, monkeypatch) -> None:
    """``--layout auto`` (the default of ``generate`` and ``eval-ppl``) prices the job only once
    its input is known good: a first run on a host calibrates for tens of seconds and times
    matrix products at the model's own shapes, so bad input on a decomposed folder, and sizes
    that fit under no layout, fail first."""
    def never(*args, **kwargs):
        raise AssertionError("--layout auto was priced before the input was checked")

    monkeypatch.setattr("deinfer_megatron.planning.auto.auto_plan", never)
    auto = ("--layout", "auto")
    assert "exceeds the model's context of 4096" in cli_error(
        capfd, *gen(models.decomposed, *auto, "--prompt", "word " * 5000))
    assert "valid TP sizes: 1, 2, 4, 8" in cli_error(capfd, *gen(models.decomposed, *auto, "--prompt", "Hi", "--tp", "3"))
    huge = _copy(models.decomposed, tmp_path / "huge", hidden_size=10**9)
    line = cli_error(capfd, *gen(huge, *auto, "--prompt", "Hi", "--no-verify"))
    assert "GiB is available" in line and "hidden_size 1000000000" in line
    text = tmp_path / "text.txt"
    text.write_text("It is a truth universally acknowledged. " * 200)
    line = cli_error(capfd, "eval-ppl", "--model", huge, "--text", text, *auto, "--no-verify")
    assert "GiB is available" in line and "hidden_size 1000000000" in line
    assert "lower --batch" in line, "eval-ppl's forward is bounded by its windows per forward"


def test_prompts_files(models, tmp_path, capfd) -> None:
    not_a_string = tmp_path / "ints.jsonl"
    not_a_string.write_text('{"prompt": "fine"}\n{"prompt": 12345}\n')
    assert f'{not_a_string}:2: "prompt" must be a string' in cli_error(
        capfd, *gen(models.dense, "--prompts-file", not_a_string))
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    assert f"{latin1} is not UTF-8 text" in cli_error(capfd, *gen(models.dense, "--prompts-file", latin1))
    assert "prompts file" in cli_error(capfd, *gen(models.dense, "--prompts-file", tmp_path / "absent.jsonl"))


def test_sampling_and_budget_numbers(models, capfd) -> None:
    base = gen(models.dense, "--prompt", "Hi")
    assert "--temperature must be a number ≥ 0" in cli_error(capfd, *base, "--temperature", "nan")
    assert "--temperature must be a number ≥ 0" in cli_error(capfd, *base, "--temperature", "-0.5")
    assert "--top-p must be in (0, 1]" in cli_error(capfd, *base, "--top-p", "nan")
    assert "--kv-budget-gb must be a number of GB > 0" in cli_error(capfd, *base, "--kv-budget-gb", "nan")
    assert "--kv-budget-gb must be a number of GB > 0" in cli_error(capfd, *base, "--kv-budget-gb", "0")
    assert "--max-prefill-tokens must be a positive whole" in cli_error(capfd, *base, "--max-prefill-tokens", "-1")
    assert "--greedy cannot be combined" in cli_error(capfd, *base, "--greedy", "--temperature", "0.7")


def test_text_files(models, tmp_path, capfd) -> None:
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 64)
    line = cli_error(capfd, "decompose", "--model", models.dense, "--method", "svd-llm", "--ratio", "0.5",
                     "--calib-text", binary, "--out", tmp_path / "never")
    assert f"calibration text {binary} is a binary file, not text" in line
    assert not (tmp_path / "never").exists()
    text = tmp_path / "text.txt"
    text.write_text("It is a truth universally acknowledged. " * 200)
    line = cli_error(capfd, "decompose", "--model", models.dense, "--method", "svd-llm", "--ratio", "0.5",
                     "--calib-text", text, binary, "--out", tmp_path / "never")  # the second of two files
    assert f"calibration text {binary} is a binary file, not text" in line
    assert not (tmp_path / "never").exists()
    line = cli_error(capfd, "eval-ppl", "--model", models.dense, "--text", text, "--window", "8192")
    assert "--window 8192 is longer than the model's context of 4096 tokens" in line
    assert f"text file {binary} is a binary file" in cli_error(capfd, "eval-ppl", "--model", models.dense, "--text", binary)
    line = cli_error(capfd, "eval-ppl", "--model", models.dense, "--text", text, "--batch", "0")
    assert "--batch must be at least 1 window per forward, got 0" in line


def test_decompose_options(models, tmp_path, capfd) -> None:
    base = ["decompose", "--model", models.dense, "--out", tmp_path / "o"]
    assert "--ratio must be in (0, 1]" in cli_error(capfd, *base, "--method", "svd", "--ratio", "1.5")
    assert "needs calibration data" in cli_error(capfd, *base, "--method", "svd-llm", "--ratio", "0.5")
    ranks = tmp_path / "ranks.json"
    ranks.write_text(json.dumps({"model.layers.9.self_attn.q_proj": 4}))
    assert "unknown module 'model.layers.9.self_attn.q_proj'" in cli_error(
        capfd, *base, "--method", "svd", "--rank-config", ranks)
    assert "is already decomposed" in cli_error(
        capfd, "decompose", "--model", models.decomposed, "--method", "svd", "--ratio", "0.5", "--out", tmp_path / "o2")
    line = cli_error(capfd, *base, "--method", "svd", "--ratio", "0.5", "--update", "sequential")
    assert "--update sequential fits the factors to calibration data: pass --calib-text" in line
    line = cli_error(capfd, *base, "--method", "svd", "--ratio", "0.5", "--allocation", "fisher")
    assert "--allocation fisher measures each matrix's sensitivity on calibration data" in line
    for bad in ("-0.1", "nan"):
        line = cli_error(capfd, *base, "--method", "svd-llm", "--ratio", "0.5", "--calib-self", "1",
                         "--update", "sequential", "--update-damp", bad)
        assert f"--update-damp must be a number ≥ 0 (a fraction of the mean diagonal of XᵀX), got {bad}" in line
    line = cli_error(capfd, *base, "--method", "svd-llm", "--ratio", "0.5", "--calib-self", "0")
    assert "--calib-self must be at least 1 sequence, got 0" in line
    line = cli_error(capfd, *base, "--method", "svd-llm", "--ratio", "0.5", "--calib-self", "1",
                     "--calib-temperature", "0")
    assert "--calib-temperature must be a positive number, got 0.0" in line
    line = cli_error(capfd, *base, "--method", "svd", "--ratio", "0.5", "--calib-temperature", "0.5")
    assert "--calib-temperature sets how the model samples its own --calib-self text" in line
    line = cli_error(capfd, *base, "--method", "svd", "--ratio", "0.5", "--calib-answers", "greedy")
    assert "--calib-answers sets how the model answers its own --calib-self conversations" in line
    assert not (tmp_path / "o").exists() and not (tmp_path / "o2").exists()


@pytest.mark.parametrize("command", ["generate", "eval-ppl", "decompose"])
def test_truncated_weights_are_named(models, tmp_path, capfd, command: str) -> None:
    model = _copy(models.dense, tmp_path / "model")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    text = tmp_path / "t.txt"
    text.write_text("Some words to read. " * 100)
    argv = {"generate": gen(model, "--prompt", "Hi"),
            "eval-ppl": ["eval-ppl", "--model", model, "--text", text, "--window", "64"],
            "decompose": ["decompose", "--model", model, "--method", "svd", "--ratio", "0.5", "--out", tmp_path / "o"]}
    line = cli_error(capfd, *argv[command])
    assert f"{weights} is not a readable safetensors file" in line


def test_temperature_zero_is_greedy(models, capfd) -> None:
    texts = []
    for extra in (["--temperature", "0", "--seed", "1"], ["--temperature", "0", "--seed", "2"], ["--greedy"]):
        assert run(gen(models.dense, "--prompt", "Emma Woodhouse", "--json", "--max-new-tokens", "8", *extra)) == 0
        texts.append(json.loads(capfd.readouterr().out)["outputs"][0]["token_ids"])
    assert texts[0] == texts[1] == texts[2]


@pytest.mark.parametrize("command", ["generate", "eval-ppl", "bench", "serve"])
def test_unknown_dtype_is_refused_by_the_parser(models, tmp_path, capfd, command: str) -> None:
    """``--dtype`` of every inference command takes float32 or bfloat16; anything else is
    argparse's refusal (its usage, then one error line naming the value and the choices), before
    any model file is read."""
    text = tmp_path / "text.txt"
    text.write_text("It is a truth universally acknowledged. " * 20)
    argv = {"generate": gen(models.dense, "--prompt", "Hi"),
            "eval-ppl": ["eval-ppl", "--model", models.dense, "--text", text],
            "bench": ["bench", "--model", models.dense],
            "serve": ["serve", "--model", models.decomposed]}[command]
    from deinfer_megatron.cli.main import build_parser
    from deinfer_megatron.runtime.options import DType

    args = build_parser().parse_args([str(a) for a in argv] + ["--dtype", "bfloat16"])
    cfg = args.make_config(args)
    job = cfg.grid if command == "bench" else cfg.job
    assert job.dtype is DType.BFLOAT16, "the accepted value reaches the job"
    for bad in ("float16", "bf16", ""):
        with pytest.raises(SystemExit, match="2"):
            run([str(a) for a in argv] + ["--dtype", bad])
        errors = [line for line in capfd.readouterr().err.splitlines() if "error" in line]
        assert len(errors) == 1 and "Traceback" not in errors[0], errors
        assert f"argument --dtype: unknown dtype {bad!r}; choose one of float32, bfloat16" in errors[0], errors


def test_demo_ratio(capfd) -> None:
    """The SmolLM2 demo's two operating points; anything else is refused before anything is fetched."""
    assert "--ratio 0.7 is not one of the demo's measured operating points; use 0.8 or 0.6" in cli_error(
        capfd, "demo", "--ratio", "0.7")
    assert "--ratio 1.0 is not one of the demo's" in cli_error(capfd, "demo", "--ratio", "1")
    with pytest.raises(SystemExit) as exit_:  # argparse's own one-line refusal
        run(["demo", "--ratio", "x"])
    assert exit_.value.code == 2 and "argument --ratio: invalid float value: 'x'" in capfd.readouterr().err
    assert "--ratio applies to the SmolLM2 demo" in cli_error(capfd, "demo", "--layouts", "--ratio", "0.6")
