"""``deinfer-megatron demo --layouts`` must pass its own parity check: read from its ``--json``
documents, with the planned collectives recomputed here; the text it prints, from the same
comparisons."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from deinfer_megatron.cli.demo_cmd import (DEMO_MODEL, DEMO_RATIO, DEMO_TEMPERATURE, SMOLLM2_ALLOCATION, SMOLLM2_RATIOS,
                                           SMOLLM2_UPDATE, Conversations, DemoConfig, LayoutParity, cache_is_current,
                                           demo_folder, parity_table)
from deinfer_megatron.decompose.allocation import uniform_ranks
from deinfer_megatron.models.synthetic import synthetic_arch
from deinfer_megatron.planning.plan import make_plan
from deinfer_megatron.specs.layout import Layout
from deinfer_megatron.specs.rank_config import RankConfig

TP = 2


def test_demo_compares_the_three_layouts() -> None:
    proc = subprocess.run([sys.executable, "-m", "deinfer_megatron.cli.main", "demo", "--layouts", "--json"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    docs = [json.loads(line) for line in proc.stdout.splitlines()]  # stdout holds the documents only
    assert [d["layout"] for d in docs] == ["dense", "naive", "deinfer"]
    arch = synthetic_arch(DEMO_MODEL)
    ranks = RankConfig.from_mapping(uniform_ranks(arch, DEMO_RATIO, layers=range(arch.num_layers - 1)), arch)
    for d in docs:
        where = d["layout"]
        plan = make_plan(arch, ranks, Layout(d["layout"]), tp=TP).totals  # independently of the demo
        assert d["tp"] == TP, where
        assert d["plan"] == {"collectives_per_token": plan["collectives_per_token"],
                             "elements_per_token": plan["elements_per_token"]}, where
        assert d["issued"] == {"collectives": plan["collectives_per_token"],
                               "elements_per_token": plan["elements_per_token"]}, where
        assert d["greedy_equal"] is True and d["parity"] is True, where
        assert 0 <= d["max_abs_dlogit"] <= d["tolerance"] and d["tolerance"] >= 1e-4, where
    by = {d["layout"]: d["issued"] for d in docs}
    assert by["deinfer"]["elements_per_token"] < by["naive"]["elements_per_token"]


def test_the_printed_table_says_what_the_comparisons_say() -> None:
    rows = [LayoutParity(Layout.DENSE, 2, 8, 512, 8, 512, 3e-7, True, 1e-4),
            LayoutParity(Layout.DEINFER, 2, 14, 575, 14, 575, 2e-6, True, 1e-4)]
    text = parity_table(rows, scale=0.5)
    lines = text.splitlines()
    assert lines[1].split() == ["dense", "8", "8", "512", "512", "3.00e-07", "True"]
    assert lines[2].split() == ["deinfer", "14", "14", "575", "575", "2.00e-06", "True"]
    assert lines[-1] == "parity OK (tolerance 1e-4 × logit scale 0.50)"
    bad = [*rows, LayoutParity(Layout.NAIVE, 2, 20, 900, 20, 900, 1e-3, True, 1e-4)]
    assert parity_table(bad, scale=0.5).splitlines()[-1].startswith("parity FAILED")
    assert [r.ok for r in bad] == [True, True, False]


def test_a_cache_from_the_older_allocator_is_not_reused(tmp_path) -> None:
    from deinfer_megatron.decompose.allocation import ALLOCATOR_VERSION

    manifest = tmp_path / "deinfer_manifest.json"
    convs = Conversations(tmp_path / f"smollm2-135m-conversations-t{DEMO_TEMPERATURE}-s0.txt",
                          tmp_path / f"smollm2-135m-conversations-t{DEMO_TEMPERATURE}-greedy-s0.txt")

    def current(ratio: float = 0.8) -> bool:
        return cache_is_current(manifest, convs, ratio)

    assert not current(), "no cache yet"
    manifest.write_text(json.dumps({"format": 1, "method": "svd-llm", "files": {}}))  # before the field
    assert not current()
    manifest.write_text(json.dumps({"allocator": ALLOCATOR_VERSION - 1}))
    assert not current()
    manifest.write_text("{not json")
    assert not current()
    demo = {"allocator": ALLOCATOR_VERSION, "ratio": 0.8, "allocation": SMOLLM2_ALLOCATION, "update": SMOLLM2_UPDATE,
            "calibration": {"source": f"text:{convs.calibration.name}", "tokens": 4096, "seq_len": 256}}
    manifest.write_text(json.dumps(demo))
    assert current() and current(0.8)
    assert not current(0.6), "the 0.8 folder is not the 0.6 demo's"
    other_allocation = "uniform" if SMOLLM2_ALLOCATION != "uniform" else "variadic"
    manifest.write_text(json.dumps({**demo, "allocation": other_allocation}))
    assert not current(), "made with another allocation: decomposed again"
    other_update = "sequential" if SMOLLM2_UPDATE == "none" else "none"
    manifest.write_text(json.dumps({**demo, "update": other_update}))
    assert not current(), "made with another update: decomposed again"
    before = {"source": "self-dialogues:16", "temperature": DEMO_TEMPERATURE}
    manifest.write_text(json.dumps({**demo, "calibration": before}))
    assert not current(), "calibrated on conversations it wrote itself (before the shared file): decomposed again"
    manifest.write_text(json.dumps({**demo, "calibration": {"source": "text:smollm2-135m-conversations-t1.0-s0.txt"}}))
    assert not current(), "calibrated on conversations sampled at another temperature"
    healed = {"data": [{"text": str(convs.healing), "tokens": 8192}], "distill": "blocks-then-logits"}
    manifest.write_text(json.dumps({**demo, "healing": healed}))
    assert current()
    manifest.write_text(json.dumps({**demo, "healing": {**healed, "distill": "logits"}}))
    assert not current(), "distilled on the logits alone (the demo before blocks-then-logits): healed again"
    manifest.write_text(json.dumps({**demo, "healing": {"data": healed["data"]}}))
    assert not current(), "a heal older than --distill distilled the logits: healed again"
    manifest.write_text(json.dumps({**demo, "healing": {**healed, "data": [{"text": str(convs.calibration)}]}}))
    assert not current(), "healed on the sampled conversations (the demo before greedy answers): healed again"
    written = [{"self_dialogues": 32, "temperature": 0.7}]
    manifest.write_text(json.dumps({**demo, "healing": {**healed, "data": written}}))
    assert not current(), "healed on conversations it wrote itself (before the shared file): healed again"


def test_the_ratio_option_picks_an_operating_point(tmp_path, monkeypatch) -> None:
    from deinfer_megatron.cli.main import build_parser

    def config(*argv: str) -> DemoConfig:
        args = build_parser().parse_args(["demo", *argv])
        return args.make_config(args)

    assert SMOLLM2_RATIOS == (0.8, 0.6)
    assert config() == DemoConfig(tp=3, ratio=0.8)
    assert config("--ratio", "0.6") == DemoConfig(tp=3, ratio=0.6)
    assert config("--ratio", "0.60", "--tp", "1").ratio == 0.6
    assert config("--layouts") == DemoConfig(tp=2, layouts=True)
    with pytest.raises(ValueError, match=r"--ratio 0.7 is not one of the demo's measured operating points; use 0.8 or 0.6"):
        config("--ratio", "0.7")
    with pytest.raises(ValueError, match="--ratio applies to the SmolLM2 demo"):
        config("--layouts", "--ratio", "0.6")
    monkeypatch.setenv("DEINFER_MEGATRON_CACHE", str(tmp_path))
    assert demo_folder(0.8) == tmp_path / "smollm2-135m-svd-llm-r0.8-self"  # the cache earlier demos made
    assert demo_folder(0.6) == tmp_path / "smollm2-135m-svd-llm-r0.6-self"


def test_the_demo_decomposes_and_heals_on_its_conversations_with_the_recommended_options(tmp_path, monkeypatch) -> None:
    """docs/DECOMPOSITION.md's held-out table recommends --allocation fisher, no update, for both
    operating points; the demo's decomposition is asked for exactly that, into its own folder,
    calibrated on the first 16 windows of the sampled conversations, healed on the greedy ones
    with cross-entropy beside the KL, distilling each block's output before the logits."""
    from deinfer_megatron.cli import demo_cmd

    asked = []

    class Stop(Exception):
        pass

    def stop(job):
        asked.append(job)
        raise Stop

    convs = Conversations(tmp_path / "sampled.txt", tmp_path / "greedy.txt")
    monkeypatch.setenv("DEINFER_MEGATRON_CACHE", str(tmp_path))
    monkeypatch.setattr(demo_cmd, "fetch_model", lambda name: tmp_path / name)
    monkeypatch.setattr(demo_cmd, "demo_conversations", lambda dense, seed: convs)
    monkeypatch.setattr(demo_cmd, "run_decompose", asked.append)
    monkeypatch.setattr(demo_cmd, "run_heal", stop)
    for ratio in SMOLLM2_RATIOS:
        with pytest.raises(Stop):
            demo_cmd.smollm2_demo(DemoConfig(ratio=ratio))
    decomposed = [(j.method, j.ratio, j.allocation, j.update, j.calib_self, j.calib_text, j.calib_tokens,
                   j.calib_seq_len, j.out) for j in asked[0::2]]
    folders = [tmp_path / f"smollm2-135m-svd-llm-r{r}-self" for r in SMOLLM2_RATIOS]
    assert decomposed == [("svd-llm", r, "fisher", "none", None, convs.calibration, 16 * 256, 256, f)
                          for r, f in zip(SMOLLM2_RATIOS, folders)]
    healed = [(j.model, j.teacher, j.calib_text, j.calib_self, j.seq_len, j.tokens, j.ce_weight, j.distill, j.out)
              for j in asked[1::2]]
    assert healed == [(f, tmp_path / "smollm2-135m", (convs.healing,), None, 256, 16 * 4 * 256, 1.0,
                       "blocks-then-logits", f.parent / f"{f.name}-healed") for f in folders]


def test_the_conversations_are_written_once_whole_in_the_cache(tmp_path, monkeypatch) -> None:
    """A tiny chat model writes both files in the chat template, named by temperature and seed:
    the calibration's 16 windows of 256 tokens with sampled answers, the heal's 32 with greedy
    ones (the same first questions, other answers); a second demo reuses them without sampling."""
    import transformers

    from deinfer_megatron.cli import demo_cmd
    from tests.helpers.tiny_models import save_tiny_folder

    save_tiny_folder("llama", tmp_path / "smollm2-135m")
    monkeypatch.setenv("DEINFER_MEGATRON_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    files = demo_cmd.demo_conversations(tmp_path / "smollm2-135m", seed=3)
    stem = tmp_path / "cache" / f"smollm2-135m-conversations-t{DEMO_TEMPERATURE}"
    assert files == Conversations(stem.with_name(f"{stem.name}-s3.txt"), stem.with_name(f"{stem.name}-greedy-s3.txt"))
    assert sorted(p.name for p in stem.parent.iterdir()) == sorted([files.calibration.name, files.healing.name]), \
        "no temporary file left beside them"
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "smollm2-135m")
    sampled, greedy = files.calibration.read_text(), files.healing.read_text()
    assert len(tok(sampled, add_special_tokens=False)["input_ids"]) >= 16 * 256
    assert len(tok(greedy, add_special_tokens=False)["input_ids"]) >= 32 * 256
    for text in (sampled, greedy):
        assert text.startswith("<|im_start|>system\n") and text.count("<|im_start|>assistant\n") >= 2
    first = [text.split("<|im_start|>assistant\n")[0] for text in (sampled, greedy)]
    assert first[0] == first[1] and sampled.split("<|im_end|>\n<|im_start|>system")[0] != \
        greedy.split("<|im_end|>\n<|im_start|>system")[0], "same first question, another answer"
    made = [files.calibration.stat().st_mtime_ns, files.healing.stat().st_mtime_ns]

    def no_sampling(*a, **k):
        raise AssertionError("the cached conversations are reused")

    monkeypatch.setattr(demo_cmd, "self_conversations", no_sampling)
    assert demo_cmd.demo_conversations(tmp_path / "smollm2-135m", seed=3) == files
    assert [files.calibration.stat().st_mtime_ns, files.healing.stat().st_mtime_ns] == made
