"""``deinfer-megatron bench`` as users run it (a subprocess through the CLI), checked field by
field, with the collectives of one decode step compared with ``make_plan`` computed here and
the speed-ups recomputed from the cells' own summaries; the JSON's keys against the documents
committed in docs/bench; the roofline at tiny sizes; skipped and failed cells; the peers
(``--peers hf,deepspeed``) beside the cells, their greedy tokens against the project's; one-line
errors for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deinfer_megatron.bench import matrix, report, roofline
from deinfer_megatron.bench.records import CellStatus
from deinfer_megatron.bench.sources import ModelSource
from deinfer_megatron.cli.main import run
from deinfer_megatron.decompose.allocation import uniform_ranks
from deinfer_megatron.layers.kv_cache import CacheKind
from deinfer_megatron.models.synthetic import synthetic_arch
from deinfer_megatron.planning.plan import make_plan
from deinfer_megatron.specs.layout import Layout
from deinfer_megatron.specs.rank_config import RankConfig

CLI = [sys.executable, "-m", "deinfer_megatron.cli.main", "bench"]
GEN_LEN = 4
DOCUMENTED = Path(__file__).resolve().parents[2] / "docs" / "bench"


def bench(tmp: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=600, cwd=tmp,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads((tmp / "out.json").read_text())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, dict]:
    tmp = tmp_path_factory.mktemp("bench")
    # one batch size (each cell is a fresh launch, ~7 s; the grid over batches is make_cells',
    # test_the_grid_is_every_combination_in_a_stable_order), and 2, so that a step's tokens per
    # collective (the batch) differ from the tokens per row
    proc, doc = bench(tmp, "--synthetic", "llama-tiny", "--tp", "1,2", "--batch", "2", "--gen-len", str(GEN_LEN),
                      "--layouts", "dense,naive,deinfer", "--json", "out.json", "--markdown", "out.md",
                      "--plot", "out.png")
    return tmp, proc, doc


def expected_plan(layout: str, tp: int, dtype_bytes: int = 4) -> dict:
    arch = synthetic_arch("llama-tiny")
    ranks = RankConfig.from_mapping(uniform_ranks(arch, 0.6), arch)
    return make_plan(arch, ranks, Layout(layout), tp=tp, dtype_bytes=dtype_bytes).totals


def test_every_cell_measured_and_matches_the_plan(tiny) -> None:
    _, _, doc = tiny
    assert doc["schema"] == report.SCHEMA and doc["counts"] == {"ok": 6, "skipped": 0, "error": 0}
    cells = {(c["layout"], c["tp"], c["batch"]) for c in doc["cells"]}
    assert cells == {(l, t, 2) for l in ("dense", "naive", "deinfer") for t in (1, 2)}
    for cell in doc["cells"]:
        where = f"{cell['layout']} tp={cell['tp']} b={cell['batch']}"
        s = cell["summary"]
        for key in ("ttft_s", "prefill_s", "tpot_s", "decode_tokens_per_s", "output_tokens_per_s",
                    "peak_rss_max_bytes", "kv_cache_bytes", "kv_bytes_per_token", "load_s"):
            assert s[key] > 0, f"{where}: {key}"
        assert len(s["peak_rss_bytes"]) == cell["tp"] and min(s["peak_rss_bytes"]) > 0, where
        assert s["decode_tokens_per_s"] == pytest.approx(cell["batch"] / s["tpot_s"])
        for rank in cell["ranks"]:  # raw samples: one warm-up plus --repeats timed runs
            assert len(rank["samples"]) == 3 and rank["warmup"]["tpot_s"] > 0, where
            for sample in rank["samples"]:
                assert len(sample["step_s"]) == GEN_LEN - 1 and min(sample["step_s"]) > 0, where
                assert sample["new_tokens"] == cell["batch"] * GEN_LEN, where
        plan = expected_plan(cell["layout"], cell["tp"])  # computed here, independently of the bench
        assert (s["collectives_per_token"], s["elements_per_token"]) == (
            plan["collectives_per_token"], plan["elements_per_token"]), where
        assert s["plan_match"], where
        if cell["tp"] == 2:
            assert s["collectives_per_token"] > 0 and s["elements_per_token"] > 0, where
            for rank in cell["ranks"]:  # exactly one decode step: one token per row, every rank alike
                comm = rank["decode_step_comm"]
                assert comm["tokens_per_collective"] == [cell["batch"]], where
                assert (comm["collectives"], comm["elements"]) == (s["collectives_per_token"], s["elements_per_token"])
    by = {(c["layout"], c["tp"]): c["summary"]["elements_per_token"] for c in doc["cells"]}
    assert by[("deinfer", 2)] < by[("naive", 2)]


def test_speedups_and_reports(tiny) -> None:
    tmp, proc, doc = tiny
    assert {(c["tp"], c["batch"]) for c in doc["comparisons"]} == {(1, 2), (2, 2)}
    cells = {(c["layout"], c["kv_cache"], c["tp"], c["batch"], c["prompt_len"]): c for c in doc["cells"]}
    for c in doc["comparisons"]:
        key = (c["tp"], c["batch"], c["prompt_len"])
        deinfer = cells[("deinfer", c["kv_cache"], *key)]["summary"]
        rate = deinfer["decode_tokens_per_s"]
        assert c["deinfer_tokens_per_s"] == rate, key
        for base in ("naive", "dense"):  # deinfer tokens/s ÷ the baseline's, from the cells' own summaries
            expected = rate / cells[(base, "full", *key)]["summary"]["decode_tokens_per_s"]
            assert c[f"speedup_vs_{base}"] == expected, (key, base)
            assert deinfer[f"speedup_vs_{base}"] == expected, (key, base)
    for cell in doc["cells"]:  # only the deinfer cells are compared
        compared = {"speedup_vs_naive", "speedup_vs_dense"} <= set(cell["summary"])
        assert compared == (cell["layout"] == "deinfer"), cell["layout"]
    md = (tmp / "out.md").read_text()
    assert md.startswith("# deinfer-megatron bench: llama-tiny") and md.count("\n| deinfer | full |") == 2
    assert (tmp / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = proc.stdout.strip().splitlines()
    assert len(table) == 1 + len(doc["cells"]), "a header, then one row per cell"
    assert not list(tmp.glob(".*.tmp")), "atomic writes leave no temporary files"


@pytest.fixture(scope="module")
def auto_and_peers(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, dict]:
    """``auto`` and ``deinfer`` at TP=2, with both peers beside them (one launch for all)."""
    from deinfer_megatron.planning import cost_model
    from tests.helpers.cost_tables import elements_only, with_free_shapes, zero_overhead

    tmp_path = tmp_path_factory.mktemp("auto-peers")
    table = elements_only()
    key = cost_model.TableKey.current(1)
    arch = synthetic_arch("llama-tiny")
    table = with_free_shapes(cost_model.CostTable(key, table.gemm, table.memory_bytes_per_s, table.collectives,
                                                  zero_overhead(2)),
                             arch, RankConfig.from_mapping(uniform_ranks(arch, 0.6), arch), tp=2, batches=(2,),
                             contexts=(128 + GEN_LEN,))  # the default --prompt-len
    cost_model.save(table, cost_model.cache_path(key, tmp_path / "cache" / "cost_model"))
    proc = subprocess.run([*CLI, "--synthetic", "llama-tiny", "--tp", "2", "--batch", "2", "--gen-len", str(GEN_LEN),
                           "--repeats", "1", "--layouts", "auto,deinfer", "--peers", "hf,deepspeed",
                           "--json", "out.json", "--markdown", "out.md"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "DEINFER_MEGATRON_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp_path, proc, json.loads((tmp_path / "out.json").read_text())


def test_auto_cells_run_the_cost_models_plan(auto_and_peers) -> None:
    """An ``auto`` cell builds the plan the cost model chooses for its TP, batch and context
    (here an injected table, planted in the cache, where only collective elements cost time),
    and reports it beside the fixed layouts."""
    _, proc, doc = auto_and_peers
    cells = {c["layout"]: c for c in doc["cells"]}
    assert set(cells) == {"auto", "deinfer"} and doc["counts"]["ok"] == 2
    # llama-tiny keeps 60 % of its parameters: its ranks are high, so in every block dense sends
    # fewer elements (h) than DeInfer's latents; the elements-only table must pick it everywhere
    fixed = {l: expected_plan(l, 2) for l in ("dense", "naive", "deinfer")}
    fewest = min(fixed, key=lambda l: fixed[l]["elements_per_token"])
    assert fewest == "dense"
    for name, plan in (("auto", fixed[fewest]), ("deinfer", fixed["deinfer"])):
        s = cells[name]["summary"]
        assert (s["collectives_per_token"], s["elements_per_token"]) == (
            plan["collectives_per_token"], plan["elements_per_token"]), name
        assert s["plan_match"] and s["decode_tokens_per_s"] > 0, name
    assert any(line.startswith("| auto") or line.split()[:1] == ["auto"] for line in proc.stdout.splitlines())


def test_peers_run_beside_the_cells_with_ratios(auto_and_peers) -> None:
    """Hugging Face (1 process × 2 threads) and DeepSpeed AutoTP (2 ranks × 1 thread) measured as
    the cells are, and every layout's decode tokens/s ÷ every peer's."""
    tmp, proc, doc = auto_and_peers
    assert doc["args"]["peers"] == ["hf", "deepspeed"]
    peers = {p["peer"]: p for p in doc["peers"]}
    assert set(peers) == {"hf", "deepspeed"}
    assert (peers["hf"]["processes"], peers["hf"]["threads_per_process"]) == (1, 2)
    assert (peers["deepspeed"]["processes"], peers["deepspeed"]["threads_per_process"]) == (2, 1)
    for name, p in peers.items():
        assert p["status"] == "ok" and (p["tp"], p["batch"], p["prompt_len"]) == (2, 2, 128), name
        s = p["summary"]
        for key in ("ttft_s", "prefill_s", "tpot_s", "decode_tokens_per_s", "output_tokens_per_s",
                    "peak_rss_max_bytes", "load_s"):
            assert s[key] > 0, f"{name}: {key}"
        assert s["decode_tokens_per_s"] == pytest.approx(2 / s["tpot_s"]) and len(p["ranks"]) == p["processes"]
        for rank in p["ranks"]:
            assert rank["threads"] == p["threads_per_process"] and rank["peak_rss_bytes"] > 0, name
            assert len(rank["samples"]) == 1 and rank["warmup"]["tpot_s"] > 0, name
            sample = rank["samples"][0]
            assert len(sample["step_s"]) == GEN_LEN - 1 and min(sample["step_s"]) > 0, name
            assert sample["new_tokens"] == 2 * GEN_LEN and sample["prefill_s"] <= sample["ttft_s"], name
            assert [len(t) for t in rank["tokens"]] == [GEN_LEN, GEN_LEN], name
    cells = {c["layout"]: c["summary"]["decode_tokens_per_s"] for c in doc["cells"]}
    got = {(r["layout"], r["peer"]): r for r in doc["peer_ratios"]}
    assert set(got) == {(l, p) for l in ("auto", "deinfer") for p in ("hf", "deepspeed")}
    for (layout, peer), r in got.items():
        assert r["ratio"] == cells[layout] / peers[peer]["summary"]["decode_tokens_per_s"], (layout, peer)
    lines = proc.stdout.splitlines()
    assert sum(line.split()[:1] in (["hf"], ["deepspeed"]) for line in lines) == 2, "one table row per peer"
    assert any(line.startswith("deinfer/full tp=2 b=2 ctx=128 decode tok/s vs peers:") and "x hf" in line
               and "x deepspeed" in line for line in lines)
    assert not any(line.startswith("AutoTP") for line in lines), "DeepSpeed's prints stay off the table"
    md = (tmp / "out.md").read_text()
    assert "| hf 1x2 | - | 2 | 2 | 128 |" in md and "| deepspeed 2x1 | - | 2 | 2 | 128 |" in md
    assert md.count("| deinfer | full | 2 | 2 | 128 | hf |") == 1 and "## Layouts against the peers" in md


def _project_tokens(folder: str, prompts: tuple, gen_len: int) -> list[list[int]]:
    from deinfer_megatron.generation.context import GenerationContext
    from deinfer_megatron.generation.loop import generate_tokens
    from deinfer_megatron.generation.sampling import SamplingParams
    from deinfer_megatron.models.build import load_folder
    from deinfer_megatron.parallel.runtime import init_parallel, shutdown

    groups = init_parallel(1, 1)
    try:
        stage = load_folder(Path(folder), Layout.DEINFER, groups)
        outs, _ = generate_tokens(stage, [list(p) for p in prompts], max_new_tokens=gen_len, params=SamplingParams(),
                                  context=GenerationContext(len(prompts), len(prompts[0]) + gen_len))
        return [o.token_ids for o in outs]
    finally:
        shutdown()


def test_peer_tokens_equal_the_projects_tp1_tokens(auto_and_peers, tmp_path) -> None:
    """The bench's Hugging Face peer (``models.hf_factored`` on the decomposed folder) generates the
    project's TP=1 greedy tokens on the same weights and prompts; DeepSpeed AutoTP at TP=2 (on the
    multiplied-out weights) generates the Hugging Face peer's."""
    from deinfer_megatron.bench.sources import synthetic_source
    from deinfer_megatron.models.hf_factored import FactorLinears, hf_model
    from tests.helpers.distributed import run_ranks

    _, _, doc = auto_and_peers
    source = synthetic_source("llama-tiny", 0.6, 0, tmp_path)  # the bench's draw: same seed, same weights
    prompts = matrix.random_prompts(source.arch.vocab_size, 2, 128, 0)
    expected = run_ranks(1, _project_tokens, str(source.decomposed_dir), prompts, GEN_LEN)[0]
    peers = {p["peer"]: p["ranks"] for p in doc["peers"]}
    assert peers["hf"][0]["tokens"] == expected
    assert all(rank["tokens"] == expected for rank in peers["deepspeed"])
    model = hf_model(source.decomposed_dir)
    pairs = [m for m in model.modules() if isinstance(m, FactorLinears)]
    assert len(pairs) == len(source.rank_config.modules) and all(
        isinstance(p.u, torch.nn.Linear) and isinstance(p.v, torch.nn.Linear) for p in pairs)


def test_peers_skipped_or_failed_are_recorded_and_the_run_goes_on(tmp_path) -> None:
    """DeepSpeed beside a TP that does not divide the KV heads is skipped with the reason; a peer
    that fails gets its one-line error; both are rows of the table."""
    from deinfer_megatron.bench.peers import Peer, run_peers

    arch = synthetic_arch("llama-tiny")  # 8 heads, 4 KV heads
    source = ModelSource("tiny", arch, RankConfig.from_mapping(uniform_ranks(arch, 0.6), arch), tmp_path, tmp_path)
    grid = matrix.BenchGrid(synthetic="llama-tiny", tps=(8,), batches=(1,), gen_len=2, peers=(Peer.HF, Peer.DEEPSPEED))

    def runner(peer, tp, batch, ctx, source, grid):
        raise RuntimeError("out of memory\ntraceback ...")

    failed, skipped = run_peers(grid, source, runner=runner, progress=False)
    assert (failed.peer, failed.status, failed.error) == ("hf", CellStatus.ERROR, "RuntimeError: out of memory")
    assert skipped.status is CellStatus.SKIPPED and "does not divide 8 heads / 4 KV heads" in skipped.reason
    assert list(skipped.to_json()) == ["peer", "tp", "batch", "prompt_len", "gen_len", "repeats", "processes",
                                       "threads_per_process", "status", "reason"]
    table = report.text_table([], (failed, skipped)).splitlines()
    assert table[1].split()[:2] == ["hf", "1x8"] and table[1].endswith("error: RuntimeError: out of memory")
    assert "skipped: DeepSpeed AutoTP" in table[2]


def test_json_keys_equal_the_documented_runs(tiny) -> None:
    """Field for field, the document has the keys of the runs committed in docs/bench."""
    _, _, doc = tiny
    ref = json.loads((DOCUMENTED / "llama-1b-matrix.json").read_text())
    assert list(doc) == list(ref) and list(doc["args"]) == list(ref["args"])
    assert list(doc["counts"]) == list(ref["counts"]) and list(doc["model"]) == list(ref["model"])
    assert list(doc["comparisons"][0]) == list(ref["comparisons"][0])
    ref_cells = {c["layout"]: c for c in ref["cells"]}
    for cell in doc["cells"]:
        other = ref_cells[cell["layout"]]
        assert list(cell) == list(other) and list(cell["summary"]) == list(other["summary"]), cell["layout"]
        assert list(cell["plan"]) == list(other["plan"]), cell["layout"]
        rank, ref_rank = cell["ranks"][0], other["ranks"][0]
        assert list(rank) == list(ref_rank) and list(rank["decode_step_comm"]) == list(ref_rank["decode_step_comm"])
        assert list(rank["warmup"]) == list(ref_rank["warmup"]) == list(rank["samples"][0])


def test_latent_cache_skips_and_roofline_through_the_cli(tmp_path) -> None:
    """In bfloat16 (``--dtype``): the cell's latent cache holds the planner's 2-byte count, the
    roofline measures bfloat16 GEMMs and collectives, and the run records its dtype."""
    proc, doc = bench(tmp_path, "--synthetic", "llama-tiny", "--tp", "2", "--batch", "2", "--gen-len", "3",
                      "--repeats", "1", "--layouts", "naive,deinfer", "--kv-cache", "latent", "--roofline",
                      "--dtype", "bfloat16", "--json", "out.json", "--no-progress")
    assert doc["args"]["dtype"] == "bfloat16"
    skipped, ok = doc["cells"]
    assert skipped["status"] == "skipped" and "deinfer layout only" in skipped["reason"]
    assert ok["status"] == "ok" and ok["kv_cache"] == "latent" and ok["summary"]["plan_match"]
    full = expected_plan("deinfer", 2, dtype_bytes=2)
    assert ok["summary"]["kv_bytes_per_token"] == full["kv_bytes_per_token"]["latent"]
    assert full["kv_bytes_per_token"]["latent"] * 2 == expected_plan("deinfer", 2)["kv_bytes_per_token"]["latent"]
    machine, bound = doc["roofline"], ok["roofline"]
    assert machine["copy_gbps"] > 0 and all(g["gflops"] > 0 for g in machine["gemm"])
    assert bound["bound_s"] > 0 and bound["measured_over_bound"] > 0
    assert bound["collectives"] == full["collectives_per_token"] + 2  # + embedding and logits
    documented = json.loads((DOCUMENTED / "llama-1b-roofline.json").read_text())
    assert list(ok) == list(documented["cells"][0]) and list(bound) == list(documented["cells"][0]["roofline"])
    assert list(machine) == list(documented["roofline"])
    assert list(skipped) == ["layout", "kv_cache", "tp", "batch", "prompt_len", "gen_len", "repeats", "status", "reason"]
    assert "bound" in proc.stdout and "skipped" in proc.stdout
    assert "| collective | elements | shared-memory µs | gloo µs | gloo ÷ shared-memory |" in proc.stdout


def test_roofline_smoke_tiny_sizes() -> None:
    sizes = roofline.RooflineSizes(copy_bytes=1 << 20, gemm_shapes=((2, 64, 64),), comm_sizes=(1, 64, 4096), iters=2)
    m = roofline.measure_machine(sizes)
    assert m["copy_gbps"] > 0 and m["gemm"][0]["gflops"] > 0
    for kind in ("all_reduce", "all_gather"):
        curve = m["comm_latency_s"][kind]
        assert set(curve) == {"1", "64", "4096"} and min(curve.values()) > 0
        assert roofline.latency_s(curve, 8) > 0 and roofline.latency_s(curve, 1 << 20) >= curve["4096"]
        gloo = m["gloo_latency_s"][kind]  # the same sizes with the group routed back to gloo
        assert set(gloo) == set(curve) and min(gloo.values()) > 0
    assert m["comm_transport"] == "shared-memory"  # two local ranks
    table = roofline.transport_table(m).splitlines()
    assert table[0] == "| collective | elements | shared-memory µs | gloo µs | gloo ÷ shared-memory |"
    assert table[2] == (f"| all_reduce | 1 | {m['comm_latency_s']['all_reduce']['1'] * 1e6:.1f} | "
                        f"{m['gloo_latency_s']['all_reduce']['1'] * 1e6:.1f} | "
                        f"{m['gloo_latency_s']['all_reduce']['1'] / m['comm_latency_s']['all_reduce']['1']:.1f}× |")
    assert len(table) == 2 + 2 * 3
    assert roofline.transport_table({**m, "gloo_latency_s": None}) is None, "gloo installed: nothing beside it"
    assert roofline.latency_s({"1": 1e-5, "100": 1e-3}, 10) == pytest.approx(1e-4)


def test_the_grid_is_every_combination_in_a_stable_order() -> None:
    """``make_cells``: prompt length, TP, batch, layout, KV cache — each combination once."""
    from itertools import product

    grid = matrix.BenchGrid(synthetic="llama-tiny", layouts=(Layout.NAIVE, Layout.DEINFER),
                            kv_caches=(CacheKind.FULL, CacheKind.LATENT), tps=(1, 2), batches=(1, 8),
                            prompt_lens=(16, 64), gen_len=2)
    got = [(c.prompt_len, c.tp, c.batch, c.layout.fixed, c.kv_cache) for c in matrix.make_cells(grid)]
    assert got == list(product((16, 64), (1, 2), (1, 8), (Layout.NAIVE, Layout.DEINFER),
                               (CacheKind.FULL, CacheKind.LATENT)))


def test_failed_cell_is_recorded_and_the_matrix_goes_on(tmp_path) -> None:
    arch = synthetic_arch("llama-tiny")
    source = ModelSource("tiny", arch, RankConfig.from_mapping(uniform_ranks(arch, 0.6), arch), tmp_path, tmp_path)
    grid = matrix.BenchGrid(synthetic="llama-tiny", layouts=(Layout.NAIVE, Layout.DEINFER),
                            kv_caches=(CacheKind.FULL, CacheKind.LATENT), tps=(2,), batches=(1,), gen_len=2)

    def runner(prepared, grid):
        if prepared.spec.parallel.layout.fixed is Layout.NAIVE:
            raise RuntimeError("rank 1 ran out of memory\ntraceback ...")
        return []

    records = matrix.run_matrix(grid, matrix.prepare_cells(grid, source), runner=runner, progress=False)
    assert [r.status for r in records] == [CellStatus.ERROR, CellStatus.SKIPPED, CellStatus.OK, CellStatus.OK]
    assert records[0].error == "RuntimeError: rank 1 ran out of memory"
    failed, skipped = records[0].to_json(), records[1].to_json()
    assert failed["status"] == "error" and failed["error"] == records[0].error and failed["plan"] is not None
    assert skipped["status"] == "skipped" and "deinfer layout only" in skipped["reason"]


@pytest.mark.parametrize("args, message", [
    (["--synthetic", "llama-huge"], "unknown synthetic model 'llama-huge'"),
    (["--synthetic", "llama-tiny", "--tp", "3"], "valid TP sizes"),
    (["--synthetic", "llama-tiny", "--batch", ","], "--batch needs at least one positive integer"),
    (["--synthetic", "llama-tiny", "--layouts", "fast"], "--layouts: unknown value 'fast'"),
    (["--synthetic", "llama-tiny", "--gen-len", "1"], "--gen-len must be at least 2"),
    (["--synthetic", "llama-tiny", "--max-prefill-tokens", "0"], "--max-prefill-tokens must be a positive whole"),
    (["--synthetic", "llama-tiny", "--prompt-len", "4090", "--gen-len", "10"], "exceeds the model's context"),
    (["--synthetic", "llama-tiny", "--layouts", "dense", "--kv-cache", "latent"], "no configuration can run"),
    (["--model", "x", "--ratio", "0.5"], "--ratio applies to --synthetic"),
    (["--synthetic", "llama-tiny", "--peers", "hf,vllm"], "--peers: unknown value 'vllm'; choose from hf,deepspeed"),
    (["--synthetic", "llama-tiny", "--peers", ","], "--peers needs at least one of hf,deepspeed"),
    ([], "give exactly one of --model DIR or --synthetic NAME"),
])
def test_bad_input_is_one_line(args, message, capsys) -> None:
    assert run(["bench", *args, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and err[-1].startswith("deinfer-megatron bench: error:")
