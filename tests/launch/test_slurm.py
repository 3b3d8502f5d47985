"""End to end on a real single-node Slurm cluster: a 2-rank gloo job, then ``generate`` with
2 tasks through scripts/slurm/generate.sbatch, checked against Hugging Face greedy tokens.

Brings the cluster up with tests/helpers/slurm/local_cluster.sh (apt-get installs
slurm-wlm + munge on first use), submits the user scripts scripts/slurm/smoke.sbatch and
generate.sbatch as they are, and checks that the Slurm -> torch.distributed mapping produced a
working process group.

Skipped only when not root or when Slurm is neither installed nor installable
(no apt-get); any failure to bring the cluster up is a test failure.
"""

from __future__ import annotations

import re
import time

import pytest

from tests.helpers.slurm import ensure_cluster, run_sbatch, slurm_skip_reason

_RANK_LINE = re.compile(r"^rank=(\d+) world=(\d+) sum=(\d+)\s*$", re.MULTILINE)


@pytest.fixture(scope="module")
def slurm_cluster() -> None:
    reason = slurm_skip_reason()
    if reason:
        pytest.skip(reason)
    ensure_cluster()  # raises (-> test error) if the cluster cannot be brought up


def test_smoke_sbatch_two_ranks_all_reduce(slurm_cluster: None) -> None:
    t0 = time.monotonic()
    rc, out = run_sbatch("scripts/slurm/smoke.sbatch", "--ntasks=2", "--nodes=1", timeout=240)
    elapsed = time.monotonic() - t0
    print(f"smoke job took {elapsed:.1f}s")
    assert rc == 0, f"smoke.sbatch exited {rc}; output:\n{out}"

    ranks = {int(r): (int(w), int(s)) for r, w, s in _RANK_LINE.findall(out)}
    assert sorted(ranks) == [0, 1], f"expected one line per rank 0 and 1; output:\n{out}"
    for rank, (world, total) in ranks.items():
        assert world == 2, f"rank {rank}: world={world}, expected 2; output:\n{out}"
        assert total == 0 + 1, f"rank {rank}: sum={total}, expected 1; output:\n{out}"


def test_generate_sbatch_two_tasks(slurm_cluster: None, tmp_path) -> None:
    import json

    import torch
    import transformers

    from deinfer_megatron.decompose.job import DecomposeJob, run_decompose
    from tests.helpers.tiny_models import full_ranks, save_tiny_folder

    hf = save_tiny_folder("llama", tmp_path / "dense")
    (tmp_path / "ranks.json").write_text(json.dumps(full_ranks(hf)))
    model = run_decompose(DecomposeJob(tmp_path / "dense", "svd", rank_config=tmp_path / "ranks.json",
                                       out=tmp_path / "dec"))
    prompt = "It is a truth universally acknowledged"
    tok = transformers.AutoTokenizer.from_pretrained(model)
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = hf.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, ids.shape[1]:].tolist()

    rc, out = run_sbatch("scripts/slurm/generate.sbatch", "--ntasks=2", "--nodes=1", timeout=400,
                         script_args=("--model", str(model), "--tp", "2", "--layout", "deinfer", "--kv-cache", "latent",
                                      "--max-new-tokens", "6", "--prompt", prompt, "--json"))
    assert rc == 0, f"generate.sbatch exited {rc}; output:\n{out}"
    docs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(docs) == 1, f"exactly rank 0 reports; output:\n{out}"
    assert docs[0]["tp"] == 2 and docs[0]["outputs"][0]["token_ids"] == expected
