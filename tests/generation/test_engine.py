"""How the Megatron driver uses Megatron-Core: nothing of Megatron's is patched (no progress bar
swapped in and out), the shared model config is never written (the seed goes to the
controller's own generator), each controller keeps its own timing, and prompts reach it as
token ids. Plus the typed job options, parsed once."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr
from pathlib import Path

import pytest
import torch

from deinfer_megatron.decompose.job import DecomposeJob, run_decompose
from deinfer_megatron.generation.job import GenerateJob
from deinfer_megatron.generation.options import CacheOptions
from deinfer_megatron.layers.kv_cache import CacheKind
from deinfer_megatron.planning.request import LayoutRequest
from deinfer_megatron.runtime.options import DType, Engine, Parallelism
from deinfer_megatron.specs.layout import Layout, latent_cache_layouts
from tests.helpers.distributed import run_ranks
from tests.helpers.tiny_models import full_ranks, save_tiny_folder

PROMPTS = [[1, 504, 3458, 282], [1, 9519, 12]]


def _engine_checks(model: str) -> dict:
    from megatron.core.inference.engines import static_engine

    from deinfer_megatron.generation.context import GenerationContext
    from deinfer_megatron.generation.loop import generate_tokens
    from deinfer_megatron.generation.megatron_engine import ReportingController, generate_with_engine
    from deinfer_megatron.generation.sampling import SamplingParams
    from deinfer_megatron.models.build import load_folder
    from deinfer_megatron.parallel.runtime import init_parallel, shutdown

    groups = init_parallel(1, 1)
    try:
        stage = load_folder(Path(model), Layout.DEINFER, groups)
        seed_before, bar = stage.model.config.inference_sampling_seed, static_engine.tqdm
        sampled = SamplingParams(greedy=False, temperature=0.8, top_p=0.9, seed=3)
        runs, stderr = [], io.StringIO()
        with redirect_stderr(stderr):
            for params in (SamplingParams(), sampled, sampled):
                ctx = GenerationContext(len(PROMPTS), 16, kv_cache=CacheKind.FULL)
                outs, timing = generate_with_engine(stage, PROMPTS, max_new_tokens=4, params=params, context=ctx)
                runs.append(([o.token_ids for o in outs], timing.prefill_s > 0 and timing.decode_s > 0))
        loop, _ = generate_tokens(stage, PROMPTS, max_new_tokens=4, params=SamplingParams(),
                                  context=GenerationContext(len(PROMPTS), 16))
        return {
            "greedy_engine": runs[0][0], "greedy_loop": [o.token_ids for o in loop],
            "sampled_twice_equal": runs[1][0] == runs[2][0], "timed": all(t for _, t in runs),
            "seed_unchanged": stage.model.config.inference_sampling_seed == seed_before,
            "tqdm_untouched": static_engine.tqdm is bar, "no_progress_bar": "static requests" not in stderr.getvalue(),
            "first_step_is_instance_state": "first_step_at" not in vars(ReportingController),
            "device": str(stage.device),
        }
    finally:
        shutdown()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("engine")
    hf = save_tiny_folder("llama", root / "dense")
    (root / "ranks.json").write_text(json.dumps(full_ranks(hf)))
    return str(run_decompose(DecomposeJob(root / "dense", "svd", rank_config=root / "ranks.json", out=root / "dec")))


def test_the_engine_is_driven_without_patching_megatron(model: str) -> None:
    r = run_ranks(1, _engine_checks, model)[0]
    assert r["greedy_engine"] == r["greedy_loop"], "Megatron's controller and the project's loop agree"
    assert all(len(t) == 4 for t in r["greedy_engine"])
    assert r["sampled_twice_equal"] and r["timed"]
    assert r["seed_unchanged"], "the model's TransformerConfig is not written"
    assert r["tqdm_untouched"] and r["no_progress_bar"]
    assert r["first_step_is_instance_state"]
    assert r["device"] == "cpu"


def test_options_are_typed_and_parsed_once() -> None:
    par = Parallelism(tp=2, pp=1, layout="naive")
    assert par.layout == LayoutRequest(Layout.NAIVE) and par.layout.fixed is Layout.NAIVE and par.world == 2
    assert Parallelism(layout=Layout.DENSE).layout.fixed is Layout.DENSE
    assert Parallelism(layout="auto").layout.is_auto and Parallelism().layout.fixed is Layout.DEINFER
    assert CacheOptions("latent").kind is CacheKind.LATENT
    with pytest.raises(ValueError, match="unknown KV cache kind 'half'; choose one of full, latent"):
        CacheOptions("half")
    with pytest.raises(ValueError, match="unknown layout 'fast'"):
        Parallelism(layout="fast")
    with pytest.raises(ValueError, match="--kv-budget-gb must be a number of GB > 0, got nan"):
        CacheOptions(budget_gb=float("nan")).check_budget()
    assert DType.parse("bfloat16").torch is torch.bfloat16 and DType.FLOAT32.itemsize == 4
    assert Engine.parse("deepspeed") is Engine.DEEPSPEED
    with pytest.raises(ValueError, match="unknown engine 'vllm'; choose one of megatron, deepspeed"):
        Engine.parse("vllm")
    assert latent_cache_layouts() == "deinfer"  # asked of Layout.supports_latent_cache
    job = GenerateJob(Path("m"), ("Hi",), engine="deepspeed", dtype="bfloat16")
    assert job.engine is Engine.DEEPSPEED and job.dtype is DType.BFLOAT16
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        GenerateJob(Path("m"), ("Hi",), dtype="float8")
