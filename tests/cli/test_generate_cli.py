"""``deinfer-megatron generate`` as users run it: JSON and streamed output, one-line errors for
bad input. (The torchrun and DeepSpeed launchers' tokens are checked in
tests/launch/test_same_code.py; dying ranks, killed commands and Ctrl-C in tests/robustness.)"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from deinfer_megatron.specs.layout import Layout
from tests.helpers.cli import run_cli, run_cli_together
from tests.helpers.tiny_models import full_rank_folders, hf_greedy_texts

PROMPTS = ["It is a truth universally acknowledged", "Emma Woodhouse, handsome, clever"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    hf, dense, dec = full_rank_folders(tmp_path_factory.mktemp("cli-gen"), max_position_embeddings=4096)
    expected = hf_greedy_texts(hf, dec, PROMPTS, 6)
    return {"dense": dense, "dec": dec, "expected": expected}


def cli(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return run_cli(args, env, timeout)


def generate_args(model: Path, *extra: str) -> list[str]:
    args = ["generate", "--model", str(model), "--max-new-tokens", "6", "--json"]
    for p in PROMPTS:
        args += ["--prompt", p]
    return args + list(extra)


def test_json_output_in_the_default_layout(models, tmp_path: Path) -> None:
    """Without ``--layout`` the job resolves ``auto``: here from a planted cost table (in a cache
    of its own, so nothing is measured) that favours naive wherever it may, so the plan mixes
    layouts — attention in DeInfer, which the latent cache needs, MLPs naive — and the JSON names
    it. The tokens are Hugging Face's, which ``--layout deinfer`` gives too
    (``tests/launch/test_same_code.py``, under both launchers)."""
    from deinfer_megatron.checkpoints.folder import open_config
    from deinfer_megatron.planning import cost_model
    from tests.helpers.cost_tables import favouring

    arch, ranks = open_config(models["dec"], verify=False)
    assert all(layer.decomposed for layer in ranks.layers), "every block has a layout to choose"
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(models["dec"])
    context = max(len(tok(p)["input_ids"]) for p in PROMPTS) + 6  # as the job prices it: prompt + new
    table = favouring("naive", arch, ranks, tp=2, batches=(len(PROMPTS),), contexts=(context,))
    cached = cost_model.cache_path(table.key, tmp_path / "cost_model")
    cost_model.save(table, cached)
    before = cached.read_bytes()
    proc = cli(*generate_args(models["dec"], "--tp", "2", "--kv-cache", "latent"),
               env={"DEINFER_MEGATRON_CACHE": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["layout"] == "auto" and doc["kv_cache"] == "latent"
    assert doc["block_layouts"] == [{"attention": "deinfer", "mlp": "naive"}] * arch.num_layers
    assert "measuring" not in proc.stderr
    assert cached.read_bytes() == before, "a complete table is read, not measured again"
    assert [o["token_ids"] for o in doc["outputs"]] == models["expected"]
    for out, prompt in zip(doc["outputs"], PROMPTS):
        assert out["prompt"] == prompt and out["finish_reason"] == "length" and out["text"]
    assert doc["timing"]["prefill_s"] > 0 and doc["timing"]["decode_tokens_per_s"] > 0
    assert doc["kv_cache_bytes"] > 0


def test_single_prompt_streams_text(models) -> None:
    proc = cli("generate", "--model", str(models["dec"]), "--layout", "deinfer", "--max-new-tokens", "6",
               "--prompt", PROMPTS[0])
    assert proc.returncode == 0, proc.stderr
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(models["dec"])
    assert tok.decode(models["expected"][0], skip_special_tokens=True).strip() in proc.stdout


def test_bad_inputs_are_one_line_errors(models, tmp_path: Path) -> None:
    long_prompt = "word " * 5000
    cases = [
        (["generate", "--model", str(models["dec"]), "--prompt", long_prompt], {}, "exceeds the model's context of 4096"),
        (["generate", "--model", str(models["dense"]), "--prompt", "Hi", "--kv-cache", "latent"], {}, "--kv-cache latent needs a decomposed model"),
        (["generate", "--model", str(models["dec"]), "--prompt", "  "], {}, "prompt 1 is empty"),
        (["generate", "--model", str(models["dec"]), "--prompt", "Hi"],
         {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"},
         "TP×PP = 1 but the deepspeed launcher started 2 ranks"),
        (["generate", "--model", str(models["dec"]), "--prompt", "Hi", "--tp", "3"], {}, "valid TP sizes: 1, 2, 4, 8"),
    ]
    procs = run_cli_together([(args, env) for args, env, _ in cases], timeout=120)
    for (args, _, message), proc in zip(cases, procs):
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], (args[-2:], proc.stderr[-2000:])


def test_flags_are_parsed_into_a_typed_config(tmp_path: Path) -> None:
    """argparse parses straight into the job's typed values; ``main`` gets a ``GenerateConfig``."""
    from deinfer_megatron.cli.generate_cmd import GenerateConfig
    from deinfer_megatron.cli.main import build_parser
    from deinfer_megatron.runtime.options import DType, Engine
    from deinfer_megatron.layers.kv_cache import CacheKind
    from deinfer_megatron.parallel.collectives import Collectives
    from deinfer_megatron.planning.request import INFERENCE_DEFAULT, LayoutRequest

    args = build_parser().parse_args(
        ["generate", "--model", str(tmp_path), "--prompt", "Hi", "--prompt", "Ho", "--tp", "2", "--layout", "naive",
         "--kv-cache", "latent", "--no-absorb", "--kv-budget-gb", "0.5", "--engine", "deepspeed",
         "--dtype", "bfloat16", "--launcher", "torchrun", "--collectives", "process-group", "--json"])
    cfg = args.make_config(args)
    assert isinstance(cfg, GenerateConfig) and cfg.launcher == "torchrun" and cfg.json
    job = cfg.job
    assert job.prompts == ("Hi", "Ho") and not job.stream
    assert (job.parallel.tp, job.parallel.pp, job.parallel.layout) == (2, 1, LayoutRequest(Layout.NAIVE))
    assert job.parallel.collectives is Collectives.PROCESS_GROUP
    assert (job.cache.kind, job.cache.absorb_values, job.cache.budget_gb) == (CacheKind.LATENT, False, 0.5)
    assert job.engine is Engine.DEEPSPEED and job.dtype is DType.BFLOAT16
    defaults = build_parser().parse_args(["generate", "--model", str(tmp_path), "--prompt", "Hi"])
    job = defaults.make_config(defaults).job
    assert job.parallel.layout == INFERENCE_DEFAULT == LayoutRequest.auto() and job.cache.kind is CacheKind.FULL
    assert job.parallel.layout.name == "auto" and job.stream
    assert job.parallel.collectives is Collectives.AUTO
    assert job.engine is Engine.MEGATRON and job.dtype is DType.FLOAT32


def test_inference_commands_default_to_auto_and_serve_to_deinfer(capsys) -> None:
    """``generate`` and ``eval-ppl`` default to ``auto`` and their help says so; ``serve`` keeps
    a fixed layout (deinfer) and offers no ``auto``."""
    from deinfer_megatron.cli.main import build_parser

    parser = build_parser()
    for command, extra in (("generate", ["--prompt", "Hi"]), ("eval-ppl", ["--text", "t.txt"])):
        args = parser.parse_args([command, "--model", "m", *extra])
        job = args.make_config(args).job
        assert (job.parallel.layout if command == "generate" else job.layout).is_auto, command
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--help"])
        assert "(default: auto)" in " ".join(capsys.readouterr().out.split()), command
    args = parser.parse_args(["serve", "--model", "m"])
    assert args.make_config(args).job.parallel.layout.fixed is Layout.DEINFER
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--model", "m", "--layout", "auto"])
    assert "serve takes a fixed layout (dense, naive, deinfer), not auto" in capsys.readouterr().err


def test_an_unknown_choice_names_the_choices(capsys) -> None:
    from deinfer_megatron.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--model", "m", "--prompt", "Hi", "--kv-cache", "half"])
    assert "argument --kv-cache: unknown KV cache kind 'half'; choose one of full, latent" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--model", "m", "--prompt", "Hi", "--collectives", "nccl"])
    assert "argument --collectives: unknown collectives 'nccl'; choose one of auto, process-group" in capsys.readouterr().err
